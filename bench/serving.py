"""Serving benchmark: `python -m bench --serving [--quick] [--json]`.

Starts the stack `specdec up` starts (Redis, target with --batch-window-ms 5, one draft, orchestrator with
--pipeline auto and the goodput draft length; services unpinned) and drives it as vLLM's benchmark_serving and
SGLang's bench_serving drive a server: streamed requests from a fixed, varied prompt set (specdec/eval_prompts.py),
closed-loop at 1, 2, 4, ..., 64 concurrent streams, then open-loop Poisson arrivals at a few request rates. Every
level runs twice on the same prompts, back to back: speculative (the server's default) and target-only (the same
requests with speculation off), the order alternating per level. Each pass starts from an empty prompt cache
(TargetService.ResetPromptCache) and, in the closed loop, after the level's first two requests untimed, as
llama-server gets them on its fresh server. Per level and mode: output tokens/s, requests/s, prompt rows the
target reused and computed,
TTFT, TPOT and ITL percentiles, acceptance, the share of steps that speculated, each service process's peak RSS;
at the highest concurrency also the KV cache bytes per session each service holds, against its configured bounds.
Writes bench/results/serving/latest.{json,md,png} (docs/benchmark.md, "Serving").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import platform
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from bench.llama_server import add_cli_option as add_llama_server_option
from bench.llama_server_rows import ServingAnchor
from bench.request_loops import drain
from bench.serving_metrics import (RequestRecord, evaluate_targets, level_row, poisson_arrivals, same_outputs,
                                   summarise_level)

log = logging.getLogger("bench.serving")

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
MODES = ("speculative", "target_only")
REFUSAL_RETRIES = 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench --serving", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer tokens and requests per level (under 10 minutes)")
    p.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    p.add_argument("--target-model", default="smollm2")
    p.add_argument("--draft-model", default="smollm2-draft")
    p.add_argument("--draft-strategy", default="auto", help="as `specdec up --draft-strategy`")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="closed-loop stream counts")
    p.add_argument("--request-rates", default=None,
                   help="open-loop Poisson rates in requests/s (default: 0.25, 0.5 and 0.75 x the highest "
                        "target-only requests/s the closed-loop levels measured, quick 0.5, 0.75 and 1.0 x; 'none' = no "
                        "open-loop levels)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per request (default 64; quick 24)")
    p.add_argument("--min-requests", type=int, default=None,
                   help="requests per closed-loop level at least (default 12; quick 3)")
    p.add_argument("--requests-per-stream", type=int, default=None,
                   help="requests each closed-loop stream sends at least (default 2; quick 1)")
    p.add_argument("--poisson-requests", type=int, default=None, help="requests per open-loop rate (default 24; quick 6)")
    p.add_argument("--num-prompts", type=int, default=12, help="prompts from specdec/eval_prompts.py, cycled")
    p.add_argument("--seed", type=int, default=0, help="Poisson schedule seed")
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--batch-window-ms", type=float, default=5.0, help="as `specdec up` (its default)")
    p.add_argument("--engine", choices=["auto", "llamacpp", "torch"], default="auto",
                   help="the target's engine, as `specdec up --engine` (auto: llama.cpp for a GGUF target on a CPU)")
    p.add_argument("--orchestrator-arg", action="append", default=[],
                   help="extra orchestrator flag (repeatable; e.g. --orchestrator-arg=--speculation-max-sessions=8)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="deadline of each request")
    p.add_argument("--out-dir", default=str(RESULTS_DIR / "serving"), help="where latest.json / .md / .png go")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--no-progress", action="store_true")
    add_llama_server_option(p)
    a = p.parse_args(argv)
    q = a.quick
    a.concurrency = sorted({int(x) for x in a.concurrency.split(",") if x.strip()})
    if not a.concurrency or min(a.concurrency) < 1:
        p.error("--concurrency needs positive stream counts")
    a.max_new_tokens = a.max_new_tokens or (24 if q else 64)
    a.min_requests = a.min_requests or (3 if q else 12)
    a.requests_per_stream = a.requests_per_stream or (1 if q else 2)
    a.poisson_requests = a.poisson_requests or (6 if q else 24)
    if a.request_rates and a.request_rates.strip().lower() == "none":
        a.request_rates = []
    elif a.request_rates:
        a.request_rates = [float(x) for x in a.request_rates.split(",") if x.strip()]
        if any(r <= 0 for r in a.request_rates):
            p.error("--request-rates must be positive")
    return a


def free_port_base(count: int, tries: int = 50) -> int:
    """A base port with `count` consecutive free loopback ports (the services' Prometheus endpoints)."""
    import random

    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(20000, 60000 - count)
        socks = []
        try:
            for i in range(count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free loopback ports found")


def rss_mib(pid: int) -> float | None:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def scrape_sums(url: str, names: tuple[str, ...]) -> dict[str, float] | None:
    """Each of `names` (Prometheus metric names) summed over its series on one service's endpoint: the names it
    has; None when the endpoint does not answer."""
    from specdec.ops.stats_cli import scrape

    try:
        text = scrape(url, timeout=2.0)
    except OSError:
        return None
    total: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                total[name] = total.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return total


def scrape_kv(url: str) -> tuple[float, float] | None:
    """(KV cache bytes, cached sessions) from one service's Prometheus endpoint, summed over its components."""
    total = scrape_sums(url, ("specdec_kv_cache_size_bytes", "specdec_kv_cache_sessions"))
    if total is None:
        return None
    return total.get("specdec_kv_cache_size_bytes", 0.0), total.get("specdec_kv_cache_sessions", 0.0)


PROMPT_ROWS = ("specdec_prompt_cache_reused_rows", "specdec_prompt_cache_computed_rows")


def scrape_prompt_rows(url: str) -> tuple[float, float] | None:
    """(prompt rows a kept prompt gave, prompt rows computed) since start, from the target's Prometheus endpoint
    (the llama.cpp engine's prompt cache gauges); None where it has none."""
    total = scrape_sums(url, PROMPT_ROWS)
    return None if total is None or len(total) < 2 else (total[PROMPT_ROWS[0]], total[PROMPT_ROWS[1]])


def prompt_rows_now(sr: "ServingRun") -> tuple[float, float] | None:
    return scrape_prompt_rows(sr.kv_urls["target"]) if "target" in sr.kv_urls else None


def fresh_prompt_cache(sr: "ServingRun") -> None:
    """Empty every target's kept prompts (ResetPromptCache), so each pass starts from the same cache."""
    from orchestrator.replicas.clients import TargetClient

    for target in sr.stack.targets:
        client = TargetClient(target.address)
        try:
            client.reset_prompt_cache()
        finally:
            client.close()


def prompt_rows_since(sr: "ServingRun", before: tuple[float, float] | None) -> dict:
    after = prompt_rows_now(sr) if before is not None else None
    if after is None:
        return {}
    return {"prompt_rows_reused": int(after[0] - before[0]), "prompt_rows_computed": int(after[1] - before[1])}


class Sampler:
    """Polls, while a level runs, every service process's RSS and (with `kv_urls`) each model service's KV cache."""

    def __init__(self, pids: dict[str, int], kv_urls: dict[str, str] | None = None, interval_s: float = 0.5):
        self.pids, self.kv_urls, self.interval = pids, kv_urls or {}, interval_s
        self.rss: dict[str, float] = {}
        self.kv: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        for name, pid in self.pids.items():
            v = rss_mib(pid)
            if v is not None:
                self.rss[name] = max(self.rss.get(name, 0.0), v)
        for name, url in self.kv_urls.items():
            got = scrape_kv(url)
            if got is None:
                continue
            nbytes, sessions = got
            k = self.kv.setdefault(name, {"peak_bytes": 0.0, "peak_sessions": 0, "bytes_per_session": None})
            k["peak_bytes"] = max(k["peak_bytes"], nbytes)
            if sessions and sessions >= k["peak_sessions"]:
                k["peak_sessions"] = int(sessions)
                k["bytes_per_session"] = nbytes / sessions

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "Sampler":
        self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="serving-sampler")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._sample()


def one_request(client, name: str, ids: list[int], max_new: int, speculative: bool, timeout_s: float) -> RequestRecord:
    """One streamed generation; RESOURCE_EXHAUSTED before admission is retried (counted), any other error recorded."""
    import grpc

    rec = RequestRecord(name)
    for attempt in range(REFUSAL_RETRIES + 1):
        rec.chunks = []
        t0 = time.perf_counter()

        def on_message(msg, t0=t0):
            if msg.token_ids:
                rec.chunks.append((time.perf_counter() - t0, len(msg.token_ids)))

        try:
            r = client.generate(ids, on_message=on_message, max_new_tokens=max_new,
                                speculation=None if speculative else False, timeout_s=timeout_s)
        except grpc.RpcError as e:
            code = e.code() if callable(getattr(e, "code", None)) else None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and attempt < REFUSAL_RETRIES:
                rec.refusals += 1
                time.sleep(0.05 * (attempt + 1))
                continue
            rec.error = without_session_ids(f"{getattr(code, 'name', type(e).__name__)}: {str(e)}")[:200]
            return rec
        rec.wall_s, rec.token_ids, rec.tokens, rec.stats = r.wall_s, list(r.token_ids), len(r.token_ids), r.stats
        return rec
    return rec


def without_session_ids(message: str) -> str:
    """An error message without the "(session ID, interrupted at token N)" of a resumable failure: the report
    compares failures across requests, and the ids are random."""
    return re.sub(r"\s*\(session [^)]*\)", "", message)


def closed_loop(n: int, jobs: list[tuple[str, list[int]]], clients: list, max_new: int, speculative: bool,
                timeout_s: float) -> tuple[float, list[RequestRecord]]:
    """n streams, each sending its next request when its previous one ends, until the job list is drained."""
    return drain(n, jobs, lambda i, name, ids: one_request(clients[i % len(clients)], name, ids, max_new, speculative,
                                                           timeout_s), timeout_s)


def open_loop(arrivals: list[float], jobs: list[tuple[str, list[int]]], clients: list, max_new: int,
              speculative: bool, timeout_s: float) -> tuple[float, list[RequestRecord]]:
    """Each request sent at its arrival time whatever the others are doing (Poisson: arrivals from the schedule)."""
    lock = threading.Lock()
    out: list[RequestRecord] = []

    def send(i: int):
        name, ids = jobs[i]
        rec = one_request(clients[i % len(clients)], name, ids, max_new, speculative, timeout_s)
        with lock:
            out.append(rec)

    threads = []
    t0 = time.perf_counter()
    for i, at in enumerate(arrivals):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=send, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout_s + 60)
    return time.perf_counter() - t0, out


