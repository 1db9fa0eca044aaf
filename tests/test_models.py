"""Tests for specdec.models (tiny models, local dirs, the SmolLM2 cache, errors)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from specdec import models as M

REPO_ROOT = Path(__file__).resolve().parent.parent


def _logits(lm: M.LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        x = torch.tensor([ids], device=lm.device)
        return lm.model(input_ids=x).logits[0].float().cpu()


def _state_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _greedy(lm: M.LoadedModel, ids: list[int], n: int) -> list[int]:
    out = lm.model.generate(
        torch.tensor([ids], device=lm.device),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=lm.device),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
    )
    return out[0, len(ids):].tolist()


# --------------------------------------------------------------------------
# tiny
# --------------------------------------------------------------------------


def test_tiny_deterministic_across_loads():
    a = M.load_model("tiny")
    b = M.load_model("tiny")
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    ids = [1, 5, 9, 63, 2]
    assert torch.equal(_logits(a, ids), _logits(b, ids))


def test_tiny_deterministic_across_processes():
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from specdec import models as M\n"
        "from tests.test_models import _state_digest\n"
        "print(_state_digest(M.load_model('tiny:seed=3,layers=1').model))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == _state_digest(M.load_model("tiny:seed=3,layers=1").model)


def test_tiny_does_not_touch_global_rng():
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    M.load_model("tiny")
    assert torch.equal(torch.rand(4), expected)


def test_tiny_seeds_differ():
    a = M.load_model("tiny")
    b = M.load_model("tiny:seed=1")
    assert not torch.equal(
        a.model.model.embed_tokens.weight, b.model.model.embed_tokens.weight
    )
    assert not torch.equal(_logits(a, [1, 2, 3]), _logits(b, [1, 2, 3]))
    # Same vocabulary -> same tokenizer.
    assert a.fingerprint == b.fingerprint


def test_tiny_metadata():
    lm = M.load_model("tiny", device="cpu")
    assert lm.name == "tiny"
    assert lm.device == torch.device("cpu")
    assert lm.dtype == torch.float32
    assert lm.vocab_size == 64
    assert lm.max_context == 1024
    assert lm.eos_token_ids == [0]
    assert lm.fingerprint == M.tokenizer_fingerprint(lm.tokenizer)
    assert not lm.model.training
    assert all(not p.requires_grad for p in lm.model.parameters())
    assert lm.model.generation_config.pad_token_id == 0
    # sdpa for ordinary calls, per-session attention in batched forwards (specdec/models/ragged_batch.py)
    assert lm.model.config._attn_implementation == "specdec" and lm.ragged_batch
    assert M.load_model("tiny", ragged=False).model.config._attn_implementation == "sdpa"
    assert _logits(lm, [1, 2, 3]).shape == (3, 64)

    lm = M.load_model("tiny:vocab=100, layers=1, hidden=32, heads=2, kv_heads=1, inter=48, ctx=256, seed=7")
    assert lm.vocab_size == 100
    assert lm.max_context == 256
    assert lm.model.config.num_hidden_layers == 1
    assert lm.model.config.hidden_size == 32
    assert lm.model.config.num_key_value_heads == 1
    assert _logits(lm, [99]).shape == (1, 100)


def test_tiny_dtype():
    lm = M.load_model("tiny", dtype="bfloat16")
    assert lm.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in lm.model.parameters())
    assert torch.isfinite(_logits(lm, [1, 2])).all()


def test_tiny_weights_look_sane():
    w = M.load_model("tiny").model.model.layers[0].self_attn.q_proj.weight
    assert abs(w.std().item() - 0.02) < 0.002
    assert abs(w.mean().item()) < 0.002
    big = M.load_model("tiny:std=0.5").model.model.layers[0].self_attn.q_proj.weight
    assert abs(big.std().item() - 0.5) < 0.05


def test_tiny_tokenizer_roundtrip():
    tok = M.load_tokenizer("tiny")
    assert isinstance(tok, __import__("transformers").PreTrainedTokenizerFast)
    assert tok.eos_token == "<eos>"
    assert tok.eos_token_id == 0
    assert tok.convert_ids_to_tokens([0, 1, 63]) == ["<eos>", "t1", "t63"]
    assert len(tok) == 64
    assert tok("t3 t5  t63").input_ids == [3, 5, 63]
    assert tok.decode([3, 5]) == "t3 t5"
    assert tok.decode(tok("t1 t2 t3").input_ids) == "t1 t2 t3"
    assert tok.decode([3, 0, 5], skip_special_tokens=True) == "t3 t5"
    # Unknown words map to <eos> instead of raising.
    assert tok("hello t4").input_ids == [0, 4]


def test_tiny_fingerprints():
    f64 = M.tokenizer_fingerprint(M.load_tokenizer("tiny"))
    assert f64 == M.tokenizer_fingerprint(M.load_tokenizer("tiny:vocab=64,seed=9,layers=3"))
    assert f64 == M.load_model("tiny:seed=5").fingerprint
    assert f64 != M.tokenizer_fingerprint(M.load_tokenizer("tiny:vocab=65"))
    assert len(f64) == 64 and int(f64, 16) >= 0


def test_tiny_is_fast():
    t0 = time.monotonic()
    M.load_model("tiny")
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize(
    "spec",
    [
        "tiny:foo=1",
        "tiny:vocab",
        "tiny:vocab=abc",
        "tiny:vocab=1",
        "tiny:hidden=65",
        "tiny:heads=4,kv_heads=3",
        "tiny:layers=0",
    ],
)
def test_tiny_bad_spec(spec):
    with pytest.raises(ValueError, match="tiny model spec"):
        M.load_model(spec)


# --------------------------------------------------------------------------
# local directory / hf: / errors
# --------------------------------------------------------------------------


def test_local_directory_roundtrip(tmp_path):
    mem = M.load_model("tiny:seed=4")
    out = tmp_path / "my-model"
    mem.model.save_pretrained(out)
    mem.tokenizer.save_pretrained(out)
    for spec in (str(out), f"hf:{out}"):
        disk = M.load_model(spec)
        assert disk.name == spec
        assert disk.vocab_size == 64
        assert disk.max_context == 1024
        assert disk.eos_token_ids == [0]
        assert disk.fingerprint == mem.fingerprint
        assert not disk.model.training
        assert all(not p.requires_grad for p in disk.model.parameters())
        ids = [1, 7, 3, 63]
        assert torch.equal(_logits(disk, ids), _logits(mem, ids))
        assert M.tokenizer_fingerprint(M.load_tokenizer(spec)) == mem.fingerprint
        assert M.load_tokenizer(spec).decode([3, 5]) == "t3 t5"


def test_missing_draft(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    assert M.cache_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match="specdec distill"):
        M.load_model(M.DEFAULT_DRAFT_MODEL)
    with pytest.raises(FileNotFoundError, match="specdec distill"):
        M.load_tokenizer("smollm2-draft")


def test_draft_present(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    mem = M.load_model("tiny:seed=2")
    out = tmp_path / "models" / "smollm2-draft"
    mem.model.save_pretrained(out)
    mem.tokenizer.save_pretrained(out)
    lm = M.load_model("smollm2-draft")
    assert lm.name == "smollm2-draft"
    assert torch.equal(_logits(lm, [4, 5]), _logits(mem, [4, 5]))


def test_bad_specs(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # fast failure even where a hub is reachable
    with pytest.raises(ValueError, match="empty"):
        M.load_model("")
    with pytest.raises(FileNotFoundError, match="nope"):
        M.load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no-such.gguf"):
        M.load_model(str(tmp_path / "no-such.gguf"))
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        M.load_model(str(tmp_path / "empty-dir"))
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError, match="no model hub") as info:
        M.load_model("no-such-org/no-such-model")
    assert "no-such-org/no-such-model" in str(info.value)
    with pytest.raises(FileNotFoundError, match="no model hub"):
        M.load_tokenizer("hf:no-such-model-xyz")
    assert time.monotonic() - t0 < 10


def test_cache_dir_default(monkeypatch):
    monkeypatch.delenv("SPECDEC_CACHE_DIR", raising=False)
    assert M.cache_dir() == Path.home() / ".cache" / "specdec"
    monkeypatch.setenv("SPECDEC_CACHE_DIR", "/some/where")
    assert M.cache_dir() == Path("/some/where")


def test_resolve_device_dtype():
    cpu = torch.device("cpu")
    assert M.resolve_device("cpu") == cpu
    assert M.resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert M.resolve_dtype("auto", cpu) == torch.float32
    assert M.resolve_dtype("float32", cpu) == torch.float32
    assert M.resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert M.resolve_dtype("float16", cpu) == torch.float16
    assert M.resolve_dtype("auto", torch.device("cuda")) in (torch.bfloat16, torch.float16)
    with pytest.raises(ValueError):
        M.resolve_dtype("int3", cpu)
    with pytest.raises(ValueError):
        M.resolve_device("banana")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            M.resolve_device("cuda:1")


# --------------------------------------------------------------------------
# the cache mechanism (fast, with a fake builder)
# --------------------------------------------------------------------------


def test_cache_builds_once_under_concurrency(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    calls = []
    seen_partial = []

    def build(out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        time.sleep(0.3)
        (out / "weights.bin").write_bytes(b"x" * 1000)

    results = []

    def worker():
        p = M.ensure_cached_model("fake", build, {"v": 1})
        if not (p / "weights.bin").exists():
            seen_partial.append(p)
        results.append(p)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = tmp_path / "models" / "fake"
    assert len(calls) == 1
    assert results == [final] * 4
    assert not seen_partial
    assert json.loads((final / M.CACHE_MARKER).read_text())["source"] == {"v": 1}
    assert not list((tmp_path / "models").glob(".fake.tmp-*"))

    # Same source: nothing rebuilt.  New source: rebuilt once.
    mtime = (final / "weights.bin").stat().st_mtime_ns
    M.ensure_cached_model("fake", build, {"v": 1})
    assert len(calls) == 1 and (final / "weights.bin").stat().st_mtime_ns == mtime
    M.ensure_cached_model("fake", build, {"v": 2})
    assert len(calls) == 2
    assert json.loads((final / M.CACHE_MARKER).read_text())["source"] == {"v": 2}


def test_cache_failed_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    (tmp_path / "models" / ".fake.tmp-stale").mkdir(parents=True)

    def build(out: Path) -> None:
        (out / "half").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        M.ensure_cached_model("fake", build)
    assert not (tmp_path / "models" / "fake").exists()
    assert not list((tmp_path / "models").glob(".fake.tmp-*"))


# --------------------------------------------------------------------------
# SmolLM2 (uses the session-wide cache: $SPECDEC_CACHE_DIR or ~/.cache/specdec)
# --------------------------------------------------------------------------

PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return M.ensure_smollm2()


@pytest.fixture(scope="session")
def smollm2_cached(smollm2_dir) -> M.LoadedModel:
    return M.load_model("smollm2", device="cpu")


@pytest.fixture(scope="session")
def smollm2_gguf() -> M.LoadedModel:
    return M.load_model(str(M.smollm2_gguf_path()), device="cpu")


@pytest.mark.smollm2
def test_smollm2_converts_once(smollm2_dir):
    d = smollm2_dir
    assert d == M.cache_dir() / "models" / "smollm2-135m-instruct"
    for name in ("config.json", "model.safetensors", "tokenizer.json", M.CACHE_MARKER):
        assert (d / name).is_file(), name
    config = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "float32"
    before = {f.name: f.stat().st_mtime_ns for f in d.iterdir()}
    t0 = time.monotonic()
    assert M.ensure_smollm2() == d
    assert time.monotonic() - t0 < 5.0  # a conversion takes 20 s and more; a loaded host may take a second to look
    assert {f.name: f.stat().st_mtime_ns for f in d.iterdir()} == before


@pytest.mark.smollm2
def test_smollm2_cached_model(smollm2_cached):
    lm = smollm2_cached
    assert lm.name == "smollm2"
    assert lm.dtype == torch.float32
    assert lm.vocab_size == 49152
    assert lm.max_context == 8192
    assert lm.tokenizer.eos_token == "<|im_end|>"
    assert lm.tokenizer.eos_token_id in lm.eos_token_ids
    assert not lm.model.training
    assert all(not p.requires_grad for p in lm.model.parameters())
    ids = lm.tokenizer(PROMPT).input_ids
    logits = _logits(lm, ids)
    assert logits.shape == (len(ids), 49152)
    assert torch.isfinite(logits).all()
    # The alias loads the same directory.
    assert M.load_tokenizer("smollm2-135m-instruct").get_vocab() == lm.tokenizer.get_vocab()


@pytest.mark.smollm2
def test_smollm2_tokenizer_matches_gguf(smollm2_cached, smollm2_gguf):
    assert smollm2_cached.fingerprint == smollm2_gguf.fingerprint
    assert M.tokenizer_fingerprint(M.load_tokenizer("smollm2")) == smollm2_gguf.fingerprint
    assert smollm2_cached.fingerprint != M.tokenizer_fingerprint(M.load_tokenizer("tiny"))
    text = "Hello, world! Speculative decoding\tis fun: 12345 ü"
    assert smollm2_cached.tokenizer(text).input_ids == smollm2_gguf.tokenizer(text).input_ids
    assert smollm2_cached.eos_token_ids == smollm2_gguf.eos_token_ids
    assert smollm2_cached.tokenizer.chat_template == smollm2_gguf.tokenizer.chat_template


@pytest.mark.smollm2
def test_smollm2_tokenizer_without_cache(tmp_path, monkeypatch, smollm2_gguf):
    # With no converted cache, load_tokenizer reads the GGUF (no conversion).
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    tok = M.load_tokenizer("smollm2")
    assert M.tokenizer_fingerprint(tok) == smollm2_gguf.fingerprint
    assert not (tmp_path / "models").exists()


@pytest.mark.smollm2
def test_smollm2_cached_matches_gguf(smollm2_cached, smollm2_gguf):
    ids = smollm2_cached.tokenizer(PROMPT).input_ids
    assert torch.allclose(_logits(smollm2_cached, ids), _logits(smollm2_gguf, ids), atol=1e-4, rtol=0)
    a = _greedy(smollm2_cached, ids, 6)
    b = _greedy(smollm2_gguf, ids, 6)
    assert a == b
    assert "Paris" in smollm2_cached.tokenizer.decode(a)
