"""The target hands its prompt KV to its own int8 copy (PrefillRequest.export_kv -> ProposeRequest.kv): the
fingerprint that pairs them, the wire format, the target's export, the draft's import, the services' refusals,
and the orchestrator's use of it (outputs stay the target's)."""

from __future__ import annotations

import grpc
import pytest
import torch

from draft_service.int8_draft import int8_draft
from orchestrator.replicas.clients import DraftClient, ProposeCall, TargetClient
from specdec.core import wire
from specdec.core.kv_cache import SessionCacheStore, SessionKV
from specdec.models import load_model, weights_fingerprint
from specdec.core.sampling import SamplingParams
from target_service.engines.torch import TargetEngine
from target_service.server import TargetServicer, build_server as build_target_server
from tests.harness import DRAFT_EARLY, INT8_SELF, TARGET, model, start_draft, start_stack

GQA = "tiny:vocab=96,layers=3,hidden=64,heads=4,kv_heads=2,seed=3,std=0.3"
PROMPT = [(7 * i) % 60 + 1 for i in range(30)]


def _target(spec: str) -> TargetEngine:
    return TargetEngine(load_model(spec, device="cpu", dtype="float32"), SessionCacheStore())


def _draft(spec: str):
    return int8_draft(load_model(spec, device="cpu", dtype="float32", prepack="off"), SessionCacheStore())


def test_weights_fingerprint_pairs_loads_of_the_same_weights_only():
    fp32 = load_model(TARGET, device="cpu", dtype="float32")
    assert fp32.kv_fingerprint == weights_fingerprint(fp32.model)
    # the same weights in bfloat16, or prepacked, or about to be rounded to int8: the same fingerprint
    assert load_model(TARGET, device="cpu", dtype="bfloat16").kv_fingerprint == fp32.kv_fingerprint
    assert load_model(TARGET, device="cpu", dtype="float32", prepack="off").kv_fingerprint == fp32.kv_fingerprint
    # other weights (another seed), or another shape: another fingerprint
    assert load_model(TARGET.replace("seed=0", "seed=1"), device="cpu", dtype="float32").kv_fingerprint != \
        fp32.kv_fingerprint
    assert model(DRAFT_EARLY).kv_fingerprint != fp32.kv_fingerprint


