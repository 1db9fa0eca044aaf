"""Replay the goodput policy with the suffix drafter over the target's greedy replies, in milliseconds of a step's
real costs, with and without the decode stream behind the blocks that do not pay. Offline, without timing noise.

Greedy decoding and a deterministic drafter make what a Verify accepts a function of the context (bench/
policy_replay.py), so one pass of the target over each prompt gives every draft and how much of it the target
takes. Each step is then charged what it costs on the serving path, from the quick benchmark's measurements on a
quiet 2-core AMD EPYC (bench/results/quick/latest.json, `overheads`): a Verify over n tokens is the llama.cpp curve
times the target's step plus the Verify's round trip; a streamed target-only token is the target's step plus the
stream's share; a Decode call adds its round trip; closing an open stream for a Verify waits for the stream's step
in flight. After a long context each token also pays its attention (37 ms a token after the rag prompt's 1.4k
tokens against 7.8 ms after a short one, the quick run's target-only figures). Ways of running a session:

- `hybrid` (hybridN: a ramp of N): what the orchestrator does (orchestrator/loop/step.py, WEAK_RAMP): blocks that
  do not pay (priced against the stream's token, with the switch while a stream is open) are not verified; right
  after a Verify the first two such steps decode 1, then 2 tokens in Decode calls, after that the session takes
  the stream's next block, drafting again at each one;
- `stream`: every such step from the stream;
- `unary`: the earlier loop: target-only priced with a quarter of a call's round trip a token, no switch, and the
  tokens of blocks that do not pay from Decode calls of 1, 2, then 4 tokens.

    python -m bench.stream_policy_replay [--prompts 16] [--max-new-tokens 48] [--json]
"""

from __future__ import annotations

import argparse
import json

from bench.drafter_replay import block_cost, greedy_reply

STEP_MS = 7.8  # the target's single step after a short prompt (microbench target_step_ms)
VERIFY_RPC_MS = 2.2  # a Verify's round trip beyond the target's time (target_verify_rpc_overhead_ms)
DECODE_RPC_MS = 1.85  # a Decode call's or a stream's opening round trip (target_decode_rpc_overhead_ms)
STREAM_TOKEN_MS = 0.04  # a streamed token's share beyond the engine (target_stream_overhead_ms_per_token)
LONG_CONTEXT_STEP_MS = 37.0  # a target-only token after the rag prompt's ~1.4k tokens
LONG_CONTEXT = 1416
BLOCK = 4  # tokens per stream block (--fallback-chunk)
RAMP = 2  # hybrid: after a verify, Decode calls of 1, 2 tokens before the stream opens (step.WEAK_RAMP)


def attention_ms(context: int) -> float:
    """A token's extra cost at this context (linear in the context beyond the profile's, from the two figures)."""
    return max(0.0, (LONG_CONTEXT_STEP_MS - STEP_MS) * (context - 256) / (LONG_CONTEXT - 256))


def verify_ms(n: int, context: int) -> float:
    return STEP_MS * block_cost(n) + n * attention_ms(context)


def policy(mode: str, evidence):
    from orchestrator.policy.draft_length import GoodputDraftLength, TargetCost

    cost = TargetCost([STEP_MS * block_cost(n) for n in range(1, 65)])
    for _ in range(20):  # what a running orchestrator has measured: the Verify's round trip
        cost.observe_step(STEP_MS + VERIFY_RPC_MS, STEP_MS)
    d = GoodputDraftLength(63, cost, evidence=evidence, decode_chunk=BLOCK)
    d.use_free_drafter(True)
    d.streamed = mode != "unary"
    return d


