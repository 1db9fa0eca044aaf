"""Replay the goodput policy with the suffix drafter over the target's greedy replies, in milliseconds of a step's
real costs, for each way of carrying a session's target-only tokens and its drafts. Offline, without timing noise.

Greedy decoding and a deterministic drafter make what a Verify accepts a function of the context (bench/
policy_replay.py), so one pass of the target over each prompt gives every draft and how much of it the target
takes. Each step is then charged what it costs on the serving path, from the quick benchmark's measurements on a
quiet 2-core AMD EPYC (bench/results/quick/latest.json, `overheads`): a Verify over n tokens is the llama.cpp curve
times the target's step plus the Verify's round trip; a streamed token is the target's step, and each streamed
block a wake-up of the stream's threads; a Decode call adds its round trip; closing an open stream for a Verify
waits for the stream's step in flight, which is lost. After a long context each token also pays its attention
(37 ms a token after the rag prompt's 1.4k tokens against 7.6 ms after a short one). As in a running orchestrator,
the drafter's score evidence and the target's costs are learned over the prompts in turn, a context's token cost
once a block of 2 or more target-only tokens has run there. Ways of running a session:

- `hybrid` (hybridN: a ramp of N): what the orchestrator does (orchestrator/loop/step.py, WEAK_RAMP): blocks that
  do not pay (priced against the stream's token, with the switch while a stream is open) are not verified; right
  after a Verify the first N such steps decode 1, then 2 tokens in Decode calls, after that the session takes the
  next block of a decode stream (4, 4, 8, then 16 tokens: TargetCall.stream_plan), drafting again at each one;
- `stream`: every such step from the stream;
- `unary`: target-only priced with a quarter of a call's round trip a token, no switch, and the tokens of blocks
  that do not pay from Decode calls of 1, 2, then 4 tokens;
- `onstream` / `onstream-hold`: drafts verified on the session's open stream. The stream never closes: a draft made
  at a block's end goes to the target as a message while the target computes the stream's next token (the step in
  flight, kept); the draft's first token is checked against that token, and if it matches the rest is verified as
  the stream's following step (its n rows cost the curve). After a verify's outcome the stream runs on at once
  (`onstream`: the next draft again meets a step in flight), or the target waits for the orchestrator's answer
  (`onstream-hold`: the next draft or "go on"), one message round trip, before its next step.

    python -m bench.stream_policy_replay [--prompts 16] [--max-new-tokens 48] [--passes 1] [--modes hybrid,onstream] [--json]
"""

from __future__ import annotations

import argparse
import json

from bench.drafter_replay import block_cost, greedy_reply

STEP_MS = 7.63  # the target's single step after a short prompt (microbench target_step_ms)
VERIFY_RPC_MS = 1.77  # a Verify's round trip beyond the target's time (target_verify_rpc_overhead_ms)
DECODE_RPC_MS = 1.27  # a Decode call's or a stream's opening round trip (target_decode_rpc_overhead_ms)
STREAM_BLOCK_MS = 0.375  # a streamed block's wake-ups beyond the engine (target_stream_overhead_ms_per_token x 4)
# A message on an open bidirectional stream, each way, beyond the engine (a draft to the target, its outcome back):
# gRPC's bare bidi ping-pong against its unary call on this host (measured: see docs/benchmark.md), scaled from
# the Verify's round trip.
STREAM_MESSAGE_MS = 0.375
HOLD_MS = 1.5  # onstream-hold: the target idle from a verify's outcome to the orchestrator's answer (2 messages)
LONG_CONTEXT_STEP_MS = 37.0  # a target-only token after the rag prompt's ~1.4k tokens
LONG_CONTEXT = 1416
BLOCK = 4  # the first tokens per weak-draft stream block (--fallback-chunk)
MAX_BLOCK = 16  # weak-draft stream blocks double up to this (--stream-block-tokens)
RAMP = 2  # hybrid: after a verify, Decode calls of 1, 2 tokens before the stream opens (step.WEAK_RAMP)


