"""llama.cpp anchor rows: plain llama.cpp greedy decoding of the SmolLM2 GGUF (a bare llama_decode loop, one token
a step, the argmax of its logits), and specdec on its llama.cpp engine with the same thread count, target-only and
speculative (n-gram drafts), through the real processes (Redis, target, orchestrator). Every row generates the
same tokens per prompt (EOS ignored); tokens/s is new tokens over wall time, prompt prefill included on both sides.

    python -m bench.llamacpp_anchor [--threads 1,2] [--num-prompts 4] [--max-new-tokens 96] [--json]

JSON: {"rows": [{"threads", "llamacpp_tokens_per_s", "specdec_target_only_tokens_per_s",
"specdec_speculative_tokens_per_s", "speedup_vs_llamacpp": {"target_only", "speculative"}}], ...}."""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def llamacpp_direct_tps(gguf: str, prompts: list[list[int]], max_new: int, threads: int) -> float:
    """Plain llama.cpp: one context, each prompt prefilled in one batch, then max_new single-token decodes."""
    import llama_cpp
    from llama_cpp import _logger

    _logger.set_verbose(False)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(gguf.encode(), llama_cpp.llama_model_default_params())
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 4096, 512, 512
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    mem = llama_cpp.llama_get_memory(ctx)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(512, 0, 1)

    def feed(tokens: list[int], start: int) -> int:
        for j, t in enumerate(tokens):
            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.seq_id[j][0] = t, start + j, 1, 0
            batch.logits[j] = j == len(tokens) - 1
        batch.n_tokens = len(tokens)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        return int(row.argmax())

    def generate(ids: list[int], n: int) -> None:
        llama_cpp.llama_memory_clear(mem, True)
        token = feed(ids, 0)
        for i in range(n - 1):
            token = feed([token], len(ids) + i)

    try:
        generate(prompts[0], 8)  # warm-up
        t0 = time.perf_counter()
        for ids in prompts:
            generate(ids, max_new)
        return len(prompts) * max_new / (time.perf_counter() - t0)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def specdec_tps(prompts: list[list[int]], max_new: int, threads: int, draft_len: int) -> dict[str, float]:
    """specdec target-only and speculative (the orchestrator's own n-gram drafter) on `--engine llamacpp`."""
    from specdec.client import SpecdecClient
    from specdec.stack import LocalStack, StackConfig

    cfg = StackConfig(target_model="smollm2", draft_strategy="local-ngram", threads=threads, draft_len=draft_len,
                      target_args=["--engine", "llamacpp", "--profile-forward", "off"])
    stack = LocalStack(cfg).start()
    out = {}
    try:
        client = SpecdecClient(stack.address)
        client.generate(prompts[0], max_new_tokens=8, ignore_eos=True, speculation=False)  # warm-up
        for name, speculation in (("target_only", False), ("speculative", True)):
            tokens, wall = 0, 0.0
            for ids in prompts:
                r = client.generate(ids, max_new_tokens=max_new, ignore_eos=True, speculation=speculation,
                                    max_draft_len=draft_len)
                tokens += len(r.token_ids)
                wall += r.wall_s
            out[name] = tokens / wall
        client.close()
    finally:
        stack.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.llamacpp_anchor", description=__doc__.splitlines()[0])
    p.add_argument("--threads", default=f"1,{os.cpu_count()}", help="thread counts to measure (default 1 and all)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    args = p.parse_args(argv)
    from bench.prompts import encode, select
    from bench.runner import _cpu_model
    from specdec.models import load_tokenizer, smollm2_gguf_path

    gguf = str(smollm2_gguf_path())
    tok = load_tokenizer(gguf)
    prompts = [encode(pr, tok) for pr in select(args.num_prompts)]
    rows = []
    for threads in sorted({int(t) for t in args.threads.split(",")}):
        direct = llamacpp_direct_tps(gguf, prompts, args.max_new_tokens, threads)
        sd = specdec_tps(prompts, args.max_new_tokens, threads, args.draft_len)
        rows.append({"threads": threads, "llamacpp_tokens_per_s": round(direct, 2),
                     "specdec_target_only_tokens_per_s": round(sd["target_only"], 2),
                     "specdec_speculative_tokens_per_s": round(sd["speculative"], 2),
                     "speedup_vs_llamacpp": {k: round(v / direct, 3) for k, v in sd.items()}})
        if not args.json:
            r = rows[-1]
            print(f"{threads} thread(s): llama.cpp {r['llamacpp_tokens_per_s']} tok/s; specdec target-only "
                  f"{r['specdec_target_only_tokens_per_s']} ({r['speedup_vs_llamacpp']['target_only']}x), "
                  f"speculative {r['specdec_speculative_tokens_per_s']} ({r['speedup_vs_llamacpp']['speculative']}x)")
    result = {"machine": _cpu_model(), "cores": os.cpu_count(), "model": os.path.basename(gguf),
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