def run(mode: str, ids: list[int], reply: list[int], evidence) -> dict:
    """ms to generate reply[1:] after its first token (from the prefill), and the steps taken."""
    from draft_service.proposers.suffix import SuffixProposer
    from specdec.core.sampling import SamplingParams

    d, proposer = policy(mode, evidence), SuffixProposer(vocab_size=1 << 20)
    t, held, ms, streaming, dry = 1, 0, 0.0, False, 0
    out = {"verifies": 0, "accepted": 0, "streamed": 0, "decode_calls": 0}
    while t < len(reply):
        ctx, room = ids + reply[:t], len(reply) - t - 1
        for context in (len(ctx),):  # what the target's Decode steps have measured at this context
            d.cost.observe(1, STEP_MS + attention_ms(context), decode=True, context=context)
        prop = proposer.get_candidates("s", held, ctx[held:], max(1, min(63, room)), SamplingParams(), 0, 0)
        held, draft, scores = len(ctx), prop.tokens[:room], (prop.scores or [])[:room]
        d.stream_open, d.context = streaming and mode != "unary", len(ctx)
        n = d.verify_len(scores, room) if draft else 0
        if n:
            k = 0
            while k < n and draft[k] == reply[t + k]:
                k += 1
            wait = STEP_MS + attention_ms(len(ctx)) if streaming else 0.0  # the stream's step in flight
            ms += verify_ms(n + 1, len(ctx)) + VERIFY_RPC_MS + wait
            if streaming:
                d.cost.observe_switch(n + 1, verify_ms(n + 1, len(ctx)) + wait, len(ctx))
            d.cost.observe(n + 1, verify_ms(n + 1, len(ctx)), context=len(ctx))
            d.update(n, k)
            d.observe_evidence(scores[:n], n, k)
            out["verifies"] += 1
            out["accepted"] += k
            t, streaming, dry = t + k + 1, False, 0
            continue
        per_token = STEP_MS + attention_ms(len(ctx))
        ramp = int(mode[len("hybrid"):] or RAMP) if mode.startswith("hybrid") else 0
        if mode == "stream" or (ramp and (streaming or dry >= ramp or not out["verifies"])):
            m = min(BLOCK, len(reply) - t)
            ms += m * (per_token + STREAM_TOKEN_MS) + (0.0 if streaming else DECODE_RPC_MS)
            streaming = True
            out["streamed"] += m
        else:
            m = min(BLOCK, 1 << dry, len(reply) - t)
            ms += m * per_token + DECODE_RPC_MS
            dry += 1
            out["decode_calls"] += 1
        t += m
    return {"ms": ms, **out}


def target_only_ms(ids: list[int], reply: list[int]) -> float:
    return DECODE_RPC_MS + sum(STEP_MS + attention_ms(len(ids) + t) + STREAM_TOKEN_MS for t in range(1, len(reply)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stream_policy_replay", description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16, help="from specdec/eval_prompts.py, round-robin by category")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--passes", type=int, default=1, help="over the prompts, the evidence learned carried over; the "
                   "last pass is reported (1: an orchestrator's first generations, exploring its drafter's scores)")
    p.add_argument("--modes", default="stream,hybrid,unary", help="hybridN: a ramp of N Decode calls after a Verify")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from bench.llamacpp_rows import DirectLlamaCpp
    from orchestrator.policy.draft_length import DraftEvidence
    from specdec.eval_prompts import encode, select
    from specdec.models import load_tokenizer, smollm2_gguf_path

    gguf = str(smollm2_gguf_path())
    tok, model = load_tokenizer(gguf), DirectLlamaCpp(gguf, 1)
    try:
        work = [(prompt.kind, ids, greedy_reply(model, ids, args.max_new_tokens))
                for prompt in select(args.prompts) for ids in [encode(prompt, tok)]]
    finally:
        model.close()
    totals: dict = {}
    for mode in args.modes.split(","):
        evidence = DraftEvidence()  # orchestrator-wide: learned over the prompts in turn, as a server would
        for _ in range(args.passes - 1):
            for kind, ids, reply in work:
                run(mode, ids, reply, evidence)
        for kind, ids, reply in work:
            row = totals.setdefault(kind, {}).setdefault(mode, {"ms": 0.0, "target_only_ms": 0.0})
            for key, value in run(mode, ids, reply, evidence).items():
                row[key] = row.get(key, 0) + value
            row["target_only_ms"] += target_only_ms(ids, reply)
    for rows in totals.values():
        for row in rows.values():
            row["speedup_vs_target_only"] = round(row["target_only_ms"] / row["ms"], 3)
            row["ms"], row["target_only_ms"] = round(row["ms"], 1), round(row["target_only_ms"], 1)
    if args.json:
        print(json.dumps(totals, indent=2))
    else:
        for kind, rows in totals.items():
            print(f"{kind:11s}", " | ".join(f"{mode}: {r['speedup_vs_target_only']}x ({r['verifies']} verifies, "
                                            f"{r['accepted']} accepted)" for mode, r in rows.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
