"""The student: a small Llama with the target's vocabulary, its embedding the target's projected on the
top principal directions of the target's hidden states (or a truncated SVD); saved atomically."""

from __future__ import annotations

import copy
import json
import logging
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from offline.distill.config import DistillConfig, REPORT_NAME
from offline.distill.teacher import TeacherData, _output_embedding

logger = logging.getLogger("specdec.distill")


def svd_embedding(weight: torch.Tensor, dim: int, seed: int = 0) -> torch.Tensor:
    """Rank-``dim`` PCA of the (centred) embedding matrix: rows ``(E - mean) @ V_dim``.

    The mean row adds the same amount to every logit, so centring removes a
    direction that is useless for prediction.  If ``dim`` exceeds the rank,
    the extra columns are small random values.
    """
    E = weight.detach().float().cpu()
    E = E - E.mean(dim=0, keepdim=True)
    r = min(dim, E.shape[1], E.shape[0])
    U, S, Vh = torch.linalg.svd(E, full_matrices=False)
    out = U[:, :r] * S[:r]
    if r < dim:
        g = torch.Generator().manual_seed(seed)
        extra = torch.randn(E.shape[0], dim - r, generator=g) * out.std() * 0.1
        out = torch.cat([out, extra], dim=1)
    return out


@dataclass
class HiddenBasis:
    """Top principal directions of the teacher's final normed hidden states (uncentred second moment)."""

    P: torch.Tensor  # (H_teacher, k), orthonormal columns
    ev: torch.Tensor  # (k,) second moment along each direction
    energy: float  # fraction of the total second moment captured


def hidden_pca(data: TeacherData, k: int) -> HiddenBasis | None:
    if not data.has_hidden:
        return None
    H = torch.cat([h.float() for h in data.hidden])
    C = H.t() @ H / H.shape[0]
    ev, vec = torch.linalg.eigh(C.double())
    ev, vec = ev.flip(0).clamp_min(0), vec.flip(1)
    r = min(k, H.shape[1])
    P = vec[:, :r].float()
    # fix the sign of each direction (eigh's sign is arbitrary): largest-|.| entry positive
    sign = torch.sign(P.gather(0, P.abs().argmax(0, keepdim=True)))
    P = P * sign
    return HiddenBasis(P=P, ev=ev[:r].float(), energy=float(ev[:r].sum() / ev.sum().clamp_min(1e-30)))


def build_student(teacher: Any, cfg: DistillConfig, basis: HiddenBasis | None = None) -> Any:
    """A Llama with the teacher's vocabulary and tied embeddings, initialised per ``cfg.init``.

    ``"hidden-pca"`` (needs ``basis``): embedding = E @ P where E is the
    teacher's output embedding and P the top ``hidden`` principal directions
    of the teacher's final hidden states, and final-norm weights sqrt(ev), so
    that a student whose final hidden equals the teacher's (projected on P)
    reproduces the teacher's logits restricted to that subspace.
    """
    import transformers

    tc = teacher.config
    head_dim = cfg.hidden // cfg.heads
    kwargs: dict[str, Any] = {}
    rope = getattr(tc, "rope_parameters", None)
    if rope:
        kwargs["rope_parameters"] = dict(rope)
    elif getattr(tc, "rope_theta", None):
        kwargs["rope_theta"] = tc.rope_theta
    vocab = int(_output_embedding(teacher).shape[0])
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=head_dim, max_position_embeddings=int(getattr(tc, "max_position_embeddings", 2048)),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-5)), tie_word_embeddings=True,
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
        initializer_range=0.02, **kwargs,
    )
    torch.manual_seed(cfg.seed)
    student = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    init = cfg.init
    if init == "hidden-pca" and (basis is None or basis.P.shape[1] < cfg.hidden):
        logger.warning("hidden-pca init needs teacher hidden states with >= %d dims; using svd init", cfg.hidden)
        init = "svd"
    with torch.no_grad():
        emb = student.get_input_embeddings().weight
        if init == "hidden-pca":
            assert basis is not None
            emb.copy_(_output_embedding(teacher).float().cpu() @ basis.P[:, : cfg.hidden])
            student.model.norm.weight.copy_(basis.ev[: cfg.hidden].clamp_min(1e-12).sqrt())
        else:
            if init == "svd":
                emb.copy_(svd_embedding(_output_embedding(teacher), cfg.hidden, cfg.seed))
            elif init != "random":
                raise ValueError(f"unknown init {cfg.init!r} (hidden-pca, svd or random)")
            student.model.norm.weight.fill_(cfg.norm_init)
    student.tie_weights()
    gen_cfg = getattr(teacher, "generation_config", None)
    if gen_cfg is not None:
        student.generation_config.eos_token_id = gen_cfg.eos_token_id
        student.generation_config.pad_token_id = gen_cfg.pad_token_id
        student.generation_config.bos_token_id = gen_cfg.bos_token_id
    return student


def truncated_target(teacher: Any, n_layers: int) -> Any:
    """The target's first ``n_layers`` decoder layers + its final norm and lm_head (weights shared, not copied).

    Shallow copies with their own module tables, so the teacher is left untouched.
    """
    inner = copy.copy(teacher.model)
    inner._modules = dict(teacher.model._modules)
    inner._modules["layers"] = torch.nn.ModuleList(list(teacher.model.layers)[:n_layers])
    m = copy.copy(teacher)
    m._modules = dict(teacher._modules)
    m._modules["model"] = inner
    cfg = copy.deepcopy(teacher.config)
    cfg.num_hidden_layers = n_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:n_layers]
    m.config = cfg
    inner.config = cfg
    return m


_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "fp16": torch.float16}


def _dir_size(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_atomically(student: Any, tokenizer: Any, out: pathlib.Path, dtype: torch.dtype, report: dict[str, Any]) -> int:
    """save_pretrained + tokenizer + report into a temp dir next to ``out``, then rename into place."""
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model = copy.deepcopy(student).to(dtype)
        model.config.dtype = dtype
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        size = _dir_size(tmp)
        report = dict(report, model_dir=str(out), model_size_bytes=size,
                      weights_size_bytes=sum(f.stat().st_size for f in tmp.glob("*.safetensors")))
        with open(tmp / REPORT_NAME, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        from specdec.models import replace_dir

        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return size
