"""The `specdec` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _stack_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-model", default="smollm2", help="target model spec (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft-strategy", choices=["auto", "model", "ngram", "hybrid", "local-ngram", "quantized"],
                   default="auto",
                   help="auto: the distilled draft if `specdec distill` cached one whose report predicts a speedup, else "
                        "n-gram prompt lookup; local-ngram: n-gram drafting inside the orchestrator (no draft process, "
                        "one round trip per step); quantized: the target's own weights in int8 as the draft model")
    p.add_argument("--draft-model", default="smollm2-draft")
    p.add_argument("--draft-replicas", type=int, default=1)
    p.add_argument("--draft-len", type=int, default=4, help="draft length (the starting one when adaptive)")
    p.add_argument("--adaptive-draft-len", action=argparse.BooleanOptionalAction, default=True,
                   help="adapt the draft length per session from its acceptance (the deployment's default; "
                        "--no-adaptive-draft-len keeps --draft-len fixed)")
    p.add_argument("--pipeline", choices=["off", "on", "auto"], default="auto",
                   help="draft block k+1 while the target verifies block k (auto: where measured to pay)")
    p.add_argument("--batch-window-ms", type=float,
                   help="target: wait up to this long to batch concurrent sessions' steps (default: 5 for `up`, "
                        "0 for `run`'s one session)")
    p.add_argument("--store", choices=["redis", "memory"], default="redis")
    p.add_argument("--threads", type=int, default=1, help="torch threads per model service")
    p.add_argument("--pin-cpus", choices=["auto", "off"],
                   help="auto: the target and each draft on CPUs of their own when enough are allowed (threads "
                        "each), so a pipelined step's two requests do not queue behind each other's compute; off: "
                        "the OS scheduler places them (default: auto for `run`'s one session, off for `up`, where "
                        "many sessions' gRPC work would share the pinned CPUs: specdec/cpu_affinity.py)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--log-dir", default=None)


def _stack_config(args):
    from specdec.stack import StackConfig

    return StackConfig(target_model=args.target_model, draft_strategy=args.draft_strategy,
                       draft_model=args.draft_model, draft_replicas=args.draft_replicas, draft_len=args.draft_len,
                       adaptive_draft_len=args.adaptive_draft_len, pipeline=args.pipeline,
                       batch_window_ms=args.batch_window_ms,
                       store=args.store, threads=args.threads, device=args.device, dtype=args.dtype,
                       pin_cpus=args.pin_cpus)


def _generation_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--max-draft-len", type=int, default=0)
    p.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _generate(client, args, prompt: str, speculation: bool | None):
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed, stop=args.stop, max_draft_len=args.max_draft_len,
                  chat=not args.no_chat, ignore_eos=args.ignore_eos, speculation=speculation)
    if args.json:
        return client.generate(prompt, **kwargs)
    from specdec.client import FINISH_REASONS, GenerationResult, _stats_dict
    import time

    t0 = time.perf_counter()
    text, tokens, sid, stats, finish = [], [], "", {}, "unspecified"
    for msg in client.stream(prompt, **kwargs):
        sid = msg.session_id or sid
        sys.stdout.write(msg.text)
        sys.stdout.flush()
        text.append(msg.text)
        tokens.extend(msg.token_ids)
        if msg.HasField("stats"):
            stats, finish = _stats_dict(msg.stats), FINISH_REASONS.get(msg.finish_reason, "unspecified")
    sys.stdout.write("\n")
    return GenerationResult(sid, "".join(text), tokens, finish, stats, time.perf_counter() - t0)


def _print_result(result, args) -> None:
    if args.json:
        print(json.dumps(result.to_json()))
        return
    s = result.stats
    print(f"-- {len(result.token_ids)} tokens, finish={result.finish_reason}, "
          f"acceptance={s.get('acceptance_rate', 0):.2f}, mean accepted length={s.get('mean_accepted_length', 0):.2f}, "
          f"verify steps={s.get('verify_steps', 0)}, fallback steps={s.get('fallback_steps', 0)}, "
          f"{s.get('tokens_per_second', 0):.1f} tok/s", file=sys.stderr)


def cmd_serve(args) -> int:
    if args.service == "target":
        from target_service.server import serve
    elif args.service == "draft":
        from draft_service.server import serve
    else:
        from orchestrator.server import serve
    serve(args)
    return 0


def cmd_up(args) -> int:
    import signal
    import threading

    from specdec.stack import LocalStack

    cfg = _stack_config(args)
    cfg.orchestrator_port = args.port
    cfg.metrics_base_port = args.metrics_base_port
    stack = LocalStack(cfg, args.log_dir)
    print(f"starting local stack (logs in {stack.log_dir}) ...", file=sys.stderr)
    stack.start()
    print(json.dumps({"orchestrator": stack.address, "target": stack.target.address,
                      "drafts": [d.address for d in stack.drafts], "draft_strategy": stack.draft_strategy,
                      "redis": stack.redis.url if stack.redis else "memory", "logs": str(stack.log_dir),
                      "cpu_affinity": stack.cpu_affinity()}), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    finally:
        stack.stop()
    return 0


def cmd_generate(args) -> int:
    from specdec.client import SpecdecClient

    speculation = {"speculative": True, "target-only": False, "default": None}[args.mode]
    with SpecdecClient(args.address, token=os.environ.get("SPECDEC_TOKEN")) as client:
        result = _generate(client, args, args.prompt, speculation)
    _print_result(result, args)
    return 0


def cmd_run(args) -> int:
    from specdec.client import SpecdecClient
    from specdec.stack import LocalStack

    cfg = _stack_config(args)
    with LocalStack(cfg, args.log_dir) as stack:
        with SpecdecClient(stack.address) as client:
            result = _generate(client, args, args.prompt, args.mode == "speculative")
    if args.json:
        out = result.to_json()
        out["mode"] = args.mode
        out["draft_strategy"] = stack.draft_strategy if args.mode == "speculative" else None
        out["cpu_affinity"] = stack.cpu_affinity()
        print(json.dumps(out))
    else:
        _print_result(result, args)
    return 0


def cmd_distill(argv: list[str]) -> int:
    from draft_service.distill import main

    return main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["distill"]:
        return cmd_distill(argv[1:])
    if argv[:1] == ["datastore"]:
        from draft_service.datastore_build import main as datastore_main

        return datastore_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand but distill and datastore, which parse their own arguments."""
    parser = argparse.ArgumentParser(prog="specdec", description="Disaggregated speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service")
    services = serve.add_subparsers(dest="service", required=True)
    from draft_service.server import add_arguments as draft_args
    from orchestrator.server import add_arguments as orch_args
    from target_service.server import add_arguments as target_args

    target_args(services.add_parser("target", help="the target model service"))
    draft_args(services.add_parser("draft", help="a draft service"))
    orch_args(services.add_parser("orchestrator", help="the orchestrator (public API)"))
    serve.set_defaults(func=cmd_serve)

    up = sub.add_parser("up", help="start Redis, target, draft and orchestrator on loopback until Ctrl-C")
    _stack_arguments(up)
    up.add_argument("--port", type=int, default=50050, help="orchestrator port (0 = any free port)")
    up.add_argument("--metrics-base-port", type=int, default=9464,
                    help="Prometheus endpoints: orchestrator here, target +1, drafts +2.. (0 = off); read by `specdec stats`")
    up.set_defaults(func=cmd_up, batch_window_ms=5.0, pin_cpus="off")

    gen = sub.add_parser("generate", help="generate through a running orchestrator")
    gen.add_argument("prompt")
    gen.add_argument("--address", default=os.environ.get("SPECDEC_ADDRESS", "127.0.0.1:50050"))
    gen.add_argument("--mode", choices=["default", "speculative", "target-only"], default="default")
    _generation_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    run = sub.add_parser("run", help="start a local stack, generate once, print the result, stop everything")
    run.add_argument("--prompt", default="Write a short Python function that checks whether a number is prime.")
    run.add_argument("--mode", choices=["speculative", "target-only"], default="speculative")
    _stack_arguments(run)
    _generation_arguments(run)
    run.set_defaults(func=cmd_run, batch_window_ms=0.0, pin_cpus="auto")

    sub.add_parser("distill", help="distil a draft model from the target (see `specdec distill --help`)")
    sub.add_parser("datastore", help="build the n-gram drafter's table of the target's replies "
                                     "(see `specdec datastore --help`)")

    from specdec import stats_cli

    st = sub.add_parser("stats", help="summarise the services' Prometheus /metrics endpoints")
    stats_cli.add_stats_arguments(st)
    st.set_defaults(func=stats_cli.run_stats)
    ol = sub.add_parser("outline", help="print the running system's design outline")
    stats_cli.add_outline_arguments(ol)
    ol.set_defaults(func=stats_cli.run_outline)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
