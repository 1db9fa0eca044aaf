"""How llama.cpp's numerics and speed depend on the rows of a session one llama_decode computes, on the llama.cpp
engine with the SmolLM2 GGUF (docs/engines.md, "Resync").

    python -m bench.llamacpp_split [--threads N] [--reps N] [--sizes 2,48,63,64,512]

1. invariance: a summary prompt fed in calls of each size against one token a call: how many of its rows' logits
   differ, and by how much (0 rows: the split does not change the session's cache);
2. cost: prefilling a 166- and a 500-token prompt in calls of SPLIT_SAFE_ROWS rows (what the engine does) against
   one call each, interleaved, min and median of --reps runs."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from specdec.eval_prompts import PROMPTS, encode
from specdec.models import smollm2_gguf_path
from target_service.engines import llamacpp
from target_service.engines.llamacpp import LlamaCppEngine
from target_service.settings import TargetSettings


def feed(engine, tokens: list[int], size: int, all_rows: bool = True) -> list[np.ndarray]:
    """`tokens` fed to a new session in calls of exactly `size` rows (the engine's own splitting of long groups
    off); each call's logits, of every row or of its last."""
    safe, llamacpp.SPLIT_SAFE_ROWS = llamacpp.SPLIT_SAFE_ROWS, 1 << 30
    try:
        with engine._lock:
            seq = engine._sequence("split")
            return [engine._forward([(seq, tokens[a:a + size], len(tokens[a:a + size]) if all_rows else 1)])[0]
                    for a in range(0, len(tokens), size)]
    finally:
        llamacpp.SPLIT_SAFE_ROWS = safe
        engine.release("split")


def timed(engine, tokens: list[int], size: int) -> float:
    t0 = time.perf_counter()
    feed(engine, tokens, size, all_rows=False)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", default="2,16,48,63,64,512")
    args = ap.parse_args(argv)
    engine = LlamaCppEngine(smollm2_gguf_path(), TargetSettings(model="smollm2", threads=args.threads,
                                                                max_sessions=1, llama_session_context=1024))
    try:
        summaries = [encode(p, engine.loaded.tokenizer) for p in PROMPTS if p.kind == "summary"]
        one_by_one = np.concatenate(feed(engine, summaries[0], 1))
        for size in map(int, args.sizes.split(",")):
            drift = np.abs(np.concatenate(feed(engine, summaries[0], size)) - one_by_one).max(axis=1)
            print(f"{len(summaries[0])} tokens in calls of {size} rows: {int(np.count_nonzero(drift))} rows "
                  f"differ from one token a call, by up to {drift.max():.3f}")
        prompts = [summaries[0], sum(summaries, [])[:500]]
        sizes = (llamacpp.SPLIT_SAFE_ROWS, engine.batch_tokens)
        times: dict = {(len(p), s): [] for p in prompts for s in sizes}
        for _ in range(args.reps):
            for p in prompts:
                for s in sizes:
                    times[(len(p), s)].append(timed(engine, p, s) * 1e3)
        for (n, s), ts in times.items():
            print(f"prefill {n} tokens, {args.threads} threads, calls of {s} rows: "
                  f"min {min(ts):.0f} ms, median {statistics.median(ts):.0f} ms")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
