"""`specdec datastore`: build the n-gram datastore the n-gram drafter uses (draft_service/proposers/datastore.py).

The target continues a fixed, seeded set of offline prompts (chat, code, passages; the same prompts and the same
cached generations as `specdec distill`, so after a distill run this takes seconds), the table is built from its
replies, and a report gives tokens per verify step on held-out prompts with prompt lookup alone and with the
datastore, simulated with the served NgramProposer itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from draft_service.proposers.datastore import NgramDatastore, datastore_path
from draft_service.proposers.ngram import NgramProposer

logger = logging.getLogger("specdec.datastore")


def simulate_tokens_per_step(proposer: NgramProposer, held: list[tuple[list[int], int]], draft_len: int,
                             tree_budget: int = 0) -> dict:
    """Greedy speculative decoding along each held-out reply: draft (a chain of draft_len, or a tree of
    tree_budget nodes at most draft_len deep), accept the longest matching path, add the target's token. Tokens
    per verify step is what the target saves; it ignores the cost of longer verify blocks (flat up to ~6 tokens
    on this CPU, see docs/benchmark.md)."""
    steps = accepted = proposed = generated = 0
    for ids, start in held:
        n = start + 1  # tokens committed: the prompt
        generated += len(ids) - n
        while n < len(ids):
            if tree_budget:
                tokens, parents = proposer.lookup_tree(ids[:n], tree_budget, draft_len)
            else:
                tokens = proposer.lookup(ids[:n], draft_len)
                parents = list(range(-1, len(tokens) - 1))
            k, node = 0, -1
            while n + k < len(ids):
                node = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == ids[n + k]), None)
                if node is None:
                    break
                k += 1
            steps += 1
            accepted += k
            proposed += len(tokens)
            n += k + 1
    return {"draft_len": draft_len, **({"tree_budget": tree_budget} if tree_budget else {}),
            "tokens_per_step": generated / max(steps, 1), "acceptance_rate": accepted / max(proposed, 1),
            "drafted_per_step": proposed / max(steps, 1)}


def replies(data: Any) -> list[tuple[list[int], int]]:
    """(prompt + reply ids, index of the last prompt token) for every generated sequence of TeacherData."""
    return [(seq.tolist(), start) for seq, start, kind in zip(data.seqs, data.starts, data.kinds)
            if kind.startswith(("gen", "heldout"))]


def _shingles(text: str, n: int = 8) -> set[str]:
    words = text.split()
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def overlapping_benchmark(prompts: list[str]) -> list[str]:
    """Training prompts sharing an 8-word run with a benchmark prompt: their replies stay out of the table, or
    the benchmark would draft from the target's answer to (nearly) its own question."""
    from specdec.eval_prompts import PROMPTS

    bench = set().union(*(_shingles(p.text) for p in PROMPTS))
    return [p for p in prompts if _shingles(p) & bench]


@dataclass(frozen=True)
class TableSettings:
    """Which target a table is for (the drafter checks these before it uses one) and which n-grams it keeps:
    up to `max_n` tokens long, seen at least `min_count` times."""

    target: str
    tokenizer_fingerprint: str
    vocab_size: int
    max_n: int = 4
    min_count: int = 1