def level_jobs(prompts: list[tuple[str, list[int]]], count: int, offset: int = 0) -> list[tuple[str, list[int]]]:
    return [prompts[(offset + i) % len(prompts)] for i in range(count)]


def stack_config(args, metrics_base_port: int):
    """The `specdec up` stack's configuration (its defaults: --engine auto, --pipeline auto, adaptive draft length,
    --batch-window-ms 5, not pinned), with Prometheus endpoints for the KV cache gauges."""
    from launcher.stack import StackConfig

    return StackConfig(target_model=args.target_model, draft_strategy=args.draft_strategy,
                       draft_model=args.draft_model, pipeline="auto", batch_window_ms=args.batch_window_ms,
                       engine=args.engine, threads=args.threads, device=args.device, dtype=args.dtype,
                       pin_cpus="off", metrics_base_port=metrics_base_port,
                       orchestrator_args=list(args.orchestrator_arg))


def start_stack(args):
    """The `specdec up` stack on free ports."""
    from launcher.stack import LocalStack

    for attempt in range(3):
        base = free_port_base(4)
        stack = LocalStack(stack_config(args, base), log_dir=args.log_dir)
        try:
            return stack.start(), base
        except Exception as e:  # noqa: BLE001 - a port taken between the check and the bind: try other ports
            if attempt == 2 or "address" not in str(e).lower():
                raise
            log.warning("stack start failed (%s), retrying on other ports", e)


