"""Prepacked oneDNN linear layers for CPU inference.

`torch.nn.Linear` on CPU calls a GEMM that re-packs the weight on every call. For one token (M = 1) that is
a cheap GEMV, but for the small M of a verify block (g + 1 tokens) or a batch of sessions the packing costs
as much as the product: on this machine's CPU (1 thread, float32) a 5-token forward of SmolLM2 took ~1.7x a
1-token step. Packing each weight once into oneDNN's blocked layout (what inductor's CPU freezing does)
makes a 2-8 token forward cost much less than it did (6 tokens ~1.4x a 1-token step here), which is the
premise of speculative decoding. A single token is a GEMV bound by memory bandwidth, where oneDNN's packed call
only adds fixed cost: on the AVX2 CPU of session 12, a SmolLM2 1-token step took 80 ms with every large layer
packed and 73 ms with the projections under SINGLE_ROW_PACKED_MIN_ELEMENTS run plain at one row (the LM head,
far larger, stays faster packed). Results are float32 GEMMs as before (differences ~1e-5 from the unpacked
layer, the same order as between two block sizes).
"""

from __future__ import annotations

import functools

import torch


def available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@functools.cache
def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack a weight of this dtype on this CPU: float32 always; bfloat16 needs avx512bw/vl/dq
    or avx_ne_convert (an AVX2-only CPU refuses it, and plain bfloat16 linears still work there)."""
    if dtype not in (torch.float32, torch.bfloat16) or not available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
    except RuntimeError:
        return False
    return True


class PackedLinear(torch.nn.Module):
    """Inference-only drop-in for nn.Linear with its weight prepacked for oneDNN. Keeps `weight` (tied
    embeddings, save_pretrained and anything else that reads it still see the original tensor); the packed
    copy is derived from it and rebuilt when the weight changes (`.to(dtype)`, a load), and is never copied
    or pickled (oneDNN's opaque tensors cannot be)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._packed, self._packed_for = None, None
        self._pack()

    def _key(self):
        w = self.weight
        try:
            version = w._version  # an in-place update (load_state_dict) keeps data_ptr but bumps this
        except RuntimeError:  # inference tensors have no version counter
            version = -1
        return w.dtype, w.device, w.data_ptr(), version

    def _pack(self) -> torch.Tensor:
        key = self._key()
        if self._packed_for != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            self._packed_for = key
        return self._packed

    def packed_for(self, rows: int) -> bool:
        """Whether a call on `rows` input rows uses the packed weight (one row of a layer this small is a GEMV
        that the plain kernel does faster)."""
        return rows > 1 or self.weight.numel() >= SINGLE_ROW_PACKED_MIN_ELEMENTS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (w.device.type != "cpu" or x.dtype != w.dtype or not packable(w.dtype)
                or not self.packed_for(x.shape[:-1].numel())):
            return torch.nn.functional.linear(x, w, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._pack(), self.bias, "none", [], "")

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_packed"], state["_packed_for"] = None, None  # rebuilt on first use
        return state

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn-prepacked"


# A oneDNN call has ~20 us more fixed cost than a plain one (measured here): small layers run faster unpacked.
# Above this size packing wins (SmolLM2's 576x576 attention and 576x1536 MLP weights, every LM head); the tiny
# test models and a 256-wide draft's attention stay plain.
MIN_PACKED_ELEMENTS = 1 << 18
# At one row, only layers at least this large run packed: the LM heads (SmolLM2's is 28M entries: 8 ms packed,
# 10 ms plain), not the transformer blocks' projections (SmolLM2's largest is 0.9M entries).
SINGLE_ROW_PACKED_MIN_ELEMENTS = 1 << 22


def prepack_linears(model: torch.nn.Module, min_elements: int = MIN_PACKED_ELEMENTS) -> int:
    """Replace each nn.Linear of a CPU float32/bfloat16 model (bfloat16 where this CPU can pack it) whose weight
    has more than `min_elements` entries by a PackedLinear; returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (type(child) is torch.nn.Linear and child.weight.numel() > min_elements
                    and child.weight.device.type == "cpu" and packable(child.weight.dtype)):
                setattr(module, name, PackedLinear(child))
                count += 1
    return count


def should_prepack(mode: str, device: torch.device) -> bool:
    """mode: auto (CPU with oneDNN), on (error if impossible), off."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"prepack must be auto, on or off, not {mode!r}")
    if mode == "off":
        return False
    ok = device.type == "cpu" and available()
    if mode == "on" and not ok:
        raise ValueError(f"cannot prepack linear weights on {device} (needs a CPU torch build with oneDNN)")
    return ok