def build_from_teacher_data(train: Any, held: Any, table: TableSettings, exclude_prompts: list[list[int]] = (),
                            draft_lens=(4, 8), tree_budgets=(4, 6, 8)) -> tuple[NgramDatastore, dict]:
    """The table from the target's replies in `train`, and a report of tokens per step on `held`'s replies at
    each draft length and tree budget. exclude_prompts: prompt ids whose replies are left out (see
    overlapping_benchmark)."""
    vocab_size = table.vocab_size
    excluded = {tuple(p) for p in exclude_prompts}
    train_replies = replies(train)
    kept = [(ids, s) for ids, s in train_replies if tuple(ids[:s + 1]) not in excluded]
    store = NgramDatastore.build(kept, max_n=table.max_n, min_count=table.min_count, target=table.target,
                                 tokenizer_fingerprint=table.tokenizer_fingerprint, vocab_size=vocab_size)
    held_replies = replies(held)
    plain, with_store = NgramProposer(vocab_size), NgramProposer(vocab_size, datastore=store)
    report = {"replies": len(kept), "excluded_replies": len(train_replies) - len(kept),
              "heldout_replies": len(held_replies),
              "heldout_tokens": sum(len(ids) - s - 1 for ids, s in held_replies),
              "prompt_lookup": [simulate_tokens_per_step(plain, held_replies, g) for g in draft_lens],
              "prompt_lookup_and_datastore": [simulate_tokens_per_step(with_store, held_replies, g) for g in draft_lens],
              "tree_prompt_lookup_and_datastore": [simulate_tokens_per_step(with_store, held_replies, b, tree_budget=b)
                                                   for b in tree_budgets]}
    store.meta["heldout"] = report
    return store, report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec datastore", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target-model", default="smollm2", help="the target whose replies fill the table")
    p.add_argument("--out", default=None, help="output .npz (default: models cache, <target>-datastore.npz)")
    p.add_argument("--quick", action="store_true", help="16 prompts, 48 new tokens: a smoke test")
    p.add_argument("--train-prompts", type=int, default=None, help="prompts the target continues (default 192)")
    p.add_argument("--heldout-prompts", type=int, default=None, help="prompts for the report (default 24)")
    p.add_argument("--gen-max-new", type=int, default=None, help="tokens per reply (default 128)")
    p.add_argument("--max-n", type=int, default=4, help="longest n-gram in the table")
    p.add_argument("--min-count", type=int, default=1, help="an n-gram must have been seen this often")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--no-teacher-cache", action="store_true", help="do not reuse or store the target's replies")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    from offline import distill
    from specdec.models import load_model

    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, args.threads))
    t0 = time.monotonic()
    cfg = distill.DistillConfig()
    if args.quick:
        cfg = dataclasses.replace(cfg, **distill.QUICK_OVERRIDES)
    overrides: dict[str, Any] = dict(seed=args.seed, progress=not args.no_progress, total_budget_s=0.0)
    if args.gen_max_new is not None:
        overrides["gen_max_new"] = args.gen_max_new
    cfg = dataclasses.replace(cfg, **overrides)
    n_train, n_held = distill.prompt_counts(args.quick, args.train_prompts, args.heldout_prompts)
    out = pathlib.Path(args.out).expanduser() if args.out else datastore_path(args.target_model)

    loaded = load_model(args.target_model, device="cpu", dtype="float32")
    corpus, prompts, heldout = distill.prompt_sets(cfg, n_train, n_held)
    # The same settings as `specdec distill` give the same cache file: the target's replies are shared.
    cache = None if args.no_teacher_cache else distill.teacher_cache_path(loaded.model, loaded.tokenizer, cfg,
                                                                          corpus, prompts, heldout)
    train, held, timings = distill.build_teacher_data(loaded.model, loaded.tokenizer, cfg, corpus.texts, prompts,
                                                      heldout, cache)
    overlap = overlapping_benchmark(prompts)
    if overlap:
        logger.info("leaving out %d training prompt(s) that overlap the benchmark's: %s", len(overlap), overlap)
    table = TableSettings(args.target_model, loaded.fingerprint, loaded.vocab_size, args.max_n, args.min_count)
    store, report = build_from_teacher_data(train, held, table,
                                            [distill.encode_prompt(loaded.tokenizer, p) for p in overlap])
    store.meta.update(train_prompts=n_train, seed=args.seed, build_s=round(time.monotonic() - t0, 1),
                      teacher_timings_s={k: round(v, 1) for k, v in timings.items()})
    store.save(out)
    summary = {"out": str(out), "entries": store.entries, "tokens": store.meta["tokens"],
               "size_bytes": out.stat().st_size, "wall_s": round(time.monotonic() - t0, 1), **report}
    print(json.dumps(summary, indent=2))
    return 0