def _level_line(label: str, row: dict) -> str:
    f = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    return (f"{label}: {f(row['spec_tokens_per_s'])} vs {f(row['target_only_tokens_per_s'])} tokens/s = "
            f"{f(row['ratio'])}x; p99 TPOT {f(row['tpot_p99_ms'])} vs {f(row['target_only_tpot_p99_ms'])} ms; "
            f"acceptance {f(row['acceptance_rate'])}, speculated {f(row['speculated_step_share'])}"
            + "".join(f"; {mode} prompt rows reused/computed {row[mode]['prompt_rows_reused']}/"
                      f"{row[mode]['prompt_rows_computed']}" for mode in MODES if "prompt_rows_reused" in row[mode]))


def _progress(args, total: int):
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, disable=args.no_progress, desc="serving", unit="run", dynamic_ncols=True)


@dataclass
class ServingRun:
    """One serving benchmark's state, shared by its levels: the stack, its clients and what was measured."""

    args: argparse.Namespace
    prompts: list[tuple[str, list[int]]]          # (name, token ids)
    stack: Any                                    # launcher.stack.LocalStack, started
    anchor: ServingAnchor                         # llama-server on the same requests, where it runs
    pids: dict[str, int]                          # process name -> pid, for the RSS samples
    kv_urls: dict[str, str]                       # model service -> its Prometheus endpoint (KV cache gauges)
    clients: list = field(default_factory=list)
    progress: Any = None
    started: tuple[float, tuple] = (0.0, ())      # time.time() and the load average when the run began
    startup_s: float = 0.0
    levels: list[dict] = field(default_factory=list)
    poisson: list[dict] = field(default_factory=list)
    memory: dict = field(default_factory=dict)    # mode -> peak RSS and KV cache at the highest concurrency