def test_kv_block_round_trips_in_float16_and_refuses_what_does_not_fit():
    keys, values = torch.randn(3, 2, 5, 16), torch.randn(3, 2, 5, 16)
    block = wire.encode_kv(keys, values, "fp")
    assert (block.length, block.layers, block.kv_heads, block.head_dim, block.fingerprint) == (5, 3, 2, 16, "fp")
    assert len(block.keys_fp16) + len(block.values_fp16) == wire.kv_nbytes(3, 2, 5, 16)
    k, v = wire.decode_kv(block, 3, 2, 16)
    torch.testing.assert_close(k, keys.half().float(), rtol=0, atol=0)
    torch.testing.assert_close(v, values.half().float(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="this model has 3 x 4 x 16"):
        wire.decode_kv(block, 3, 4, 16)
    short = wire.encode_kv(keys, values, "fp")
    short.values_fp16 = short.values_fp16[:-2]
    with pytest.raises(ValueError, match="needs"):
        wire.decode_kv(short, 3, 2, 16)
    bad = wire.encode_kv(keys.index_fill(2, torch.tensor([1]), float("nan")), values, "fp")
    with pytest.raises(ValueError, match="NaN"):
        wire.decode_kv(bad, 3, 2, 16)
    with pytest.raises(ValueError, match="equal 4-d"):
        wire.encode_kv(keys, values[:, :, :4], "fp")


def test_target_exports_its_cache_or_the_first_positions_that_fit():
    engine = _target(GQA)
    engine.prefill("s", 0, PROMPT)
    keys, values = engine.export_kv("s", 1 << 30)
    layers = engine.store.get("s").cache.layers
    assert keys.shape == (3, 2, len(PROMPT), 16) and keys.dtype == values.dtype == torch.float16  # the wire's
    for i, layer in enumerate(layers):
        torch.testing.assert_close(keys[i], layer.keys[0].half(), rtol=0, atol=0)
        torch.testing.assert_close(values[i], layer.values[0].half(), rtol=0, atol=0)
    block = wire.encode_kv(keys, values, "fp")  # the same bytes as the full-precision cache converted on the wire
    assert block.keys_fp16 == wire.encode_kv(torch.stack([layer.keys[0] for layer in layers]), values, "fp").keys_fp16
    per_position = wire.kv_nbytes(3, 2, 1, 16)
    part, _ = engine.export_kv("s", 10 * per_position + 1)
    assert part.shape[2] == 10
    torch.testing.assert_close(part, keys[:, :, :10], rtol=0, atol=0)
    assert engine.export_kv("s", per_position - 1) is None
    assert engine.export_kv("never-prefilled", 1 << 30) is None


@pytest.mark.parametrize("spec", [TARGET, GQA])
def test_int8_draft_takes_kv_in_its_own_layout(spec):
    """Its own cache, through the wire and back into a fresh session: the next token's logits are those of the
    session that prefilled (up to float16 rounding of the keys and values)."""
    lm = _draft(spec)
    own = SessionKV("own")
    expected = lm.extend(own, PROMPT + [5], keep=1)[-1]
    n = len(PROMPT)
    block = wire.encode_kv(own.cache.keys[:, :, :n], own.cache.values[:, :, :n], "fp")
    imported = SessionKV("imported")
    lm.import_kv(imported, PROMPT, *wire.decode_kv(block, *lm.kv_dims))
    assert imported.tokens == PROMPT and imported.cache.length == n
    got = lm.extend(imported, [5], keep=1)[-1]
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-3)
    with pytest.raises(ValueError, match="for 29 tokens"):
        lm.import_kv(SessionKV("x"), PROMPT[:-1], *wire.decode_kv(block, *lm.kv_dims))


@pytest.mark.parametrize("spec", [TARGET, GQA])
def test_the_targets_kv_brings_the_int8_draft_closer_to_the_target(spec):
    """The target's float32 KV for the prompt, not the draft's int8 one: the draft's next-token logits land nearer
    the target's own than after its own prefill."""
    engine, lm = _target(spec), _draft(spec)
    engine.prefill("s", 0, PROMPT)
    imported, own, ref = SessionKV("i"), SessionKV("o"), SessionKV("r")
    lm.import_kv(imported, PROMPT, *wire.decode_kv(wire.encode_kv(*engine.export_kv("s", 1 << 30), "fp"),
                                                   *lm.kv_dims))
    target_logits = engine.lm.extend(ref, PROMPT + [5], keep=1)[-1]
    from_target = (lm.extend(imported, [5], keep=1)[-1] - target_logits).abs().max()
    from_own = (lm.extend(own, PROMPT + [5], keep=1)[-1] - target_logits).abs().max()
    assert from_target < from_own


