"""The `specdec` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _stack_arguments(p: argparse.ArgumentParser) -> None:
    from launcher.stack import LLAMACPP_SPARE_STREAMS, StackConfig

    p.add_argument("--target-model", default=StackConfig.target_model, help="target model spec (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft-strategy", choices=["auto", "model", "ngram", "hybrid", "local-ngram", "quantized"],
                   default=StackConfig.draft_strategy,
                   help="auto: the distilled draft if `specdec distill` cached one whose report predicts a speedup, else "
                        "n-gram prompt lookup; local-ngram: n-gram drafting inside the orchestrator (no draft process, "
                        "one round trip per step); quantized: the target's own weights in int8 as the draft model")
    p.add_argument("--draft-model", default=StackConfig.draft_model)
    p.add_argument("--draft-replicas", type=int, default=StackConfig.draft_replicas)
    p.add_argument("--target-replicas", type=int, default=StackConfig.target_replicas,
                   help="target processes; each session is placed on one and moves to another if its target fails")
    p.add_argument("--draft-len", type=int, default=StackConfig.draft_len,
                   help="draft length (the starting one when adaptive)")
    p.add_argument("--adaptive-draft-len", action=argparse.BooleanOptionalAction,
                   default=StackConfig.adaptive_draft_len,
                   help="adapt the draft length per session from its acceptance (--no-adaptive-draft-len keeps "
                        "--draft-len fixed)")
    # run/up pipeline where it is measured to pay (the library's and the orchestrator's default is off)
    p.add_argument("--pipeline", choices=["off", "on", "auto"], default="auto",
                   help="draft block k+1 while the target verifies block k (auto: where measured to pay)")
    p.add_argument("--batch-window-ms", type=float,
                   help="target: wait up to this long to batch concurrent sessions' steps (default: 5 for `up`, "
                        "0 for `run`'s one session)")
    p.add_argument("--max-sessions", type=int,
                   help="concurrent generations the orchestrator admits, running and queued; each target keeps a KV "
                        "cache for as many (default: 64 for `up`, 1 for `run`'s one generation), except a batching "
                        "llama.cpp target (below)")
    p.add_argument("--max-running", type=_max_running, default=StackConfig.max_running,
                   help="generations decoding at once; the others wait in the orchestrator's admission queue (auto: "
                        "what the targets cache and batch in one forward). A batching llama.cpp target allocates "
                        f"KV streams (45 MiB each for SmolLM2) for these and {LLAMACPP_SPARE_STREAMS} more, at most "
                        "--max-sessions; a queued session gets one when it runs")
    p.add_argument("--queue-timeout-s", type=_positive_seconds, default=StackConfig.queue_timeout_s,
                   help="the longest a generation waits in the admission queue; then RESOURCE_EXHAUSTED (HTTP 429)")
    p.add_argument("--tree-budget", type=int, default=StackConfig.tree_budget,
                   help="tree speculation: the draft proposes a token tree of up to N nodes (0 = chains); a llama.cpp "
                        "target then runs its unified KV cache, which trees need but which makes a session's greedy "
                        "tokens depend on the other sessions' cache history (docs/engines.md)")
    p.add_argument("--store", choices=["redis", "memory"], default=StackConfig.store)
    p.add_argument("--engine", choices=["auto", "llamacpp", "torch"], default="auto",
                   help="the target's engine (auto: llama.cpp for a GGUF target, the default SmolLM2 included, on a "
                        "CPU where llama-cpp-python is installed, with n-gram drafting in the orchestrator; torch "
                        "otherwise, with the int8 self-draft: docs/engines.md)")
    p.add_argument("--threads", type=int, default=StackConfig.threads, help="torch threads per model service")
    p.add_argument("--pin-cpus", choices=["auto", "off"],
                   help="auto: the target and each draft on CPUs of their own when enough are allowed (threads "
                        "each), so a pipelined step's two requests do not queue behind each other's compute; off: "
                        "the OS scheduler places them (default: auto for `run`'s one session, off for `up`, where "
                        "many sessions' gRPC work would share the pinned CPUs: specdec/ops/cpu_affinity.py)")
    p.add_argument("--device", default=StackConfig.device)
    p.add_argument("--dtype", default=StackConfig.dtype)
    p.add_argument("--log-dir", default=None)


def _max_running(value: str) -> str:
    if value != "auto" and not (value.isdigit() and int(value) >= 1):
        raise argparse.ArgumentTypeError(f"auto or a number of at least 1, not {value!r}")
    return value


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"seconds above 0, not {value!r}")
    return seconds


def _stack_config(args):
    from launcher.stack import StackConfig

    return StackConfig(target_model=args.target_model, draft_strategy=args.draft_strategy,
                       draft_model=args.draft_model, draft_replicas=args.draft_replicas, draft_len=args.draft_len,
                       target_replicas=args.target_replicas,
                       adaptive_draft_len=args.adaptive_draft_len, pipeline=args.pipeline,
                       batch_window_ms=args.batch_window_ms,
                       max_sessions=args.max_sessions, max_running=args.max_running,
                       queue_timeout_s=args.queue_timeout_s, tree_budget=args.tree_budget,
                       store=args.store, engine=args.engine, threads=args.threads, device=args.device, dtype=args.dtype,
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


def _generate(client, args, prompt: str | None, speculation: bool | None, resume: tuple[str, int] | None = None):
    """One generation through `client`; without --json its text is printed as it streams."""
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed, stop=args.stop, max_draft_len=args.max_draft_len,
                  chat=not args.no_chat, ignore_eos=args.ignore_eos, speculation=speculation)
    if resume is not None:
        kwargs.update(resume_session_id=resume[0], resume_from=resume[1])
    if getattr(args, "timeout", None):
        kwargs["timeout_s"] = args.timeout
    progress = vars(args).setdefault("progress", _progress())  # what a failure's message reports

    def on_message(msg) -> None:
        progress["session_id"] = msg.session_id or progress["session_id"]
        if msg.token_ids:
            progress["next_token"] = msg.offset + len(msg.token_ids)
        if not args.json and msg.text:
            sys.stdout.write(msg.text)
            sys.stdout.flush()
            progress["printed"] = True

    result = client.generate(prompt, on_message=on_message, **kwargs)
    if not args.json:
        sys.stdout.write("\n")
    return result


def _progress() -> dict:
    """A generation's progress as far as the client saw it: its session, the next token index, text printed."""
    return {"session_id": "", "next_token": 0, "printed": False}