def run(args: argparse.Namespace) -> dict:
    from specdec.client import SpecdecClient

    started = (time.time(), os.getloadavg())
    prompts = _encoded_prompts(args)
    anchor = ServingAnchor.create(args.llama_server, args.target_model, args.threads, [ids for _, ids in prompts],
                                  args.max_new_tokens, args.log_dir)  # before the stack: it may install llama-server
    stack, base = start_stack(args)
    anchor.threads = stack.target_threads  # the same threads as specdec's target
    sr = ServingRun(args, prompts, stack, anchor, _pids(stack), _kv_urls(stack, base), started=started,
                    startup_s=time.time() - started[0])
    n_max = max(args.concurrency)
    sr.clients = [SpecdecClient(stack.address, timeout_s=args.request_timeout_s) for _ in range(min(n_max, 64))]
    n_rates = len(args.request_rates) if args.request_rates is not None else 3
    sr.progress = _progress(args, 2 * (1 + len(args.concurrency) + n_rates))
    try:
        for spec in (True, False):  # warm-up, untimed: connections, the first sessions, the policy's step costs
            sr.progress.set_postfix_str("warm-up")
            closed_loop(min(2, n_max), level_jobs(prompts, min(2, n_max)), sr.clients, args.warmup_tokens, spec,
                        args.request_timeout_s)
            sr.progress.update(1)
        for li, n in enumerate(args.concurrency):
            sr.levels.append(_concurrency_level(sr, li, n))
        for ri, rate in enumerate(_request_rates(args, sr.levels)):
            sr.poisson.append(_poisson_level(sr, ri, rate))
    finally:
        sr.progress.close()
        for c in sr.clients:
            c.close()
        stack.stop()
    res = assemble(sr)
    res["serving"]["llama_server"] = anchor.describe(sr.levels)
    return res


def _encoded_prompts(args: argparse.Namespace) -> list[tuple[str, list[int]]]:
    from specdec.eval_prompts import encode, select
    from specdec.models import load_tokenizer, parse_tiny_spec

    tok = load_tokenizer(args.target_model)
    tiny_vocab = (int(parse_tiny_spec(args.target_model)["vocab"])
                  if args.target_model.strip().lower().startswith("tiny") else None)
    return [(p.name, encode(p, tok, chat=True, tiny_vocab=tiny_vocab)) for p in select(args.num_prompts)]


def _pids(stack) -> dict[str, int]:
    pids = {p.name: p.proc.pid for p in stack.services() if p.proc is not None}
    if stack.redis is not None and stack.redis.proc is not None:
        pids["redis"] = stack.redis.proc.pid
    return pids


def _kv_urls(stack, base: int) -> dict[str, str]:
    kv_urls = {"target": f"http://127.0.0.1:{base + 1}/metrics"}
    kv_urls.update({d.name: f"http://127.0.0.1:{base + 2 + i}/metrics" for i, d in enumerate(stack.drafts)})
    return kv_urls