def test_services_exchange_kv_and_refuse_it_where_it_does_not_belong():
    tsrv = build_target_server(TargetEngine(model(TARGET), SessionCacheStore()), "127.0.0.1:0").start()
    int8_srv, other_srv = start_draft(INT8_SELF), start_draft(DRAFT_EARLY)
    target, draft, other = TargetClient(tsrv.address), DraftClient(int8_srv.address), DraftClient(other_srv.address)
    greedy = SamplingParams()
    try:
        info = target.info()
        assert info.kv_fingerprint and draft.info().kv_fingerprint == info.kv_fingerprint
        assert other.info().kv_fingerprint == ""  # a separate draft model: nothing to exchange
        reply = target.prefill("s", PROMPT[:-1], 0, 10.0, export_kv=True)
        assert reply.cached_len == len(PROMPT) - 1 and reply.kv.length == len(PROMPT) - 1
        assert reply.kv.fingerprint == info.kv_fingerprint
        assert not target.prefill("t", PROMPT[:-1], 0, 10.0).HasField("kv")  # only when asked

        proposal = draft.propose(ProposeCall("s", PROMPT, 0, 4, greedy, kv=reply.kv), 10.0)
        assert len(proposal.tokens) == 4 and proposal.cached_len == len(PROMPT) + 3
        again = ProposeCall("s", PROMPT + proposal.tokens[:2], len(PROMPT) + 2, 4, greedy, step=1)
        assert draft.propose(again, 10.0).cached_len == len(PROMPT) + 2 + 3  # the session goes on from the imported positions

        def refused(client, code, match, pos=0, kv=reply.kv, committed=PROMPT):
            with pytest.raises(grpc.RpcError) as e:
                client.stub.Propose(client_request(committed, pos, kv), timeout=10.0)
            assert e.value.code() == code and match in e.value.details()

        def client_request(committed, pos, kv):
            from specdec.v1 import common_pb2, draft_pb2
            return draft_pb2.ProposeRequest(session_id="x", delta=common_pb2.TokenDelta(prefix_len=pos,
                                                                                        tokens=committed[pos:]),
                                            max_draft_len=2, kv=kv)

        refused(other, grpc.StatusCode.FAILED_PRECONDITION, "cannot take that KV")
        wrong = type(reply.kv)()
        wrong.CopyFrom(reply.kv)
        wrong.fingerprint = "0" * 64
        refused(draft, grpc.StatusCode.FAILED_PRECONDITION, "cannot take that KV", kv=wrong)
        refused(draft, grpc.StatusCode.INVALID_ARGUMENT, "prefix_len 0", pos=3)
        refused(draft, grpc.StatusCode.INVALID_ARGUMENT, "of more tokens", committed=PROMPT[:-1])
        broken = type(reply.kv)()
        broken.CopyFrom(reply.kv)
        broken.keys_fp16 = broken.keys_fp16[:100]
        refused(draft, grpc.StatusCode.INVALID_ARGUMENT, "needs", kv=broken)
    finally:
        for c in (target, draft, other):
            c.close()
        for s in (tsrv, int8_srv, other_srv):
            s.stop(0)


def test_a_prompt_longer_than_the_export_limit_imports_its_first_positions(redis_url, monkeypatch):
    """The target exports the first positions that fit; the draft prefills the rest itself. Outputs stay the
    target's."""
    cfg = model(TARGET).model.config
    per_position = wire.kv_nbytes(cfg.num_hidden_layers, cfg.num_key_value_heads, 1,
                                  cfg.hidden_size // cfg.num_attention_heads)
    monkeypatch.setattr(TargetServicer, "MAX_KV_EXPORT_BYTES", 10 * per_position)
    from draft_service.int8_draft import LeanCachedLM

    imported, original = [], LeanCachedLM.import_kv

    def spy(self, sess, tokens, keys, values):
        imported.append(len(tokens))
        return original(self, sess, tokens, keys, values)

    monkeypatch.setattr(LeanCachedLM, "import_kv", spy)
    prompt = [(5 * i) % 60 + 1 for i in range(40)]
    s = start_stack(redis_url, draft=INT8_SELF)
    try:
        ref = s.client.generate(prompt, max_new_tokens=20, speculation=False, ignore_eos=True)
        spec = s.client.generate(prompt, max_new_tokens=20, max_draft_len=4, ignore_eos=True)
        assert spec.token_ids == ref.token_ids
        assert spec.stats["kv_imports"] == 1 and spec.stats["draft_failures"] == 0
        assert imported == [10]  # the first 10 positions; the draft took in the other 29 itself
        assert spec.stats["draft_tokens_accepted"] > 0
    finally:
        s.stop()
