"""llama.cpp anchor rows: plain llama.cpp greedy decoding of the SmolLM2 GGUF (a bare llama_decode loop, one token
a step, the argmax of its logits), and specdec on its llama.cpp engine with the same thread count, target-only and
speculative (n-gram drafts), through the real processes (Redis, target, orchestrator). Every row generates the
same tokens per prompt (EOS ignored); tokens/s is new tokens over wall time, prompt prefill included on both sides;
the three runs alternate prompt by prompt.

    python -m bench.llamacpp_anchor [--threads 1,2] [--num-prompts 4] [--max-new-tokens 96] [--json]

JSON: {"rows": [{"threads", "llamacpp_tokens_per_s", "specdec_target_only_tokens_per_s",
"specdec_speculative_tokens_per_s", "speedup_vs_llamacpp": {"target_only", "speculative"}}], ...}."""

from __future__ import annotations

import argparse
import json
import os

from bench.llamacpp_rows import DirectLlamaCpp


def measure(gguf: str, prompts: list[list[int]], max_new: int, threads: int, draft_len: int,
            rounds: int) -> dict[str, float]:
    """Tokens/s of plain llama.cpp and of specdec target-only and speculative (the orchestrator's own n-gram
    drafter) on `--engine llamacpp`, the three interleaved prompt by prompt so a shared machine's slow spells
    hit them alike."""
    from specdec.client import SpecdecClient
    from launcher.stack import LocalStack, StackConfig

    cfg = StackConfig(target_model="smollm2", draft_strategy="local-ngram", threads=threads, draft_len=draft_len,
                      engine="llamacpp", draft_replicas=0, target_args=["--profile-forward", "off"])
    stack = LocalStack(cfg).start()
    direct = DirectLlamaCpp(gguf, threads)
    client = SpecdecClient(stack.address)

    def specdec(speculation: bool):
        def run(ids: list[int], n: int) -> tuple[int, float]:
            r = client.generate(ids, max_new_tokens=n, ignore_eos=True, speculation=speculation,
                                max_draft_len=draft_len)
            return len(r.token_ids), r.wall_s
        return run

    runs = {"llamacpp": direct.generate, "target_only": specdec(False), "speculative": specdec(True)}
    totals = {name: [0, 0.0] for name in runs}
    try:
        for run in runs.values():
            run(prompts[0], 8)  # warm-up
        for _ in range(rounds):
            for ids in prompts:
                for name, run in runs.items():
                    tokens, wall = run(ids, max_new)
                    totals[name][0] += tokens
                    totals[name][1] += wall
    finally:
        client.close()
        direct.close()
        stack.stop()
    return {name: tokens / wall for name, (tokens, wall) in totals.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.llamacpp_anchor", description=__doc__.splitlines()[0])
    p.add_argument("--threads", default=f"1,{os.cpu_count()}", help="thread counts to measure (default 1 and all)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="repeats of the interleaved prompts")
    p.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    args = p.parse_args(argv)
    from specdec.eval_prompts import encode, select
    from bench.machine import cpu_model
    from specdec.models import load_tokenizer, smollm2_gguf_path

    gguf = str(smollm2_gguf_path())
    tok = load_tokenizer(gguf)
    prompts = [encode(pr, tok) for pr in select(args.num_prompts)]
    rows = []
    for threads in sorted({int(t) for t in args.threads.split(",")}):
        tps = measure(gguf, prompts, args.max_new_tokens, threads, args.draft_len, args.rounds)
        direct = tps.pop("llamacpp")
        sd = tps
        rows.append({"threads": threads, "llamacpp_tokens_per_s": round(direct, 2),
                     "specdec_target_only_tokens_per_s": round(sd["target_only"], 2),
                     "specdec_speculative_tokens_per_s": round(sd["speculative"], 2),
                     "speedup_vs_llamacpp": {k: round(v / direct, 3) for k, v in sd.items()}})
        if not args.json:
            r = rows[-1]
            print(f"{threads} thread(s): llama.cpp {r['llamacpp_tokens_per_s']} tok/s; specdec target-only "
                  f"{r['specdec_target_only_tokens_per_s']} ({r['speedup_vs_llamacpp']['target_only']}x), "
                  f"speculative {r['specdec_speculative_tokens_per_s']} ({r['speedup_vs_llamacpp']['speculative']}x)")
    result = {"machine": cpu_model(), "cores": os.cpu_count(), "model": os.path.basename(gguf),
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
