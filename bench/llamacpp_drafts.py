"""Which drafter pays against a llama.cpp target: `specdec run`'s configurations on the same prompts, interleaved
prompt by prompt, end to end through the real processes (Redis, target, draft, orchestrator), next to plain
llama.cpp and to the PyTorch engine's default speculative stack.

    python -m bench.llamacpp_drafts [--num-prompts 4] [--max-new-tokens 96] [--rounds 1] [--json]

Rows (greedy, EOS ignored so every row generates the same number of tokens; tokens/s = new tokens over client
wall time, prefill included):
  llamacpp-direct        a bare llama_decode loop at all the cores (the anchor)
  torch-int8             the PyTorch engine with its int8 self-draft (target-kv handover), pipelining auto,
                         adaptive draft length, target and draft pinned to a core each
  llamacpp-target-only   --engine llamacpp at all the cores, speculation off
  llamacpp-local-ngram   --engine llamacpp at all the cores, n-gram prompt lookup inside the orchestrator, goodput
                         draft length (k = 0 where no k pays)
  llamacpp-int8          --engine llamacpp on one core, the int8 draft on the other (no KV handover: the draft
                         prefills the prompt itself)
Each llama.cpp speculative row's tokens are compared with llamacpp-target-only's (greedy identity)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from launcher.stack import StackConfig
from specdec.core.strategies import LOCAL_NGRAM, QUANTIZED


def configurations(cores: int, also_one_thread: bool = False) -> dict[str, tuple[StackConfig, bool]]:
    """name -> (the stack as `specdec run` starts it, speculation on). also_one_thread: the llama.cpp target-only
    and n-gram rows again with the target on one thread."""
    run = dict(pipeline="auto", pin_cpus="auto", adaptive_draft_len=True)
    whole = StackConfig(draft_strategy=LOCAL_NGRAM, engine="llamacpp", threads=cores, draft_replicas=0, **run)
    out = {
        "torch-int8": (StackConfig(draft_strategy=QUANTIZED, engine="torch", **run), True),
        "llamacpp-target-only": (whole, False),
        "llamacpp-local-ngram": (whole, True),
        "llamacpp-int8": (StackConfig(draft_strategy=QUANTIZED, engine="llamacpp", threads=1, **run), True),
    }
    if also_one_thread and cores > 1:
        one = StackConfig(draft_strategy=LOCAL_NGRAM, engine="llamacpp", threads=1, draft_replicas=0, **run)
        out.update({"llamacpp-target-only-t1": (one, False), "llamacpp-local-ngram-t1": (one, True)})
    return out


def measure(prompts: list[list[int]], max_new: int, rounds: int, cores: int, only: list[str] | None = None,
            also_one_thread: bool = False) -> dict:
    from bench.llamacpp_rows import DirectLlamaCpp
    from launcher.stack import LocalStack
    from specdec.client import SpecdecClient
    from specdec.models import smollm2_gguf_path

    cfgs = {k: v for k, v in configurations(cores, also_one_thread).items() if not only or k in only}
    stacks: dict[int, LocalStack] = {}
    clients: dict[int, SpecdecClient] = {}
    runs = {}
    directs = {"llamacpp-direct": DirectLlamaCpp(str(smollm2_gguf_path()), cores)}
    if also_one_thread and cores > 1:
        directs["llamacpp-direct-t1"] = DirectLlamaCpp(str(smollm2_gguf_path()), 1)
    for name, direct in directs.items():
        runs[name] = lambda ids, n, direct=direct: (None, *direct.generate(ids, n), {})
    try:
        for name, (cfg, speculation) in cfgs.items():
            if id(cfg) not in stacks:
                print(f"starting {name}", file=sys.stderr, flush=True)
                stacks[id(cfg)] = LocalStack(cfg).start()
                clients[id(cfg)] = SpecdecClient(stacks[id(cfg)].address)

            def one(ids, n, client=clients[id(cfg)], speculation=speculation):
                r = client.generate(ids, max_new_tokens=n, ignore_eos=True, speculation=speculation)
                return list(r.token_ids), len(r.token_ids), r.wall_s, dict(r.stats)

            runs[name] = one
        for run in runs.values():
            run(prompts[0], 16)  # warm-up
        totals = {name: {"tokens": 0, "wall_s": 0.0, "proposed": 0, "accepted": 0, "verify_steps": 0,
                         "decode_steps": 0} for name in runs}
        outputs: dict[str, list] = {name: [] for name in runs}
        names = list(runs)
        for r in range(rounds):
            for i, ids in enumerate(prompts):
                k = (r * len(prompts) + i) % len(names)
                for name in names[k:] + names[:k]:  # the order rotates so drift hits every row alike
                    tokens, n, wall, stats = runs[name](ids, max_new)
                    print(f"round {r} prompt {i} {name}: {n / wall:.1f} tok/s", file=sys.stderr, flush=True)
                    t = totals[name]
                    t["tokens"] += n
                    t["wall_s"] += wall
                    t["proposed"] += int(stats.get("draft_tokens_proposed", 0) or 0)
                    t["accepted"] += int(stats.get("draft_tokens_accepted", 0) or 0)
                    t["verify_steps"] += int(stats.get("verify_steps", 0) or 0)
                    t["decode_steps"] += int(stats.get("decode_steps", 0) or 0)
                    if r == 0:
                        outputs[name].append(tokens)
    finally:
        for c in clients.values():
            c.close()
        for s in stacks.values():
            s.stop()
        for direct in directs.values():
            direct.close()
    base = totals["llamacpp-direct"]["tokens"] / totals["llamacpp-direct"]["wall_s"]
    reference = outputs.get("llamacpp-target-only")
    rows = []
    for name, t in totals.items():
        tps = t["tokens"] / t["wall_s"]
        row = {"name": name, "tokens_per_s": round(tps, 2), "vs_llamacpp_direct": round(tps / base, 3),
               "acceptance_rate": round(t["accepted"] / t["proposed"], 3) if t["proposed"] else None,
               "verify_steps": t["verify_steps"], "decode_steps": t["decode_steps"], "draft_tokens": t["proposed"]}
        if reference is not None and name.startswith("llamacpp-") and not name.startswith(("llamacpp-direct",
                                                                                              "llamacpp-target-only")):
            row["identical_to_target_only"] = outputs[name] == reference
        rows.append(row)
    return {"rows": rows}


def quantized_step_cost(threads: int, types: tuple[str, ...] = ("Q4_0", "Q2_K"), tokens: int = 64) -> dict:
    """ms per single-token decode of the SmolLM2 GGUF and of lower-bit copies made with llama_model_quantize: what
    a same-weights draft on llama.cpp would cost per token relative to the target."""
    import tempfile

    import llama_cpp

    from bench.llamacpp_rows import DirectLlamaCpp
    from specdec.models import smollm2_gguf_path

    src = str(smollm2_gguf_path())
    out = {}
    with tempfile.TemporaryDirectory() as d:
        files = {"original": src}
        for t in types:
            path = os.path.join(d, f"smollm2-{t}.gguf")
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{t}")
            params.allow_requantize = True
            params.nthread = threads
            if llama_cpp.llama_model_quantize(src.encode(), path.encode(), params) == 0:
                files[t] = path
            else:
                out[t] = "llama_model_quantize failed"
        for name, path in files.items():
            m = DirectLlamaCpp(path, threads)
            try:
                m.generate([1, 2, 3, 4], 8)
                best = min(m.generate([1, 2, 3, 4], tokens)[1] for _ in range(3))
            finally:
                m.close()
            out[name] = {"ms_per_token": round(1000 * best / tokens, 3), "bytes": os.path.getsize(path)}
    base = out["original"]["ms_per_token"]
    for name, v in out.items():
        if isinstance(v, dict):
            v["vs_original"] = round(v["ms_per_token"] / base, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.llamacpp_drafts", description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="llama.cpp threads where no draft runs")
    p.add_argument("--only", default="", help="comma-separated rows (default all)")
    p.add_argument("--one-thread-rows", action="store_true",
                   help="also the llama.cpp target-only and n-gram rows with the target on one thread")
    p.add_argument("--quantize", action=argparse.BooleanOptionalAction, default=True,
                   help="also time lower-bit GGUF copies (llama_model_quantize) as same-weights drafts")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results" / "llamacpp" / "latest.json"),
                   help="where the result JSON goes ('' = nowhere)")
    args = p.parse_args(argv)
    from specdec.eval_prompts import encode, select
    from bench.machine import cpu_model
    from specdec.models import load_tokenizer, smollm2_gguf_path

    tok = load_tokenizer(str(smollm2_gguf_path()))
    prompts = [encode(pr, tok) for pr in select(args.num_prompts)]
    t0 = time.time()
    res = {"machine": cpu_model(), "cores": args.cores, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "rounds": args.rounds, "load_average_begin": os.getloadavg()[0]}
    res.update(measure(prompts, args.max_new_tokens, args.rounds, args.cores,
                       [x for x in args.only.split(",") if x] or None, args.one_thread_rows))
    if args.quantize:
        res["quantized_draft_cost"] = quantized_step_cost(1)
    res.update(load_average_end=os.getloadavg()[0], total_s=round(time.time() - t0, 1))
    res["command"] = "python -m bench.llamacpp_drafts " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for r in res["rows"]:
            print(r)
        print(res.get("quantized_draft_cost"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