# Exit statuses: 2 for a request the server refused as invalid (as argparse's usage errors), 130 after Ctrl-C.
_USAGE_CODES = ("INVALID_ARGUMENT", "OUT_OF_RANGE")


def _failed(args, code: str, message: str, hint: str = "", status: int | None = None) -> int:
    """Report a generation that did not finish: one line on stderr (and, with --json, one object on stdout)."""
    progress = args.progress
    if progress["printed"]:
        sys.stdout.write("\n")  # end the partial text's line
        sys.stdout.flush()
    print(f"specdec {args.command}: {code}: {message}" + (f"\n{hint}" if hint else ""), file=sys.stderr)
    if args.json:
        error = {"code": code, "message": message}
        if progress["session_id"]:
            error.update(session_id=progress["session_id"], resume_from=progress["next_token"])
        print(json.dumps({"error": error}))
    if status is not None:
        return status
    return 2 if code in _USAGE_CODES else 1


def _resume_hint(args) -> str:
    """How to continue a session whose stream ended early (an orchestrator keeps it; `run` stops its own)."""
    sid = args.progress["session_id"]
    if not sid or args.command != "generate":
        return ""
    return (f"the session is kept; continue it with: specdec generate --address {args.address} --resume={sid} "
            f"--resume-from {args.progress['next_token']}")


