"""Which model-free drafter pays on the llama.cpp engine, without timing noise: the target's greedy replies to the
bench prompts (plain llama.cpp, one thread), then at every position the n-gram drafter's and the suffix drafter's
draft and how much of it the target would accept, each block costed on a forward-cost curve in single steps (the
one measured for this project's 2-core CPU by default). Every drafted block is verified (no pricing, no skipping):
the drafters' raw value per category, tokens per target step relative to target-only decoding.

    python -m bench.drafter_replay [--prompts 16] [--max-new-tokens 48] [--json]
"""

from __future__ import annotations

import argparse
import json

# A block of n tokens costs this many single steps on the shipped GGUF, 2 threads (linear between).
LLAMACPP_STEPS = {1: 1.0, 2: 1.6, 3: 2.14, 4: 2.69, 5: 3.53, 6: 3.95, 8: 4.7, 16: 10.1, 32: 17.8, 64: 29.1}
LONGEST = {"ngram": 10, "suffix": 63}  # the longest draft each is asked for (the goodput policy's requests)


def block_cost(n: int) -> float:
    known = sorted(LLAMACPP_STEPS)
    lo, hi = max(k for k in known if k <= n), min(k for k in known if k >= n)
    return LLAMACPP_STEPS[lo] if hi == lo else (
        LLAMACPP_STEPS[lo] + (n - lo) / (hi - lo) * (LLAMACPP_STEPS[hi] - LLAMACPP_STEPS[lo]))


def greedy_reply(model, ids: list[int], n: int) -> list[int]:
    model.ll.llama_memory_clear(model.mem, True)
    out = [model._feed(ids, 0)]
    while len(out) < n:
        out.append(model._feed([out[-1]], len(ids) + len(out) - 1))
    return out


def replay(name: str, ids: list[int], reply: list[int]) -> dict:
    """Target steps, verifies and accepted tokens for `reply` (its first token comes from the prefill)."""
    from draft_service.proposers.base import ProposeTask
    from draft_service.proposers.ngram import NgramProposer
    from draft_service.proposers.suffix import SuffixProposer
    from specdec.core.sampling import SamplingParams

    proposer = NgramProposer(vocab_size=1 << 20) if name == "ngram" else SuffixProposer(vocab_size=1 << 20)
    t, held, steps, verifies, accepted = 1, 0, 0.0, 0, 0
    while t < len(reply):
        ctx, room = ids + reply[:t], min(LONGEST[name], len(reply) - t - 1)
        if name == "ngram":
            draft = proposer.lookup(ctx, room) if room else []
        else:
            draft = proposer.get_candidates(ProposeTask("s", held, ctx[held:], max(1, room), SamplingParams(), 0, 0)).tokens
            held, draft = len(ctx), draft[:room]
        k = 0
        while k < len(draft) and draft[k] == reply[t + k]:
            k += 1
        steps += block_cost(len(draft) + 1) if draft else 1.0
        verifies, accepted, t = verifies + bool(draft), accepted + k, t + k + 1
    return {"tokens": len(reply) - 1, "steps": steps, "verifies": verifies, "accepted": accepted}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.drafter_replay", description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16, help="from specdec/eval_prompts.py, round-robin by category")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from bench.llamacpp_rows import DirectLlamaCpp
    from specdec.eval_prompts import encode, select
    from specdec.models import load_tokenizer, smollm2_gguf_path

    gguf = str(smollm2_gguf_path())
    tok, model = load_tokenizer(gguf), DirectLlamaCpp(gguf, 1)
    totals: dict = {}
    try:
        for prompt in select(args.prompts):
            ids = encode(prompt, tok)
            reply = greedy_reply(model, ids, args.max_new_tokens)
            for name in LONGEST:
                row = totals.setdefault(prompt.kind, {}).setdefault(name, dict.fromkeys(
                    ("tokens", "steps", "verifies", "accepted"), 0))
                for key, value in replay(name, ids, reply).items():
                    row[key] += value
    finally:
        model.close()
    for rows in totals.values():
        for row in rows.values():
            row["tokens_per_step_vs_target_only"] = round(row["tokens"] / row["steps"], 3)
            row["steps"] = round(row["steps"], 1)
    if args.json:
        print(json.dumps(totals, indent=2))
    else:
        for kind, rows in totals.items():
            print(kind, " | ".join(f"{n}: {r['tokens_per_step_vs_target_only']}x, {r['accepted']} accepted in "
                                    f"{r['verifies']} verifies" for n, r in rows.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