def _concurrency_level(sr: ServingRun, li: int, n: int) -> dict:
    """n closed-loop streams, speculative and target-only back to back on the same requests (the order alternating
    per level), then llama-server with -np n where it runs."""
    args, progress = sr.args, sr.progress
    n_max = max(args.concurrency)
    jobs = level_jobs(sr.prompts, max(args.min_requests, n * args.requests_per_stream), offset=li)
    got = {}
    for mode in (MODES if li % 2 == 0 else MODES[::-1]):
        progress.set_postfix_str(f"{n} streams {mode}")
        fresh_prompt_cache(sr)  # then the untimed warm-up llama-server gets on its fresh server: the same two requests
        closed_loop(min(2, n), jobs[: min(2, n)], sr.clients, args.warmup_tokens, mode == "speculative",
                    args.request_timeout_s)
        rows_before = prompt_rows_now(sr)
        with Sampler(sr.pids, sr.kv_urls if n == n_max else None, interval_s=0.25) as s:
            wall, recs = closed_loop(n, jobs, sr.clients, args.max_new_tokens, mode == "speculative",
                                     args.request_timeout_s)
        got[mode] = (summarise_level(recs, wall), recs, s)
        got[mode][0]["rss_mib_peak"] = dict(s.rss)
        got[mode][0].update(prompt_rows_since(sr, rows_before))
        if n == n_max:
            sr.memory[mode] = {"rss_mib_peak": dict(s.rss), "kv_cache": dict(s.kv)}
        progress.update(1)
    row = level_row("concurrency", n, got["speculative"][0], got["target_only"][0],
                    same_outputs(got["speculative"][1], got["target_only"][1]))
    row["rss_mib_peak"] = {k: max(got[m][0]["rss_mib_peak"].get(k, 0.0) for m in MODES) for k in sr.pids}
    if sr.anchor.binary:  # llama-server with -np n on the same requests, right after specdec's two modes
        progress.set_postfix_str(f"{n} streams llama-server")
        row.update(sr.anchor.level(n, jobs, args.max_new_tokens, args.warmup_tokens, args.request_timeout_s,
                                   {m: got[m][:2] for m in MODES}))
    progress.write(_level_line(f"{n} streams", row), file=sys.stderr)
    return row


def _request_rates(args: argparse.Namespace, levels: list[dict]) -> list[float]:
    """--request-rates, else fractions of the saturated target-only request rate the closed loop measured."""
    if args.request_rates is not None:
        return args.request_rates
    peak = max((r["target_only_requests_per_s"] or 0.0) for r in levels)
    fractions = (0.5, 0.75, 1.0) if args.quick else (0.25, 0.5, 0.75)  # quick: shorter arrival spans
    return [round(f * peak, 3) for f in fractions] if peak > 0 else []


def _poisson_level(sr: ServingRun, ri: int, rate: float) -> dict:
    """Requests arriving as a Poisson process at `rate` per second, speculative and target-only."""
    args = sr.args
    arrivals = poisson_arrivals(rate, args.poisson_requests, seed=args.seed + ri)
    jobs = level_jobs(sr.prompts, args.poisson_requests, offset=ri)
    got = {}
    for mode in (MODES if ri % 2 == 0 else MODES[::-1]):
        sr.progress.set_postfix_str(f"poisson {rate}/s {mode}")
        fresh_prompt_cache(sr)
        rows_before = prompt_rows_now(sr)
        with Sampler(sr.pids) as s:
            wall, recs = open_loop(arrivals, jobs, sr.clients, args.max_new_tokens, mode == "speculative",
                                   args.request_timeout_s)
        got[mode] = (summarise_level(recs, wall), recs)
        got[mode][0]["rss_mib_peak"] = dict(s.rss)
        got[mode][0].update(prompt_rows_since(sr, rows_before))
        sr.progress.update(1)
    row = level_row("request_rate", rate, got["speculative"][0], got["target_only"][0],
                    same_outputs(got["speculative"][1], got["target_only"][1]))
    row["arrival_span_s"] = arrivals[-1] if arrivals else 0.0
    sr.progress.write(_level_line(f"Poisson {rate}/s", row), file=sys.stderr)
    return row


def cache_bounds(stack) -> dict:
    """The KV cache bounds the services run with: the target's sessions as the stack sizes them
    (LocalStack.target_sessions), the rest the settings' defaults (`specdec up` passes none)."""
    from draft_service.settings import DraftSettings
    from target_service.settings import TargetSettings

    out = {"target": {"max_sessions": stack.target_sessions(), "max_cache_mb": TargetSettings.max_cache_mb}}
    for d in stack.drafts:
        out[d.name] = {"max_sessions": DraftSettings.max_sessions, "max_cache_mb": DraftSettings.max_cache_mb}
    return out


