"""Fast CPU linears (specdec/models/cpu_kernels.py): the native few-row GEMM and oneDNN-prepacked weights give the
same model outputs as nn.Linear."""

import os
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

from specdec.models import cpu_kernels
from specdec.models import load_model

SPEC = "tiny:vocab=64,layers=2,hidden=64,seed=0,std=0.3"


def test_this_torch_has_onednn():
    assert cpu_kernels.available()  # the pinned CPU wheel does; without it every model runs unpacked


def _blocks(model, ids, cont, block):
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=ids, cache=cache, use_cache=True)
        outs = [model(input_ids=cont[:, i:i + block], cache=cache, use_cache=True).logits.float()
                for i in range(0, cont.shape[1], block)]
    return torch.cat(outs, 1)[0]


def test_prepacked_model_matches_the_plain_model_at_every_block_size():
    plain = load_model(SPEC, prepack="off")
    packed = load_model(SPEC, prepack="on", prepack_min_elements=0)  # tiny layers: force packing to test it
    assert not any(isinstance(m, cpu_kernels.FastLinear) for m in plain.model.modules())
    n = sum(isinstance(m, cpu_kernels.FastLinear) for m in packed.model.modules())
    assert n == 2 * 7 + 1  # q k v o gate up down per layer, and the LM head
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (1, 12), generator=g)
    cont = torch.randint(0, 64, (1, 16), generator=g)
    ref = _blocks(plain.model, ids, cont, 1)
    for block in (1, 2, 4, 5, 8):
        got = _blocks(packed.model, ids, cont, block)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # the original weights stay where other code (tied embeddings, save_pretrained) expects them
    assert torch.equal(packed.model.lm_head.weight, plain.model.lm_head.weight)
    assert set(packed.model.state_dict()) == set(plain.model.state_dict())


