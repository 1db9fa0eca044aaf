"""What the llama.cpp engine's prompt context (target_service/engines/llama_prompt.py) saves: CPU time per prompt
row and per target-only step of the engine with the prompt's length sent (prompt context, then main context) and
without it (main context only), and plain llama.cpp (a bare llama_decode loop on its default float16 cache, the
prompt in 512-row calls) for reference, interleaved round by round on one prompt (docs/engines.md, "Prompt
context").

    python -m bench.llamacpp_prompt [--threads 1] [--rounds 2] [--kind rag] [--steps 16]

CPU time is the process's (time.process_time): load-robust at 1 thread. At more threads llama.cpp's OpenMP workers
spin at barriers, and here two teams share the process (the engine's compute thread's and plain llama.cpp's, on
this thread), so each spins while the other computes: on the 2-core VM at 2 threads a target-only step read 1236 ms
of CPU against plain llama.cpp's 24. Compare at --threads 1."""

from __future__ import annotations

import argparse
import statistics
import time

from specdec.core.sampling import SamplingParams
from specdec.eval_prompts import PROMPTS, encode
from specdec.models import smollm2_gguf_path


def engine_round(engine, ids: list[int], prompt_len: int, steps: int, sid: str) -> dict[str, float]:
    """One prefill of all but the prompt's last token and `steps` target-only steps: CPU ms a row and a step."""
    from target_service.engines.jobs import DecodeTask

    t0 = time.process_time()
    engine.prefill(sid, 0, ids[:-1], prompt_len=prompt_len)
    row = (time.process_time() - t0) * 1e3 / (len(ids) - 1)
    t0 = time.process_time()
    engine.decode(DecodeTask(sid, len(ids) - 1, [ids[-1]], steps, SamplingParams(), prompt_len=prompt_len))
    step = (time.process_time() - t0) * 1e3 / steps
    engine.release(sid)
    return {"prefill_cpu_ms_per_row": row, "decode_cpu_ms_per_step": step}


def plain_round(plain, ids: list[int], steps: int) -> dict[str, float]:
    """The same on plain llama.cpp (bench.llamacpp_rows.DirectLlamaCpp)."""
    plain.ll.llama_memory_clear(plain.mem, True)
    t0 = time.process_time()
    token = plain.feed_rows(ids, 0, rows=1)[-1]
    row = (time.process_time() - t0) * 1e3 / len(ids)
    t0 = time.process_time()
    for i in range(steps):
        token = plain.feed_rows([token], len(ids) + i, rows=1)[-1]
    return {"prefill_cpu_ms_per_row": row, "decode_cpu_ms_per_step": (time.process_time() - t0) * 1e3 / steps}


def main(argv=None) -> dict:
    from bench.llamacpp_rows import DirectLlamaCpp
    from target_service.engines.llamacpp import LlamaCppEngine
    from target_service.settings import TargetSettings

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kind", default="rag", help="the benchmark prompt's category (specdec/eval_prompts.py)")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args(argv)
    engine = LlamaCppEngine(smollm2_gguf_path(), TargetSettings(model="smollm2", threads=args.threads, max_sessions=2))
    engine.DEFAULT_WAIT_S = 600.0
    plain = DirectLlamaCpp(str(smollm2_gguf_path()), args.threads)
    ids = encode(next(p for p in PROMPTS if p.kind == args.kind), engine.loaded.tokenizer)
    runs: dict[str, list[dict]] = {"prompt_context": [], "main_context_only": [], "plain_llamacpp": []}
    try:
        for r in range(args.rounds):
            runs["main_context_only"].append(engine_round(engine, ids, 0, args.steps, f"main{r}"))
            runs["prompt_context"].append(engine_round(engine, ids, len(ids), args.steps, f"prompt{r}"))
            runs["plain_llamacpp"].append(plain_round(plain, ids, args.steps))
    finally:
        engine.close()
        plain.close()
    result = {name: {key: round(statistics.median(r[key] for r in rounds), 2) for key in rounds[0]}
              for name, rounds in runs.items()}
    print(f"{args.kind} prompt, {len(ids)} tokens, {args.threads} threads, median of {args.rounds} rounds:")
    for name, figures in result.items():
        print(f"  {name:18s} {figures}")
    return result


if __name__ == "__main__":
    main()