def _rpc_failed(args, e) -> int:
    code = e.code().name if callable(getattr(e, "code", None)) else "UNKNOWN"
    details = (e.details() if callable(getattr(e, "details", None)) else None) or str(e)
    hint = _resume_hint(args)
    if not hint and code == "UNAVAILABLE" and args.command == "generate":
        hint = f"is an orchestrator running at {args.address}? (`specdec up` starts a local one)"
    elif code == "UNAUTHENTICATED":
        hint = "set SPECDEC_TOKEN to a token the orchestrator accepts"
    return _failed(args, code, details, hint)


def _print_result(result, args) -> None:
    if args.json:
        print(json.dumps(result.to_json()))
        return
    s = result.stats
    print(f"-- {len(result.token_ids)} tokens, finish={result.finish_reason}, "
          f"acceptance={s.get('acceptance_rate', 0):.2f}, mean accepted length={s.get('mean_accepted_length', 0):.2f}, "
          f"verify steps={s.get('verify_steps', 0)}, fallback steps={s.get('fallback_steps', 0)}, "
          f"{s.get('tokens_per_second', 0):.1f} tok/s", file=sys.stderr)


class _StartupReport:
    """Shows a starting stack's progress on stderr: one line rewritten in place on a terminal, else each service's
    new status once."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self.seen: dict[str, str] = {}

    def __call__(self, statuses: list[tuple[str, str]]) -> None:
        if self.tty:
            import shutil

            head = f"[{time.monotonic() - self.t0:.0f} s] "
            width = shutil.get_terminal_size().columns - 1
            share = max(16, (width - len(head)) // max(1, len(statuses)) - 3)  # each service its part of the line
            statuses = [(n, "ready" if s.startswith("ready at ") else s) for n, s in statuses]
            parts = [f"{n}: {s}" if len(n) + len(s) + 2 <= share else f"{n}: {s}"[: share - 1] + "…"
                     for n, s in statuses]
            self.stream.write("\r\033[K" + (head + " | ".join(parts))[:width])
        else:
            for name, status in statuses:
                if self.seen.get(name) != status:
                    self.seen[name] = status
                    self.stream.write(f"  {name}: {status}\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _new_stack(cfg, log_dir, command: str):
    """A LocalStack; an engine that cannot serve the target ends the command with the reason."""
    from launcher.stack import LocalStack
    from specdec.core.grpc_util import StartupError

    try:
        return LocalStack(cfg, log_dir)
    except StartupError as e:
        raise SystemExit(f"specdec {command}: {e}") from None


def _start(stack, command: str) -> None:
    """Start a LocalStack, showing on stderr what its services are doing until they serve; a service that
    cannot start ends the command with its reason (and its log's last lines), not a traceback."""
    report = _StartupReport()
    try:
        stack.start(progress=report)
    except (RuntimeError, TimeoutError) as e:  # ListenError, a service that exited or never became ready
        raise SystemExit(f"specdec {command}: {e}") from None
    finally:
        report.done()


def cmd_serve(args) -> int:
    if args.service == "target":
        from target_service.server import serve
    elif args.service == "draft":
        from draft_service.server import serve
    else:
        from orchestrator.api.server import serve
    from specdec.core.grpc_util import StartupError

    try:
        serve(args)
    except StartupError as e:
        print(f"specdec serve {args.service}: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def cmd_up(args) -> int:
    import signal
    import threading

    cfg = _stack_config(args)
    cfg.orchestrator_port = args.port
    cfg.http_port = args.http_port
    cfg.metrics_base_port = args.metrics_base_port
    stack = _new_stack(cfg, args.log_dir, "up")
    stop = threading.Event()

    def stop_quietly() -> None:  # from here on a signal asks to stop; it cannot cut the clean-up short
        signal.signal(signal.SIGTERM, lambda *a: stop.set())
        signal.signal(signal.SIGINT, lambda *a: stop.set())

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, _terminated)  # until the stack serves, SIGTERM unwinds like Ctrl-C
    try:
        print(f"starting local stack (logs in {stack.log_dir}) ...", file=sys.stderr)
        _start(stack, "up")
        stop_quietly()  # it serves: a signal from now on (one that read the line below too) asks it to stop
        print(json.dumps({"orchestrator": stack.address, "http": stack.http_url, "target": stack.target.address,
                          "targets": [t.address for t in stack.targets], "drafts": [d.address for d in stack.drafts],
                          "draft_strategy": stack.draft_strategy, "engine": stack.engine,
                          "redis": stack.redis.url if stack.redis else "memory", "logs": str(stack.log_dir),
                          "cpu_affinity": stack.cpu_affinity()}), flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        stop_quietly()
        try:
            stack.stop()  # everything the stack recorded, also after a signal in the middle of its start
        finally:
            for sig, handler in previous.items():  # the caller's handlers again (cmd_up may run in-process)
                signal.signal(sig, handler)
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is (as Ctrl-C raises KeyboardInterrupt), so every clean-up a Ctrl-C runs
    runs too."""


def _terminated(signum, frame):
    raise Terminated()


def cmd_generate(args) -> int:
    from specdec.client import SpecdecClient

    if (args.prompt is None) == (args.resume is None):
        raise SystemExit("specdec generate: give a prompt, or --resume SESSION_ID to continue a session")
    if args.resume_from is not None and (args.resume is None or args.resume_from < 0):
        raise SystemExit("specdec generate: --resume-from N needs --resume SESSION_ID and N >= 0")
    if not args.timeout > 0:
        raise SystemExit(f"specdec generate: --timeout must be positive, got {args.timeout}")
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    speculation = {"speculative": True, "target-only": False, "default": None}[args.mode]
    resume = (args.resume, args.resume_from or 0) if args.resume else None
    from specdec.core.grpc_util import client_tls_from_env

    with SpecdecClient(args.address, token=os.environ.get("SPECDEC_TOKEN"), tls=client_tls_from_env()) as client:
        result = _generate(client, args, args.prompt, speculation, resume)
    _print_result(result, args)
    return 0


def cmd_run(args) -> int:
    from specdec.client import SpecdecClient

    cfg = _stack_config(args)
    stack = _new_stack(cfg, args.log_dir, "run")
    print(f"starting local stack (logs in {stack.log_dir}) ...", file=sys.stderr)
    try:
        _start(stack, "run")
        with SpecdecClient(stack.address) as client:
            result = _generate(client, args, args.prompt, args.mode == "speculative")
    finally:
        stack.stop()
    if args.json:
        out = result.to_json()
        out["mode"] = args.mode
        out["draft_strategy"] = stack.draft_strategy if args.mode == "speculative" else None
        out["engine"] = stack.engine
        out["cpu_affinity"] = stack.cpu_affinity()
        print(json.dumps(out))
    else:
        _print_result(result, args)
    return 0


def cmd_distill(argv: list[str]) -> int:
    from offline.distill import main

    return main(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except Terminated:  # SIGTERM to `specdec up` while its stack starts: what started has stopped
        print("specdec: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:  # Ctrl-C while a service loads, `distill` trains, ...: what started has stopped
        print("specdec: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    if argv[:1] == ["distill"]:
        return cmd_distill(argv[1:])
    if argv[:1] == ["certs"]:
        from specdec.core.security import add_certs_arguments, run_certs

        p = argparse.ArgumentParser(prog="specdec certs", description="Make a CA, service certificates and secrets.")
        add_certs_arguments(p)
        return run_certs(p.parse_args(argv[1:]))
    if argv[:1] == ["datastore"]:
        from offline.datastore_build import main as datastore_main

        return datastore_main(argv[1:])
    if argv[:1] == ["serve"]:
        from launcher.serve_check import refusal

        refused = refusal(argv[1:])  # before the service's module imports torch: a refusal takes no seconds
        if refused is not None:
            print(f"specdec serve {argv[1]}: {refused}", file=sys.stderr)
            return refused.exit_code
    args = build_parser(with_services=argv[:1] == ["serve"]).parse_args(argv)
    if args.command not in ("generate", "run"):
        return args.func(args)
    import grpc

    args.progress = _progress()
    try:
        return args.func(args)
    except grpc.RpcError as e:  # the server's message, not a traceback
        return _rpc_failed(args, e)
    except KeyboardInterrupt:  # the client cancelled the stream on its way out
        hint = _resume_hint(args)
        return _failed(args, "CANCELLED", "stopped (Ctrl-C)", hint, status=130)


def build_parser(with_services: bool = True) -> argparse.ArgumentParser:
    """Every subcommand but distill and datastore, which parse their own arguments; `serve`'s services only
    with_services."""
    parser = argparse.ArgumentParser(prog="specdec", description="Disaggregated speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service")
    services = serve.add_subparsers(dest="service", required=True)
    if with_services:  # their modules import torch and transformers: seconds a client command need not wait
        from draft_service.server import add_arguments as draft_args
        from orchestrator.api.server import add_arguments as orch_args
        from target_service.server import add_arguments as target_args

        target_args(services.add_parser("target", help="the target model service"))
        draft_args(services.add_parser("draft", help="a draft service"))
        orch_args(services.add_parser("orchestrator", help="the orchestrator (public API)"))
    serve.set_defaults(func=cmd_serve)

    up = sub.add_parser("up", help="start Redis, target, draft and orchestrator on loopback until Ctrl-C")
    _stack_arguments(up)
    up.add_argument("--port", type=int, default=50050, help="orchestrator port (0 = any free port)")
    up.add_argument("--http-port", type=int, default=8000,
                    help="the OpenAI-compatible HTTP API's port (docs/http.md; 0 = any free port)")
    up.add_argument("--metrics-base-port", type=int, default=9464,
                    help="Prometheus endpoints: orchestrator here, target +1, drafts +2.. (0 = off); read by `specdec stats`")
    from launcher.stack import StackConfig

    up.set_defaults(func=cmd_up, batch_window_ms=5.0, pin_cpus="off", max_sessions=StackConfig.max_sessions)

    gen = sub.add_parser("generate", help="generate through a running orchestrator")
    gen.add_argument("prompt", nargs="?", help="the prompt; - reads it from standard input (omit it with --resume)")
    gen.add_argument("--address", default=os.environ.get("SPECDEC_ADDRESS", "127.0.0.1:50050"))
    gen.add_argument("--resume", metavar="SESSION_ID",
                     help="continue a session whose stream ended early (its own prompt and options apply)")
    gen.add_argument("--resume-from", type=int, metavar="N",
                     help="with --resume: stream from generated token N (default 0: the whole reply again)")
    gen.add_argument("--timeout", type=float, default=600.0, help="deadline of the whole generation, seconds")
    gen.add_argument("--mode", choices=["default", "speculative", "target-only"], default="default")
    _generation_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    run = sub.add_parser("run", help="start a local stack, generate once, print the result, stop everything")
    run.add_argument("--prompt", default="Write a short Python function that checks whether a number is prime.")
    run.add_argument("--mode", choices=["speculative", "target-only"], default="speculative")
    _stack_arguments(run)
    _generation_arguments(run)
    run.set_defaults(func=cmd_run, batch_window_ms=0.0, pin_cpus="auto", max_sessions=1)

    sub.add_parser("distill", help="distil a draft model from the target (see `specdec distill --help`)")
    sub.add_parser("certs", help="make a CA, one certificate per service and random secrets for mutual TLS "
                                 "(see `specdec certs --help`)")
    sub.add_parser("datastore", help="build the n-gram drafter's table of the target's replies "
                                     "(see `specdec datastore --help`)")

    from specdec.ops import stats_cli

    st = sub.add_parser("stats", help="summarise the services' Prometheus /metrics endpoints")
    stats_cli.add_stats_arguments(st)
    st.set_defaults(func=stats_cli.run_stats)
    ol = sub.add_parser("outline", help="print the running system's design outline")
    stats_cli.add_outline_arguments(ol)
    ol.set_defaults(func=stats_cli.run_outline)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