def test_batched_padded_forward_is_supported():
    packed = load_model(SPEC, prepack="on", prepack_min_elements=0).model
    plain = load_model(SPEC, prepack="off").model
    ids = torch.tensor([[0, 5, 9, 12], [3, 4, 5, 6]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with torch.inference_mode():
        a = packed(input_ids=ids, attention_mask=mask).logits
        b = plain(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(a[0, 1:], b[0, 1:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a[1], b[1], rtol=1e-4, atol=1e-4)


def test_only_large_layers_are_replaced_by_default():
    tiny = load_model(SPEC, prepack="on").model  # 64-wide: a oneDNN or ctypes call would cost more than it saves
    assert not any(isinstance(m, cpu_kernels.FastLinear) for m in tiny.modules())
    wide = load_model("tiny:vocab=4096,layers=1,hidden=128,inter=256,seed=0", prepack="on").model
    fast = {n: m.pack for n, m in wide.named_modules() if isinstance(m, cpu_kernels.FastLinear)}
    native = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]
    # 4096 x 128 > 2^18 entries packs; the 256 x 128 MLP layers (> 2^14) run native, unpacked; 128 x 128 stays
    assert fast == {"lm_head": True, **({n: False for n in native} if cpu_kernels.native_gemm() else {})}


def test_prepack_modes():
    assert cpu_kernels.should_prepack("off", torch.device("cpu")) is False
    assert cpu_kernels.should_prepack("auto", torch.device("cpu")) is True
    assert cpu_kernels.should_prepack("auto", torch.device("meta")) is False
    with pytest.raises(ValueError, match="cannot prepack"):
        cpu_kernels.should_prepack("on", torch.device("meta"))
    with pytest.raises(ValueError, match="auto, on or off"):
        cpu_kernels.should_prepack("yes", torch.device("cpu"))
    # float32 packs everywhere; bfloat16 only where the CPU has the instructions (else the layer stays plain)
    assert cpu_kernels.packable(torch.float32) and not cpu_kernels.packable(torch.float16)


def test_a_prepacked_model_can_be_copied_and_cast():
    """deepcopy, pickling and .to(bfloat16) work (distill copies the teacher to time it in bf16): the packed
    weights are rebuilt from the weight, never copied."""
    import copy
    import pickle

    packed = load_model(SPEC, prepack="on", prepack_min_elements=0).model
    plain = load_model(SPEC, prepack="off").model
    ids = torch.tensor([[3, 9, 27, 17]])
    twin = copy.deepcopy(packed)
    pickle.loads(pickle.dumps(packed))
    with torch.inference_mode():
        torch.testing.assert_close(twin(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        b16 = copy.deepcopy(packed).to(torch.bfloat16)
        want = copy.deepcopy(plain).to(torch.bfloat16)(input_ids=ids).logits.float()
        torch.testing.assert_close(b16(input_ids=ids).logits.float(), want, rtol=0.05, atol=0.05)


def test_kernel_choice_by_rows_dtype_threads_and_grad():
    """Up to NATIVE_MAX_ROWS float32 rows run native (one torch thread); beyond, a packable layer runs packed;
    one row of a block projection runs plain without the native kernel, an LM-head-sized layer packed. Every
    path gives nn.Linear's output."""
    torch.manual_seed(0)
    small = torch.nn.Linear(256, 512, bias=True)
    large = torch.nn.Linear(1024, cpu_kernels.SINGLE_ROW_PACKED_MIN_ELEMENTS // 1024, bias=False)
    native = cpu_kernels.native_gemm() is not None
    limit = cpu_kernels.NATIVE_MAX_ROWS
    for layer, packed_at_one_row in ((small, False), (large, True)):
        fast = cpu_kernels.FastLinear(layer)
        one_row = "packed" if packed_at_one_row else "plain"
        with torch.inference_mode():
            for rows in (1, 3, limit, limit + 1):
                x = torch.randn(1, rows, layer.in_features)
                want = ("native" if native and rows <= limit else
                        "packed" if rows > 1 else one_row)
                assert fast.kernel_for(x) == want, (rows, want)
                torch.testing.assert_close(fast(x), layer(x), rtol=1e-4, atol=1e-4)
            x = torch.randn(2, layer.in_features)
            assert fast.kernel_for(x.bfloat16()) == "plain"  # dtype differs from the weight
            threads = torch.get_num_threads()
            torch.set_num_threads(2)
            try:
                assert fast.kernel_for(x) == "packed"  # the native kernel is single-threaded
            finally:
                torch.set_num_threads(threads)
        assert cpu_kernels.FastLinear(layer, pack=False).kernel_for(torch.randn(limit + 1, layer.in_features)) == "plain"
        with torch.enable_grad():
            x = torch.randn(2, layer.in_features, requires_grad=True)
            assert fast.kernel_for(x) == "plain"  # autograd goes through nn.Linear's kernel


def test_the_native_kernel_is_built_here():
    """This project's machines and CI are x86-64 with AVX2 and g++; elsewhere FastLinear falls back."""
    if cpu_kernels._native_unsupported_reason() is None:
        assert cpu_kernels.native_gemm() is not None


needs_native = pytest.mark.skipif(cpu_kernels._native_unsupported_reason() is not None,
                                  reason="the native kernel needs x86-64 with AVX2 + FMA")


@needs_native
@pytest.mark.parametrize("n,k", [(1, 1), (7, 9), (33, 17), (64, 64), (100, 200), (9, 1536)])
def test_native_linear_matches_a_float64_product(n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    for rows in range(1, cpu_kernels.NATIVE_MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=g)
        want = x.double() @ w.double().T
        torch.testing.assert_close(cpu_kernels.native_linear(x, w).double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)
        torch.testing.assert_close(cpu_kernels.native_linear(x, w, b).double(), want + b.double(), rtol=1e-5,
                                   atol=1e-5 * k ** 0.5)


@needs_native
def test_native_rows_do_not_depend_on_the_other_rows():
    """Each output is summed in the same order whatever the row count, so a verify block's projections equal
    the one-token step's exactly (what keeps greedy speculation token-identical with target-only)."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(70, 203, generator=g), torch.randn(70, generator=g)
    x = torch.randn(cpu_kernels.NATIVE_MAX_ROWS, 203, generator=g)
    full = cpu_kernels.native_linear(x, w, b)
    for start in range(x.shape[0]):
        for stop in range(start + 1, x.shape[0] + 1):
            assert torch.equal(cpu_kernels.native_linear(x[start:stop], w, b), full[start:stop]), (start, stop)
    # a strided (non-contiguous) input and leading batch dimensions work too
    xt = torch.randn(203, 4, generator=g).T
    assert torch.equal(cpu_kernels.native_linear(xt.reshape(2, 2, 203), w, b).reshape(4, 70),
                       cpu_kernels.native_linear(xt.contiguous(), w, b))


@needs_native
def test_native_linear_refuses_what_it_cannot_do():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="rows"):
        cpu_kernels.native_linear(torch.randn(cpu_kernels.NATIVE_MAX_ROWS + 1, 16), w)
    with pytest.raises(ValueError, match="features"):
        cpu_kernels.native_linear(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.native_linear(torch.randn(2, 16, dtype=torch.float64), w)


def test_build_is_cached_and_compiler_errors_are_clear(tmp_path):
    if cpu_kernels._native_unsupported_reason() is None:
        first = cpu_kernels.build_native(tmp_path)
        stamp = first.stat().st_mtime_ns
        assert cpu_kernels.build_native(tmp_path) == first and first.stat().st_mtime_ns == stamp
        assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu_kernels.build_native(tmp_path / "other", cxx="no-such-compiler-here")
    if cpu_kernels._native_unsupported_reason() is None:
        # a kernel built earlier is used where no compiler is left (the images drop g++ after building it)
        assert cpu_kernels.build_native(tmp_path, cxx="no-such-compiler-here") == first


def test_native_kernel_can_be_switched_off():
    code = "from specdec.models import cpu_kernels; print(cpu_kernels.native_gemm() is None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SPECDEC_NATIVE_GEMM": "off"})
    assert out.stdout.strip() == "True", out.stderr
