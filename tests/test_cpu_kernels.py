"""oneDNN-prepacked linears (specdec/cpu_kernels.py): the same model outputs, faster small-M forwards."""

import pytest
import torch
from transformers import DynamicCache

from specdec import cpu_kernels
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
    assert not any(isinstance(m, cpu_kernels.PackedLinear) for m in plain.model.modules())
    n = sum(isinstance(m, cpu_kernels.PackedLinear) for m in packed.model.modules())
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


def test_only_large_layers_are_packed_by_default():
    tiny = load_model(SPEC, prepack="on").model  # 64-wide: a oneDNN call would cost more than it saves
    assert not any(isinstance(m, cpu_kernels.PackedLinear) for m in tiny.modules())
    wide = load_model("tiny:vocab=4096,layers=1,hidden=128,inter=256,seed=0", prepack="on").model
    packed = [n for n, m in wide.named_modules() if isinstance(m, cpu_kernels.PackedLinear)]
    assert packed == ["lm_head"]  # 4096 x 128 > 2^18 entries; the 128-wide projections are not


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


def test_one_row_runs_plain_below_the_single_row_threshold_and_packed_above():
    """One token is a bandwidth-bound GEMV: a block projection runs it plain, an LM-head-sized layer packed;
    both give the plain layer's output at one row and at several."""
    torch.manual_seed(0)
    small = torch.nn.Linear(256, 512, bias=True)
    large = torch.nn.Linear(1024, cpu_kernels.SINGLE_ROW_PACKED_MIN_ELEMENTS // 1024, bias=False)
    for layer, packed_at_one_row in ((small, False), (large, True)):
        packed = cpu_kernels.PackedLinear(layer)
        assert packed.packed_for(1) is packed_at_one_row
        assert packed.packed_for(2) and packed.packed_for(8)
        with torch.inference_mode():
            for rows in (1, 3):
                x = torch.randn(1, rows, layer.in_features)
                torch.testing.assert_close(packed(x), layer(x), rtol=1e-4, atol=1e-4)
