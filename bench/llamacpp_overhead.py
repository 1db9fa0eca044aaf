"""What the llama.cpp engine adds to llama.cpp per token, in one process (no gRPC, no orchestrator): target-only
greedy decoding of the SmolLM2 GGUF through `LlamaCppEngine.decode` in calls of `--chunk` tokens (as the
orchestrator's target-only Decode calls), next to a bare llama_decode loop taking the argmax of each step, the two
interleaved prompt by prompt. Per token: wall time, the time inside llama_decode, and the rest (the engine's
Python: hand-offs, logits, sampling; the bare loop's batch set-up and argmax). A shared machine's load moves the
time inside llama_decode; the rest is the figure to compare.

    python -m bench.llamacpp_overhead [--threads 2] [--tokens 64] [--rounds 6] [--chunk 4]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from target_service.engines.jobs import DecodeTask
from target_service.settings import TargetSettings


class _TimedLlama:
    """The llama_cpp module with llama_decode timed (seconds summed in .inside)."""

    def __init__(self, real):
        self.real, self.inside = real, 0.0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def llama_decode(self, ctx, batch):
        t0 = time.perf_counter()
        try:
            return self.real.llama_decode(ctx, batch)
        finally:
            self.inside += time.perf_counter() - t0


def measure(threads: int, tokens: int, rounds: int, chunk: int) -> dict:
    from bench.llamacpp_rows import DirectLlamaCpp
    from specdec.eval_prompts import encode, select
    from specdec.core.sampling import SamplingParams
    from specdec.models import load_tokenizer, smollm2_gguf_path
    from target_service.engines.llamacpp import LlamaCppEngine

    gguf = str(smollm2_gguf_path())
    prompts = [encode(p, load_tokenizer(gguf)) for p in select(4)]
    engine = LlamaCppEngine(gguf, TargetSettings(model="smollm2", threads=threads, max_sessions=2,
                                                 llama_session_context=1024))
    direct = DirectLlamaCpp(gguf, threads)
    engine._ll = _TimedLlama(engine._ll)
    direct.ll = _TimedLlama(direct.ll)

    def via_engine(ids: list[int]) -> tuple[list[int], float, float]:
        engine.prefill("bench", 0, ids[:-1])
        engine._ll.inside, out, cached, delta = 0.0, [], len(ids) - 1, ids[-1:]
        t0 = time.perf_counter()
        while len(out) < tokens:
            n = min(chunk, tokens - len(out))
            new, cached, _ = engine.decode(DecodeTask("bench", cached, delta, n, SamplingParams(), 0, 0))
            out, delta = out + new, new[-1:]
        wall = time.perf_counter() - t0
        engine.release("bench")
        return out, wall, engine._ll.inside

    def bare(ids: list[int]) -> tuple[list[int], float, float]:
        direct.ll.real.llama_memory_clear(direct.mem, True)
        out = [direct._feed(ids, 0)]
        direct.ll.inside = 0.0
        t0 = time.perf_counter()
        for i in range(tokens - 1):
            out.append(direct._feed(out[-1:], len(ids) + i))
        return out, time.perf_counter() - t0, direct.ll.inside

    rows = {"llamacpp-direct": (bare, tokens - 1), "engine": (via_engine, tokens)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
    try:
        for fn, _ in rows.values():
            fn(prompts[0])  # warm-up
        for r in range(rounds):
            for name in (list(rows) if r % 2 == 0 else list(reversed(rows))):
                fn, steps = rows[name]
                _, wall, inside = fn(prompts[r % len(prompts)])
                times[name].append((1e3 * wall / steps, 1e3 * inside / steps))
    finally:
        engine.close()
        direct.close()
    out = {}
    for name, v in times.items():
        out[name] = {"ms_per_token": round(statistics.median(w for w, _ in v), 3),
                     "inside_llama_decode_ms": round(statistics.median(d for _, d in v), 3),
                     "outside_llama_decode_ms": round(statistics.median(w - d for w, d in v), 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.llamacpp_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--chunk", type=int, default=4,
                   help="tokens per engine.decode call (the orchestrator's fallback chunk)")
    args = p.parse_args(argv)
    from bench.machine import cpu_model

    res = {"machine": cpu_model(), "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
           "chunk": args.chunk, "load_average_begin": os.getloadavg()[0]}
    res["rows"] = measure(args.threads, args.tokens, args.rounds, args.chunk)
    res["load_average_end"] = os.getloadavg()[0]
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