def attention_ms(context: int) -> float:
    """A token's extra cost at this context (linear in the context beyond the profile's, from the two figures)."""
    return max(0.0, (LONG_CONTEXT_STEP_MS - STEP_MS) * (context - 256) / (LONG_CONTEXT - 256))


def verify_ms(n: int, context: int) -> float:
    return STEP_MS * block_cost(n) + n * attention_ms(context)


def token_ms(context: int) -> float:
    return STEP_MS + attention_ms(context)


class StreamBlocks:
    """A weak-draft stream's block sizes (target_service/server.py DecodeStream): BLOCK, BLOCK, then doubling up to
    MAX_BLOCK."""

    def __init__(self):
        self.want, self.next_want = BLOCK, BLOCK

    def take(self, room: int) -> int:
        n = max(1, min(self.want, room))
        self.want, self.next_want = self.next_want, min(MAX_BLOCK, 2 * self.next_want)
        return n


def target_cost(mode: str):
    """An orchestrator's TargetCost, shared by its sessions: the curve, what it has measured of a verify's time
    beyond the target's and of a token's after a short context; longer contexts as its sessions reach them."""
    from orchestrator.policy.draft_length import TargetCost

    cost = TargetCost([STEP_MS * block_cost(n) for n in range(1, 65)])
    call_ms = STREAM_MESSAGE_MS if mode.startswith("onstream") else VERIFY_RPC_MS
    for _ in range(20):
        cost.observe_step(STEP_MS + call_ms, STEP_MS)
    cost.observe(1, STEP_MS, decode=True, context=0)
    return cost


def policy(mode: str, evidence, cost=None):
    from orchestrator.policy.draft_length import GoodputDraftLength

    d = GoodputDraftLength(63, cost or target_cost(mode), evidence=evidence, decode_chunk=BLOCK)
    d.use_free_drafter(True)
    d.streamed = mode != "unary"
    return d


class Replay:
    """One reply replayed in one mode: ms spent after its first token (which the prefill made) and the steps."""

    def __init__(self, mode: str, ids: list[int], reply: list[int], evidence, cost=None):
        from draft_service.proposers.suffix import SuffixProposer

        self.mode, self.ids, self.reply = mode, ids, reply
        self.d, self.proposer = policy(mode, evidence, cost), SuffixProposer(vocab_size=1 << 20)
        self.t, self.held, self.ms = 1, 0, 0.0
        self.out = {"verifies": 0, "accepted": 0, "streamed": 0, "decode_calls": 0, "decoded": 0}

    def draft(self) -> tuple[list[int], list[float]]:
        """The suffix drafter's block at the current position (it is shown every committed token)."""
        from draft_service.proposers.base import ProposeTask
        from specdec.core.sampling import SamplingParams

        ctx, room = self.ids + self.reply[:self.t], len(self.reply) - self.t - 1
        task = ProposeTask("s", self.held, ctx[self.held:], max(1, min(63, room)), SamplingParams())
        prop = self.proposer.get_candidates(task)
        self.held = len(ctx)
        return prop.tokens[:room], (prop.scores or [])[:room]

    def matched(self, draft: list[int], n: int, at: int) -> int:
        k = 0
        while k < n and draft[k] == self.reply[at + k]:
            k += 1
        return k

    def verify(self, draft: list[int], scores: list[float], n: int, extra_ms: float) -> None:
        """Verify draft[:n] at the current position: the block's forward, its accepted tokens and the bonus token."""
        context = len(self.ids) + self.t
        k = self.matched(draft, n, self.t)
        self.ms += verify_ms(n + 1, context) + extra_ms
        self.d.cost.observe(n + 1, verify_ms(n + 1, context), context=context)
        self.d.update(n, k)
        self.d.observe_evidence(scores[:n], n, k)
        self.out["verifies"] += 1
        self.out["accepted"] += k
        self.t += k + 1

    def target_tokens(self, m: int) -> None:
        """m target-only tokens, which measure a token's time at this context (TargetCall: blocks of 2 or more)."""
        context = len(self.ids) + self.t
        if m > 1:
            self.d.cost.observe(1, token_ms(context), decode=True, context=context)
        self.ms += m * token_ms(context)
        self.t += m

    def stream_tokens(self, m: int) -> None:
        self.ms += STREAM_BLOCK_MS
        self.out["streamed"] += m
        self.target_tokens(m)

    def result(self) -> dict:
        return {"ms": self.ms, **self.out}


