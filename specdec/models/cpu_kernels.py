"""Fast linear layers for CPU inference: a native few-row GEMM and oneDNN-prepacked weights.

`torch.nn.Linear` on CPU calls a GEMM that re-packs the weight on every call. For one token (M = 1) that is a
GEMV, but for the small M of a verify block (g + 1 tokens) the packing costs as much as the product: a 5-token
forward of SmolLM2 took ~1.7x a 1-token step. Packing each weight once into oneDNN's blocked layout (what
inductor's CPU freezing does) brought a 6-token forward to ~1.5x a step (on an AVX2 CPU). At these M a
layer is bound by streaming its weight from memory, and oneDNN's kernel lets the FMAs and the stream take
turns; `csrc/skinny_gemm.cpp` (AVX2 + FMA, built with g++ at first use and cached) reads each weight row once
for up to 6 input rows and prefetches the next rows meanwhile: on that CPU a 1536x576 layer streamed
from memory took 219 us at one row and 281 at six (oneDNN packed: 259 / 373; plain: 282 / 534), and SmolLM2's
forward went from 74 to 65 ms at one token and from 115 to 84 ms at six (1.55 -> 1.29 steps).

So a FastLinear runs up to NATIVE_MAX_ROWS rows natively (float32, one torch thread: the kernel is
single-threaded), more rows (a prompt's prefill, large batches) through the oneDNN-packed weight, and anything else
(bfloat16, grad, other devices) as before. The native kernel's rows are independent (each output is summed in
the same order whatever M is), so a verify block's projections equal the decode step's bit for bit.
SPECDEC_NATIVE_GEMM=off turns it off; without g++, AVX2 or FMA it is skipped with one log line.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import time

import torch

logger = logging.getLogger(__name__)

# One library: the few-row float32 GEMM (and its int8-weight variant), and the int8 Llama decoder stack.
NATIVE_SOURCES = tuple(pathlib.Path(__file__).with_name("csrc") / name
                       for name in ("skinny_gemm.cpp", "int8_llama.cpp"))
NATIVE_FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
NATIVE_VERSION = 3
# Rows up to which the native kernel is used. On an AVX2 CPU it beat oneDNN's packed GEMM at every row
# count from 1 to 32 on SmolLM2's MLP shapes (1536x576 / 576x1536 streamed from memory, us: 6 rows 280 / 284
# against 408 / 420; 12 rows 511 / 436 against 567 / 546; 24 rows 803 / 818 against 829 / 933), by less as
# the rows grow: past 24 oneDNN's compute-bound kernel is left the larger batches.
NATIVE_MAX_ROWS = 24
# Smaller layers stay nn.Linear: a ctypes call costs a few microseconds, as much as such a product.
NATIVE_MIN_ELEMENTS = 1 << 14


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


def kernel_dir() -> pathlib.Path:
    """``$SPECDEC_KERNEL_DIR`` or ``<model cache>/kernels``: where built native kernels are kept."""
    env = os.environ.get("SPECDEC_KERNEL_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    from specdec.models.cache import cache_dir

    return cache_dir() / "kernels"


def _native_unsupported_reason() -> str | None:
    if os.environ.get("SPECDEC_NATIVE_GEMM", "auto").lower() in ("0", "off", "false", "no"):
        return "SPECDEC_NATIVE_GEMM=off"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"this CPU has no AVX2 + FMA (torch reports {torch.backends.cpu.get_cpu_capability()})"
    return None


def build_native(directory: pathlib.Path | None = None, cxx: str | None = None) -> pathlib.Path:
    """Compile csrc/*.cpp (NATIVE_SOURCES) once per source and flags (the file name carries their hash) and return
    the shared library. Safe when several processes build at once: each writes a temporary file and renames."""
    source = b"".join(path.read_bytes() for path in NATIVE_SOURCES)
    digest = hashlib.sha256(source + " ".join(NATIVE_FLAGS).encode()).hexdigest()[:16]
    directory = directory or kernel_dir()
    target = directory / f"skinny_gemm-{digest}.so"
    if target.exists():  # built already (the images build it, then drop the compiler)
        return target
    cxx = cxx or os.environ.get("CXX") or "g++"
    compiler = shutil.which(cxx)
    if compiler is None:
        raise RuntimeError(f"no C++ compiler {cxx!r} on PATH")
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *NATIVE_FLAGS, "-o", tmp, *map(str, NATIVE_SOURCES)], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built the native GEMM kernel %s in %.1fs", target, time.monotonic() - t0)
    return target


@functools.cache
def native_gemm():
    """The native kernel's entry point (ctypes, releases the GIL while it runs), or None where it cannot be
    used here (the reason is logged once)."""
    reason = _native_unsupported_reason()
    if reason is None:
        try:
            lib = ctypes.CDLL(str(build_native()))
            if lib.specdec_skinny_gemm_version() != NATIVE_VERSION:
                raise RuntimeError("the built kernel's version does not match this code")
            fn = lib.specdec_skinny_gemm
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
            fn.restype = ctypes.c_int
            fn.int8 = lib.specdec_int8_gemm
            fn.int8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3
            fn.int8.restype = ctypes.c_int
            fn.int8_a16 = None  # int16 activations, integer products: AVX-512 VNNI only (int16_activations)
            if lib.specdec_int8_gemm_a16_available():
                fn.int8_a16 = lib.specdec_int8_gemm_a16
                fn.int8_a16.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3
                fn.int8_a16.restype = ctypes.c_int
            fn.lib = lib
            return fn
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            reason = str(e)
    logger.info("native few-row GEMM not used (%s): linear layers run on oneDNN / the plain kernel", reason)
    return None


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias on the native kernel: float32 CPU tensors, weight and bias contiguous, at most
    NATIVE_MAX_ROWS rows in x (all but its last dimension)."""
    fn = native_gemm()
    if fn is None:
        raise RuntimeError("the native GEMM kernel is not available here")
    k = weight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"native_linear: x has {x.shape[-1]} features, the weight {k}")
    m = x.numel() // k if k else 0
    if not 1 <= m <= NATIVE_MAX_ROWS or x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"native_linear takes 1..{NATIVE_MAX_ROWS} float32 rows, got {m} {x.dtype}")
    return _native_call(fn, x, weight, bias, m)


def _native_call(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """The kernel call itself, on inputs already checked (FastLinear.kernel_for checks them per call)."""
    if not x.is_contiguous():
        x = x.contiguous()
    n, k = weight.shape
    y = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32)
    if fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), rows, n, k):
        raise RuntimeError(f"native GEMM refused {rows} x {k} @ {k} x {n}")
    return y


class FastLinear(torch.nn.Module):
    """Inference-only drop-in for nn.Linear on CPU. Keeps `weight` (tied embeddings, save_pretrained and
    anything else that reads it still see the original tensor). A call runs on the native kernel when it can
    (see the module docstring); otherwise, with `pack`, on a oneDNN-packed copy of the weight, derived from it
    at construction and rebuilt when the weight changes (`.to(dtype)`, a load), never copied or pickled (oneDNN's
    opaque tensors cannot be); otherwise as nn.Linear."""

    def __init__(self, linear: torch.nn.Linear, pack: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.pack = pack
        self._packed, self._packed_for = None, None
        if pack and packable(self.weight.dtype):
            self._pack()  # now, not in the first request: any prompt over NATIVE_MAX_ROWS tokens needs it

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

    def kernel_for(self, x: torch.Tensor) -> str:
        """Which kernel a call on `x` runs: native, packed or plain."""
        return self._choose(x)[0]

    def _choose(self, x: torch.Tensor) -> tuple[str, int]:
        """(kernel, rows of x). Per call, so kept to cheap checks."""
        w = self.weight
        rows = x.numel() // self.in_features if self.in_features else 0
        if not (x.is_cpu and w.is_cpu) or x.dtype != w.dtype or (torch.is_grad_enabled() and (
                x.requires_grad or w.requires_grad)):
            return "plain", rows
        if (w.dtype is torch.float32 and 1 <= rows <= NATIVE_MAX_ROWS and torch.get_num_threads() == 1
                and native_gemm() is not None and w.is_contiguous()
                and (self.bias is None or self.bias.is_contiguous())):
            return "native", rows
        # One row of a block projection is a bandwidth-bound GEMV, where oneDNN's packed call only adds fixed
        # cost (80 -> 73 ms a SmolLM2 step when these ran plain); an LM-head-sized layer is faster packed.
        if self.pack and packable(w.dtype) and (rows > 1 or w.numel() >= SINGLE_ROW_PACKED_MIN_ELEMENTS):
            return "packed", rows
        return "plain", rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel, rows = self._choose(x)
        if kernel == "native":
            return _native_call(native_gemm(), x, self.weight, self.bias, rows)
        if kernel == "packed":
            return torch.ops.mkldnn._linear_pointwise(x, self._pack(), self.bias, "none", [], "")
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_packed"], state["_packed_for"] = None, None  # rebuilt on first use
        return state

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, pack={self.pack}"


# A oneDNN call has ~20 us more fixed cost than a plain one (measured here): small layers run faster unpacked.
# Above this size packing wins (SmolLM2's 576x576 attention and 576x1536 MLP weights, every LM head); the tiny
# test models and a 256-wide draft's attention stay plain.
MIN_PACKED_ELEMENTS = 1 << 18
# Without the native kernel, at one row only layers at least this large run packed: the LM heads (SmolLM2's is
# 28M entries: 8 ms packed, 10 ms plain), not the transformer blocks' projections (the largest is 0.9M entries).
SINGLE_ROW_PACKED_MIN_ELEMENTS = 1 << 22


def prepack_linears(model: torch.nn.Module, min_elements: int = MIN_PACKED_ELEMENTS) -> int:
    """Replace the nn.Linear layers of a CPU model by FastLinear where that pays: every float32 layer with
    more than NATIVE_MIN_ELEMENTS entries when the native kernel is available, and every layer oneDNN can pack
    with more than `min_elements` (those also pack for calls beyond the native kernel's rows). Returns how
    many were replaced."""
    native = native_gemm() is not None
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear or child.weight.device.type != "cpu":
                continue
            pack = child.weight.numel() > min_elements and packable(child.weight.dtype)
            if pack or (native and child.weight.dtype == torch.float32
                        and child.weight.numel() > NATIVE_MIN_ELEMENTS):
                setattr(module, name, FastLinear(child, pack=pack))
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


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric weight-only int8 with one scale per output row: (int8 [N, K], float32 scale [N])."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


@functools.cache
def int16_activations() -> bool:
    """Whether the int8 layers (Int8Linear, the int8 decoder stack) round their activations to int16, one scale
    per row, and multiply in integers (AVX-512 VNNI, csrc/skinny_gemm.cpp specdec_int8_gemm_a16): where the
    native kernel runs on a CPU with VNNI, unless SPECDEC_INT16_ACTIVATIONS=off. Measured on an AMD EPYC, SmolLM2's 30 layers at 1 / 8 / 16 rows: 3.4 / 6.3 / 12.4 ms against 3.9 / 17.0 / 33.9 ms with float32
    activations (a batched draft step over many sessions stops being bound by float FMAs), at a relative error of
    1e-4 (int8 activations were faster still but cost 2-4 points of acceptance)."""
    if os.environ.get("SPECDEC_INT16_ACTIVATIONS", "auto").lower() in ("0", "off", "false", "no"):
        return False
    fn = native_gemm()
    return fn is not None and fn.int8_a16 is not None


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights (one float scale per output row): a quarter of the weight bytes to stream
    per token. For drafting with the target's own weights: on SmolLM2 the rounded model picks the target's greedy
    token at 97% of positions. Runs on the native kernel, with its activations rounded to int16 per
    row where int16_activations() says so (`int16_activations`), else float32; without the kernel, on the
    weight dequantised per call (correct, slow: logged once by native_gemm)."""

    def __init__(self, linear: torch.nn.Module | None = None, *, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None):
        """From a linear layer, or from a float `weight` [N, K] (and `bias`)."""
        super().__init__()
        if linear is not None:
            weight, bias = linear.weight, getattr(linear, "bias", None)
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_int8(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.int16_activations = int16_activations()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = native_gemm()
        if fn is None or not x.is_cpu:
            w = self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
            return torch.nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
        dtype = x.dtype
        x = x.float().contiguous()
        rows = x.numel() // self.in_features
        y = torch.empty(x.shape[:-1] + (self.out_features,), dtype=torch.float32)
        bias = None if self.bias is None else self.bias.data_ptr()
        gemm = fn.int8_a16 if self.int16_activations and fn.int8_a16 is not None else fn.int8
        status = rows and gemm(x.data_ptr(), self.qweight.data_ptr(), self.scale.data_ptr(), bias, y.data_ptr(),
                               rows, self.out_features, self.in_features)
        if status:
            raise RuntimeError(f"int8 GEMM refused {rows} rows ({status})")
        return y.to(dtype)

    def extra_repr(self) -> str:
        act = "int16" if self.int16_activations else "float32"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, activations {act}"


def quantize_linears(model: torch.nn.Module, min_elements: int = NATIVE_MIN_ELEMENTS) -> int:
    """Replace the linear layers (nn.Linear or FastLinear) with more than `min_elements` weights by Int8Linear;
    returns how many. Tied weights (an LM head sharing the embedding) are copied: the embedding stays float."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (torch.nn.Linear, FastLinear)) and child.weight.numel() > min_elements:
                setattr(module, name, Int8Linear(child))
                count += 1
    return count