def memory_report(memory: dict, bounds: dict, n_max: int) -> dict:
    """At the highest concurrency: each process's peak RSS and each model service's KV cache (peak bytes, the most
    sessions cached at once, bytes per session there) against its configured bounds."""
    out = {"concurrency": n_max, "bounds": bounds, "by_mode": memory, "within_bounds": None}
    checks = []
    for mode in memory.values():
        for name, kv in mode.get("kv_cache", {}).items():
            b = bounds.get(name)
            if b is None:
                continue
            ok = kv["peak_bytes"] <= b["max_cache_mb"] * 2 ** 20 and kv["peak_sessions"] <= b["max_sessions"]
            kv["within_bounds"] = ok
            checks.append(ok)
    out["within_bounds"] = all(checks) if checks else None
    spec = memory.get("speculative", {}).get("kv_cache", {})
    out["kv_bytes_per_session"] = {k: v.get("bytes_per_session") for k, v in spec.items()}
    return out


def assemble(sr: ServingRun) -> dict:
    from bench.machine import cpu_model

    args, stack, levels, prompts = sr.args, sr.stack, sr.levels, sr.prompts
    t_begin, load_begin = sr.started
    ratios = [r["ratio"] for r in levels if r["ratio"] is not None]
    serving = {
        "mode": "quick" if args.quick else "full",
        "levels": levels,
        "poisson": sr.poisson,
        "min_ratio": min(ratios) if ratios else None,
        "targets": evaluate_targets(levels),
        "memory": memory_report(sr.memory, cache_bounds(stack), max(args.concurrency)),
        "stack": {"command": "specdec up defaults: --pipeline auto --adaptive-draft-len --batch-window-ms "
                             f"{args.batch_window_ms:g}, not pinned" +
                             (f"; extra orchestrator flags {' '.join(args.orchestrator_arg)}" if args.orchestrator_arg
                              else ""),
                  "target_model": args.target_model, "draft_strategy": stack.draft_strategy,
                  "engine": stack.engine, "engine_reason": stack.engine_reason, "target_threads": stack.target_threads,
                  "draft_model": args.draft_model, "processes": [p.name for p in stack.services()] + ["redis"]},
        "settings": {"max_new_tokens": args.max_new_tokens, "min_requests": args.min_requests,
                     "requests_per_stream": args.requests_per_stream, "poisson_requests": args.poisson_requests,
                     "concurrency": args.concurrency, "seed": args.seed, "decoding": "greedy (temperature 0)",
                     "prompts": [{"name": n, "prompt_tokens": len(ids)} for n, ids in prompts],
                     "modes": "speculative = the server's default; target_only = the same requests with "
                              "speculation off; back to back per level, the order alternating",
                     "definitions": "TTFT: request sent -> first streamed tokens; TPOT: (end - first chunk) / tokens "
                                    "after the first chunk; ITL: gap between consecutive streamed chunks; tokens/s "
                                    "and requests/s over the level's wall time (first send -> last done)"},
        "machine": {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
                    "python": platform.python_version(), "load_average_begin": load_begin,
                    "load_average_end": os.getloadavg(), "service_startup_s": sr.startup_s,
                    "total_s": time.time() - t_begin},
    }
    return {"benchmark": "specdec-serving", "command": None, "serving": serving}


def write_outputs(res: dict, out_dir: str | os.PathLike) -> dict[str, str]:
    from bench.serving_report import markdown, plot

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "latest.json", "markdown": out / "latest.md", "plot": out / "latest.png"}
    res["outputs"] = {k: str(v) for k, v in paths.items()}
    paths["json"].write_text(json.dumps(res, indent=2, default=float) + "\n")
    paths["markdown"].write_text(markdown(res))
    plot(res, paths["plot"])
    return res["outputs"]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args([a for a in argv if a != "--serving"])
    res = run(args)
    res["command"] = "python -m bench " + " ".join(argv)
    write_outputs(res, args.out_dir)
    if args.json:
        print(json.dumps(res, indent=2, default=float))
    else:
        print(pathlib.Path(res["outputs"]["markdown"]).read_text())
    return 0