def run_closing(mode: str, ids: list[int], reply: list[int], evidence, cost=None) -> dict:
    """hybrid, stream, unary: a draft that pays is verified by a Verify call, closing the stream if one is open."""
    r = Replay(mode, ids, reply, evidence, cost)
    d, streaming, dry, blocks = r.d, None, 0, None
    ramp = int(mode[len("hybrid"):] or RAMP) if mode.startswith("hybrid") else 0
    while r.t < len(reply):
        draft, scores = r.draft()
        room = len(reply) - r.t - 1
        d.stream_open, d.context = blocks is not None and mode != "unary", len(ids) + r.t
        n = d.verify_len(scores, room) if draft else 0
        if n:
            wait = token_ms(len(ids) + r.t) if blocks is not None else 0.0  # the stream's step in flight, lost
            if blocks is not None:
                d.cost.observe_switch(n + 1, verify_ms(n + 1, len(ids) + r.t) + wait, len(ids) + r.t)
            r.verify(draft, scores, n, VERIFY_RPC_MS + wait)
            blocks, dry = None, 0
            continue
        if mode == "stream" or (ramp and (blocks is not None or dry >= ramp or not r.out["verifies"])):
            if blocks is None:
                r.ms += DECODE_RPC_MS
                blocks = StreamBlocks()
            r.stream_tokens(blocks.take(len(reply) - r.t))
        else:
            m = min(BLOCK, 1 << dry, len(reply) - r.t)
            r.ms += DECODE_RPC_MS
            r.target_tokens(m)
            dry += 1
            r.out["decode_calls"] += 1
            r.out["decoded"] += m
    return r.result()


def run_onstream(mode: str, ids: list[int], reply: list[int], evidence, cost=None) -> dict:
    """onstream, onstream-hold: drafts verified on the open stream, never closing it."""
    r = Replay(mode, ids, reply, evidence, cost)
    d, hold = r.d, mode == "onstream-hold"
    r.ms += DECODE_RPC_MS  # the stream's opening call
    blocks, held = StreamBlocks(), False  # held: the target waits for this draft (no step in flight)
    while r.t < len(reply):
        draft, scores = r.draft()
        room = len(reply) - r.t - 1
        d.stream_open, d.context = False, len(ids) + r.t
        if held:  # the target waits for this answer: a draft is verified at once, else the stream goes on
            r.ms += HOLD_MS
            n = d.verify_len(scores, room) if draft else 0
            if n:
                r.verify(draft, scores, n, 0.0)
                continue
            held = False
            r.stream_tokens(blocks.take(len(reply) - r.t))
            continue
        # The stream's step in flight makes the next token; the draft's first token is checked against it.
        n = d.verify_len(scores[1:], room - 1) if len(draft) >= 2 and room >= 2 else 0
        if not n:
            r.stream_tokens(blocks.take(len(reply) - r.t))
            continue
        r.ms += STREAM_MESSAGE_MS  # the draft's message, beside the step in flight
        first_ok = draft[0] == reply[r.t]
        r.stream_tokens(1)
        if first_ok and r.t < len(reply):
            r.verify(draft[1:], scores[1:], n, 0.0)  # its outcome: a message as a block's (stream_tokens)
        else:
            d.observe_evidence(scores[:1], 1, 0)
        blocks, held = StreamBlocks(), hold
    return r.result()


