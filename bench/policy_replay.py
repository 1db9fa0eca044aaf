"""Replay the draft-length policies over the target's own greedy replies, offline and without timing noise.

With greedy decoding and a deterministic drafter (the n-gram drafter), what a Verify accepts is a pure function
of the context: the draft's longest prefix that matches the target's greedy continuation. So one pass of the
target over each bench prompt gives, for every position of its reply, the draft and how much of it would be
accepted, and every policy (fixed k, transformers' heuristic, the goodput policy) can then be replayed on the
same table. A step costs the target's measured forward over k + 1 tokens (its start-up profile); the result
is tokens per target step relative to target-only, the same for every run of the same models.

    python -m bench.policy_replay [--prompts 12] [--max-new-tokens 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

MAX_DRAFT = 10  # the longest draft looked up at each position


@dataclass(frozen=True)
class Position:
    drafted: int  # tokens the drafter offers here (up to MAX_DRAFT)
    matched: int  # how many of them equal the target's greedy continuation
    scores: tuple[float, ...] = ()  # the drafter's score per drafted token (ProposeResponse.token_scores)


def positions(context: list[int], reply: list[int],
              lookup: Callable[[list[int], int], tuple[list[int], list[float]]]) -> list[Position]:
    """For each position t of `reply`: the draft for context + reply[:t] (lookup returns it and its scores) and
    its prefix that matches reply[t:]."""
    table = []
    for t in range(len(reply)):
        draft, scores = lookup(context + reply[:t], MAX_DRAFT)
        m = 0
        while m < len(draft) and t + m < len(reply) and draft[m] == reply[t + m]:
            m += 1
        table.append(Position(len(draft), m, tuple(scores)))
    return table


def replay(tables: list[list[Position]], make_policy: Callable[[], object] | int, forward_ms: list[float],
           fallback_chunk: int = 4) -> tuple[int, float, int, int]:
    """Decode every reply as the orchestrator's step does (orchestrator/loop/step.py): k capped by the tokens
    left; a paused policy (k = 0) decodes `fallback_chunk` tokens target-only; an empty draft 1, 2, then
    `fallback_chunk` tokens while the drafter stays dry (reset by a verify), or `fallback_chunk` at once when it
    was a paused policy's probe (which pauses again); a scored draft is asked for at the policy's request_len and
    trimmed by its verify_len.
    Returns (tokens, cost in ms, verify steps, tokens decoded target-only). A policy is a fixed k (an int) or a
    factory of DraftLength-like objects (k, update(proposed, accepted), step_taken())."""
    from orchestrator.policy.draft_length import dry_decode_tokens, dry_step_tokens

    tokens, cost, verifies, plain = 0, 0.0, 0, 0
    for table in tables:
        policy = make_policy() if callable(make_policy) else None
        t = dry = 0
        while t < len(table):
            remaining = len(table) - t
            here = table[t]
            k = min(policy.k if policy is not None else make_policy, remaining - 1, len(forward_ms) - 1)
            proposed = min(k, here.drafted)
            if policy is not None and k > 0 and here.scores:
                ask = min(policy.request_len(k), remaining - 1, len(forward_ms) - 1)
                proposed = policy.verify_len(list(here.scores[:ask]), remaining - 1)
            if proposed:
                accepted = min(here.matched, proposed)
                cost += forward_ms[proposed]  # one forward over the block and the bonus token
                verifies += 1
                if policy is not None:
                    policy.update(proposed, accepted)
                    policy.observe_evidence(list(here.scores[:proposed]), proposed, accepted)
                step = accepted + 1
                dry = 0
            else:
                if k > 0:  # an empty draft
                    chunk = min(fallback_chunk, remaining)
                    step = dry_step_tokens(policy, dry, chunk) if policy is not None else dry_decode_tokens(dry, chunk)
                    dry += 1
                else:
                    step = min(fallback_chunk, remaining)
                    if policy is not None and policy.k == 0:
                        policy.step_taken()
                cost += step * forward_ms[0]
                plain += step
            t += step
            tokens += step
    return tokens, cost, verifies, plain


def compare(tables: list[list[Position]], forward_ms: list[float], max_len: int = 16) -> list[dict]:
    """Every policy over the same tables; speed is tokens per ms relative to target-only."""
    from orchestrator.policy.draft_length import AcceptancePrior, DraftEvidence, DraftLength, GoodputDraftLength, TargetCost

    cost = TargetCost(forward_ms)
    policies: list[tuple[str, object]] = [("target-only", 0)]
    policies += [(f"fixed k={k}", k) for k in range(1, min(8, len(forward_ms) - 1) + 1)]
    policies.append(("heuristic (transformers: +2 / -1)", lambda: DraftLength(4, max_len, adaptive=True)))
    prior, prior2, evidence = AcceptancePrior(), AcceptancePrior(), DraftEvidence()  # orchestrator-wide, as served
    policies.append(("goodput, draft scores ignored", lambda: GoodputDraftLength(max_len, cost, prior)))
    policies.append(("goodput + draft scores (default adaptive)",
                     lambda: GoodputDraftLength(max_len, cost, prior2, evidence)))
    rows, base = [], None
    for name, policy in policies:
        tokens, ms, verifies, plain = replay(tables, policy, forward_ms)
        speed = tokens / ms
        base = base or speed
        rows.append({"policy": name, "tokens": tokens, "target_steps": round(ms / forward_ms[0], 1),
                     "verify_steps": verifies, "target_only_tokens": plain,
                     "tokens_per_verify": round((tokens - plain) / verifies, 3) if verifies else None,
                     "speedup_vs_target_only": round(speed / base, 3)})
    return rows


def acceptance_by_depth(tables: list[list[Position]], depth: int = 5) -> list[float | None]:
    """P(draft token i + 1 is accepted | the first i were), i = 0 .. depth - 1: how bursty acceptance is."""
    out = []
    for i in range(depth):
        trials = [p.matched > i for table in tables for p in table if p.matched >= i and p.drafted > i]
        out.append(round(sum(trials) / len(trials), 3) if trials else None)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.policy_replay", description=__doc__.splitlines()[0])
    p.add_argument("--target-model", default="smollm2")
    p.add_argument("--datastore", default="auto", help="the n-gram drafter's datastore: auto, none or a path")
    p.add_argument("--prompts", type=int, default=12, help="how many bench prompts (round-robin over kinds)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch
    from tqdm import tqdm

    from specdec import eval_prompts as bench_prompts
    from draft_service.build import build_ngram_proposer
    from specdec.core.kv_cache import SessionCacheStore, SessionKV
    from specdec.models import load_model
    from target_service.engines.torch import TargetEngine

    torch.set_num_threads(args.threads)
    loaded = load_model(args.target_model)
    tokenizer = loaded.tokenizer
    tiny_vocab = loaded.vocab_size if args.target_model.strip().lower().startswith("tiny") else None
    engine = TargetEngine(loaded, SessionCacheStore())
    forward_ms = engine.profile_forward_ms(17, reps=3)
    drafter, info = build_ngram_proposer(tokenizer, args.target_model, args.datastore, loaded.vocab_size)
    eos = getattr(tokenizer, "eos_token_id", None)
    tables = []
    for prompt in tqdm(bench_prompts.select(args.prompts), desc="target greedy replies", file=sys.stderr):
        ids = bench_prompts.encode(prompt, tokenizer, tiny_vocab=tiny_vocab)
        sess = SessionKV(prompt.name)
        logits = engine.lm.extend(sess, ids, keep=1)
        reply = []
        while len(reply) < args.max_new_tokens:
            reply.append(int(logits[-1].argmax()))
            if reply[-1] == eos:
                break
            logits = engine.lm.extend(sess, reply[-1:], keep=1)
        tables.append(positions(ids, reply, drafter.lookup_scored))
    result = {"target_model": args.target_model, "drafter": info.model_name, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "forward_ms": [round(x, 2) for x in forward_ms],
              "acceptance_by_depth": acceptance_by_depth(tables), "policies": compare(tables, forward_ms)}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['drafter']} drafting for {args.target_model}; {args.prompts} prompts x {args.max_new_tokens} "
          f"tokens; forward over 1..6 tokens: {', '.join(f'{x:.1f}' for x in forward_ms[:6])} ms")
    print("P(draft token i accepted | tokens before it accepted), i = 1..5:", result["acceptance_by_depth"])
    print("| policy | tokens/verify | verify steps | tokens decoded target-only | target steps | speedup vs target-only |")
    print("|---|---|---|---|---|---|")
    for r in result["policies"]:
        print(f"| {r['policy']} | {r['tokens_per_verify'] or 'n/a'} | {r['verify_steps']} | {r['target_only_tokens']} "
              f"| {r['target_steps']} | {r['speedup_vs_target_only']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
