"""The int8 draft: weight-only int8 linear layers (native kernel and fallback) and the lean Llama forward, against
transformers' forward over the same int8 weights."""

import pytest
import torch

from draft_service.proposers.base import ProposeTask
from draft_service.int8_draft import LeanCachedLM, LeanLlama, int8_draft
from specdec.models import cpu_kernels
from specdec.core.kv_cache import CachedLM, SessionCacheStore, SessionKV, cache_nbytes
from specdec.models import load_model

GQA = "tiny:vocab=96,layers=2,hidden=64,heads=4,kv_heads=2,seed=3,std=0.3"


def _dequantized(layer: cpu_kernels.Int8Linear) -> torch.Tensor:
    return layer.qweight.float() * layer.scale[:, None]


def test_quantize_int8_rounds_each_row_to_its_own_scale():
    w = torch.randn(37, 50) * torch.linspace(0.01, 5, 37)[:, None]  # rows of very different ranges
    q, scale = cpu_kernels.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (37,)
    assert q.abs().amax(dim=1).eq(127).all()  # every row uses its full range
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


def _vnni() -> bool:
    fn = cpu_kernels.native_gemm()
    return fn is not None and fn.int8_a16 is not None


def _rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the int16-activation kernel sees it: each row rounded at its own scale, its largest value mapped to the
    largest integer whose products cannot overflow int32 sums (2^31 / (K * 127), at most 32767)."""
    top = float(min(32767, int(2147483647 / (x.shape[-1] * 127))))
    scale = x.abs().amax(dim=-1, keepdim=True) / top
    return torch.round(x * (1 / scale)) * scale


@pytest.mark.parametrize("activations", ["float32", "int16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_computes_the_dequantized_product(rows, bias, activations):
    if activations == "int16" and not _vnni():
        pytest.skip("int16 activations need AVX-512 VNNI, which this CPU lacks")
    torch.manual_seed(rows)
    lin = torch.nn.Linear(70, 45, bias=bias)  # K not a multiple of 8 (nor of 64), N not a multiple of any block
    layer = cpu_kernels.Int8Linear(lin)
    layer.int16_activations = activations == "int16"
    x = torch.randn(rows, 70)
    ref = torch.nn.functional.linear(x if activations == "float32" else _rounded_rows(x), _dequantized(layer),
                                     layer.bias)
    torch.testing.assert_close(layer(x), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer(x.view(1, rows, 70)), ref.view(1, rows, 45), atol=1e-4, rtol=1e-4)


def test_int8_linear_runs_natively_here_and_falls_back_without_the_kernel(monkeypatch):
    assert cpu_kernels.native_gemm() is not None, "this machine (x86-64, AVX2, g++) should build the kernel"
    lin = torch.nn.Linear(64, 32)
    layer = cpu_kernels.Int8Linear(lin)
    layer.int16_activations = False  # the fallback multiplies float32 activations
    x = torch.randn(3, 64)
    native = layer(x)
    monkeypatch.setattr(cpu_kernels, "native_gemm", lambda: None)
    torch.testing.assert_close(layer(x), native, atol=1e-4, rtol=1e-4)


def test_int16_activations_are_used_where_the_cpu_has_vnni_and_can_be_switched_off(monkeypatch):
    assert cpu_kernels.int16_activations() == _vnni()
    assert cpu_kernels.Int8Linear(torch.nn.Linear(64, 32)).int16_activations == _vnni()
    monkeypatch.setenv("SPECDEC_INT16_ACTIVATIONS", "off")
    cpu_kernels.int16_activations.cache_clear()
    try:
        assert not cpu_kernels.int16_activations()
        assert not cpu_kernels.Int8Linear(torch.nn.Linear(64, 32)).int16_activations
    finally:
        cpu_kernels.int16_activations.cache_clear()


def test_quantize_linears_replaces_large_layers_only():
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(4, 4))
    assert cpu_kernels.quantize_linears(model) == 1
    assert isinstance(model[0], cpu_kernels.Int8Linear) and type(model[1]) is torch.nn.Linear


def _pair(spec: str, int16_activations: bool = False):
    """The lean int8 draft and transformers' forward over the same int8 weights, each with its own model copy,
    both with float32 or both with int16 activations."""
    lean_model = load_model(spec, device="cpu", dtype="float32", prepack="off")
    hf_model = load_model(spec, device="cpu", dtype="float32", prepack="off")
    lean = int8_draft(lean_model, SessionCacheStore())
    assert isinstance(lean, LeanCachedLM)
    hf_model.ragged_batch = False
    lean_head = lean.lean.head
    hf = CachedLM(hf_model, SessionCacheStore())
    cpu_kernels.quantize_linears(hf_model.model, min_elements=0)
    # quantize_linears quantises the tied head like LeanLlama does: same int8 weights on both sides
    torch.testing.assert_close(hf_model.model.get_output_embeddings().qweight, lean_head.qweight, rtol=0, atol=0)
    lean.lean.set_int16_activations(int16_activations)
    for m in hf_model.model.modules():
        if isinstance(m, cpu_kernels.Int8Linear):
            m.int16_activations = int16_activations
    return lean, hf


@pytest.mark.parametrize("native", [True, False], ids=["native-stack", "torch-ops"])
@pytest.mark.parametrize("spec", ["tiny:vocab=64,layers=2,hidden=64,seed=0,std=0.3", GQA])
def test_lean_forward_matches_transformers_on_the_same_int8_weights(spec, native):
    """With float32 activations on both sides (int16 ones round each side's slightly different floats apart)."""
    lean, hf = _pair(spec)
    assert lean.lean.native is not None  # built here; the torch ops are the fallback elsewhere
    if not native:
        lean.lean.native = None
    tokens = [int(t) for t in torch.randint(0, 64, (23,), generator=torch.Generator().manual_seed(1))]
    a, b = SessionKV("s"), SessionKV("s")
    # a prefill, then single tokens, then a block: the three shapes a draft sees
    for chunk in (tokens[:9], tokens[9:10], tokens[10:11], tokens[11:17], tokens[17:]):
        torch.testing.assert_close(lean.extend(a, chunk), hf.extend(b, chunk), atol=2e-4, rtol=1e-4)
    assert a.tokens == b.tokens == tokens


@pytest.mark.parametrize("spec", ["tiny:vocab=64,layers=2,hidden=64,seed=0,std=0.3", GQA])
def test_int16_activations_change_the_logits_by_rounding_only(spec):
    if not _vnni():
        pytest.skip("int16 activations need AVX-512 VNNI, which this CPU lacks")
    (floats, _), (ints, _) = _pair(spec, int16_activations=False), _pair(spec, int16_activations=True)
    tokens = [int(t) for t in torch.randint(0, 64, (23,), generator=torch.Generator().manual_seed(1))]
    x, y = floats.extend(SessionKV("s"), tokens, keep=23), ints.extend(SessionKV("s"), tokens, keep=23)
    assert 0 < (x - y).norm() / x.norm() < 1e-3
    assert torch.equal(x.argmax(-1), y.argmax(-1))


def test_lean_cache_crops_grows_and_counts_its_bytes():
    lean, _ = _pair(GQA)
    tokens = list(range(1, 90))
    whole = lean.extend(SessionKV("w"), tokens)
    s = SessionKV("s")
    lean.extend(s, tokens[:40])
    lean.extend(s, [5, 6, 7])  # rejected drafts
    lean.sync(s, 40, tokens[40:41])
    lean.crop(s, 40)
    assert s.cache.length == 40 and len(s.tokens) == 40
    got = lean.extend(s, tokens[40:])
    torch.testing.assert_close(got, whole[40:], atol=1e-4, rtol=1e-4)
    before = cache_nbytes(s.cache)
    lean.extend(s, [t % 96 for t in range(1, 300)])  # 388 positions: the buffer doubles
    assert s.cache.keys.shape[2] >= 388 and cache_nbytes(s.cache) > before
    assert cache_nbytes(s.cache) == 2 * s.cache.keys.numel() * 4


def test_int8_draft_keeps_transformers_forward_for_other_architectures(monkeypatch):
    loaded = load_model("tiny:vocab=64,layers=1,hidden=32,seed=0", device="cpu", dtype="float32", prepack="off")
    monkeypatch.setattr(LeanLlama, "supports", staticmethod(lambda model: "pretend: not a Llama"))
    lm = int8_draft(loaded, SessionCacheStore())
    assert type(lm) is CachedLM
    assert any(isinstance(m, cpu_kernels.Int8Linear) for m in loaded.model.modules())
    out = lm.extend(SessionKV("s"), [1, 2, 3])
    assert out.shape == (3, 64) and torch.isfinite(out).all()


def test_lean_llama_refuses_what_it_does_not_implement():
    loaded = load_model("tiny:vocab=64,layers=1,hidden=32,seed=0", device="cpu", dtype="float32", prepack="off")
    assert LeanLlama.supports(loaded.model) is None
    loaded.model.config.hidden_act = "gelu"
    assert "activation" in LeanLlama.supports(loaded.model)


def test_a_cancelled_propose_stops_between_tokens_and_leaves_an_unstarted_session_alone():
    from draft_service.proposers.model import ModelProposer
    from specdec.core.sampling import SamplingParams

    loaded = load_model(GQA, device="cpu", dtype="float32", prepack="off")
    store = SessionCacheStore()
    proposer = ModelProposer(loaded, store, int8_draft(loaded, store))
    greedy = SamplingParams(0.0, 0, 1.0)
    whole = proposer.get_candidates(ProposeTask("a", 0, [1, 2, 3], 6, greedy, 0, 0))
    assert len(whole.tokens) == 6
    calls = []

    def stop_after_two():
        calls.append(1)
        return len(calls) > 2  # checked once before the session is touched, then after each token

    part = proposer.get_candidates(ProposeTask("b", 0, [1, 2, 3], 6, greedy, 0, 0, should_stop=stop_after_two))
    assert part.tokens == whole.tokens[:2]
    before = list(store.get("b").tokens)
    none = proposer.get_candidates(ProposeTask("b", 1, [9, 9, 9], 6, greedy, 0, 1, should_stop=lambda: True))
    assert none.tokens == [] and store.get("b").tokens == before  # not cropped, not extended


def test_auto_draft_strategy_takes_the_int8_copy_of_smollm2_where_it_runs(monkeypatch):
    from launcher.stack import StackConfig, draft_model_args, resolve_draft_strategy

    assert resolve_draft_strategy(StackConfig(target_model="smollm2")) == "quantized"
    assert draft_model_args("quantized", "smollm2-draft", "smollm2") == ["--model", "smollm2", "--vocab-from",
                                                                         "smollm2"]  # the target's own weights
    assert resolve_draft_strategy(StackConfig(target_model="tiny", draft_model="tiny")) == "model"  # not SmolLM2
    monkeypatch.setattr(cpu_kernels, "native_gemm", lambda: None)  # no AVX2 / g++: the n-gram or distilled draft
    assert resolve_draft_strategy(StackConfig(target_model="smollm2")) in ("ngram", "model")