def run(mode: str, ids: list[int], reply: list[int], evidence, cost=None) -> dict:
    """ms to generate reply[1:] after its first token (from the prefill), and the steps taken; evidence and cost:
    the orchestrator's (DraftEvidence, target_cost(mode)), learned over its sessions (cost None: a fresh one)."""
    if mode.startswith("onstream"):
        return run_onstream(mode, ids, reply, evidence, cost)
    return run_closing(mode, ids, reply, evidence, cost)


def target_only_ms(ids: list[int], reply: list[int], block: int = MAX_BLOCK) -> float:
    """A target-only stream: its first token at once (from the prefill), then blocks of `block` tokens."""
    tokens = len(reply) - 1
    return DECODE_RPC_MS + sum(token_ms(len(ids) + t) for t in range(1, len(reply))) + STREAM_BLOCK_MS * (
        -(-tokens // block))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stream_policy_replay", description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16, help="from specdec/eval_prompts.py, round-robin by category")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--passes", type=int, default=1, help="over the prompts, the evidence learned carried over; the "
                   "last pass is reported (1: an orchestrator's first generations, exploring its drafter's scores)")
    p.add_argument("--modes", default="hybrid,onstream,onstream-hold",
                   help="hybrid[N] (N: ramp), stream, unary, onstream, onstream-hold")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    totals = replay_all(greedy_work(args.prompts, args.max_new_tokens), args.modes.split(","), args.passes)
    if args.json:
        print(json.dumps(totals, indent=2))
    else:
        for kind, rows in totals.items():
            print(f"{kind:11s}", " | ".join(f"{mode}: {r['speedup_vs_target_only']}x ({r['verifies']} verifies, "
                                            f"{r['accepted']} accepted)" for mode, r in rows.items()))
    return 0


def greedy_work(prompts: int, max_new_tokens: int) -> list[tuple[str, list[int], list[int]]]:
    """(category, prompt ids, the target's greedy reply) for the first `prompts` bench prompts."""
    from bench.llamacpp_rows import DirectLlamaCpp
    from specdec.eval_prompts import encode, select
    from specdec.models import load_tokenizer, smollm2_gguf_path

    gguf = str(smollm2_gguf_path())
    tok, model = load_tokenizer(gguf), DirectLlamaCpp(gguf, 1)
    try:
        return [(prompt.kind, ids, greedy_reply(model, ids, max_new_tokens))
                for prompt in select(prompts) for ids in [encode(prompt, tok)]]
    finally:
        model.close()


def replay_all(work, modes: list[str], passes: int) -> dict:
    """Per category and mode: summed ms, target-only ms, steps, and speedup_vs_target_only (plus an `all` row)."""
    from orchestrator.policy.draft_length import DraftEvidence

    totals: dict = {}
    for mode in modes:
        # orchestrator-wide: learned over the prompts in turn, as a server would
        evidence, cost = DraftEvidence(), target_cost(mode)
        for _ in range(passes - 1):
            for kind, ids, reply in work:
                run(mode, ids, reply, evidence, cost)
        for kind, ids, reply in work:
            result = {**run(mode, ids, reply, evidence, cost), "target_only_ms": target_only_ms(ids, reply)}
            for row in (totals.setdefault(kind, {}).setdefault(mode, {}), totals.setdefault("all", {}).setdefault(
                    mode, {})):
                for key, value in result.items():
                    row[key] = row.get(key, 0) + value
    for rows in totals.values():
        for row in rows.values():
            row["speedup_vs_target_only"] = round(row["target_only_ms"] / row["ms"], 3)
            row["ms"], row["target_only_ms"] = round(row["ms"], 1), round(row["target_only_ms"], 1)
    totals["all"] = totals.pop("all")  # last
    return totals


if __name__ == "__main__":
    raise SystemExit(main())
