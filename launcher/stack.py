"""Launch specdec services as real processes on loopback: `specdec up`, `specdec run`, tests and chaos."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from draft_service.settings import DraftSettings
from orchestrator.settings import LoopConfig, ServerSettings
from specdec.core.strategies import LOCAL_NGRAM, MODEL_STRATEGIES, QUANTIZED
from specdec.ops.redis_server import RedisServer, interrupts_deferred


class ServiceProcess:
    """One `specdec serve ...` process. Ready when it prints 'SPECDEC_READY <address>'."""

    def __init__(self, name: str, args: list[str], log_dir: pathlib.Path, env: dict | None = None):
        self.name = name
        self.args = args
        self.log_path = log_dir / f"{name}.log"
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self.http_url: str | None = None  # an orchestrator's HTTP API, as it printed it
        self._ready = threading.Event()

    def start(self) -> "ServiceProcess":
        if self.address:  # a restart keeps the address, so clients and the orchestrator find it again
            i = self.args.index("--listen")
            self.args[i + 1] = self.address
        if self.http_url and "--http-listen" in self.args:  # and the HTTP API's
            self.args[self.args.index("--http-listen") + 1] = self.http_url.removeprefix("http://")
        self._ready.clear()
        # Its own process group (stop() signals the whole group), recorded before a Ctrl-C can unwind past it.
        with open(self.log_path, "ab") as log, interrupts_deferred():  # the child keeps its own descriptor
            self.proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "serve", *self.args],
                                         stdout=subprocess.PIPE, stderr=log, env=self.env, start_new_session=True)
        threading.Thread(target=self._watch, args=(self.proc,), daemon=True).start()
        return self

    def _watch(self, proc: subprocess.Popen) -> None:
        for line in iter(proc.stdout.readline, b""):
            text = line.decode(errors="replace").strip()
            if text.startswith("SPECDEC_HTTP "):
                self.http_url = text.split(" ", 1)[1]
            if text.startswith("SPECDEC_READY "):
                self.address = text.split(" ", 1)[1]
                self._ready.set()

    def wait_ready(self, timeout: float = 300.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._ready.wait(0.1):
                return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log:\n{self.tail()}")
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s; log:\n{self.tail()}")

    def status(self) -> str:
        """What a person waiting for this service wants to know: ready, exited, or the last thing it logged (a
        structured log line's message, or a progress bar's latest state)."""
        if self._ready.is_set():
            return f"ready at {self.address}"
        if self.proc is not None and self.proc.poll() is not None:
            return f"exited with {self.proc.returncode}"
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            lines = []
        for line in reversed(lines):
            text = line.rsplit("\r", 1)[-1].strip()  # a progress bar redraws itself after a carriage return
            if not text:
                continue
            if text.startswith("{"):
                try:
                    return str(json.loads(text).get("msg", text))
                except ValueError:
                    pass
            return text
        return "starting"

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc:
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        if not self.proc or self.proc.poll() is not None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self, timeout: float = 120.0) -> str:
        self.stop()
        self.start()
        return self.wait_ready(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class StackConfig:
    target_model: str = "smollm2"
    draft_strategy: str = "auto"  # auto: for SmolLM2 on a CPU with the native kernel, its own int8 copy
    # (quantized), else the distilled draft model if it pays, else n-gram prompt lookup; local-ngram: the n-gram
    # drafter inside the orchestrator (no draft process)
    draft_model: str = DraftSettings.model
    draft_replicas: int = 1
    target_replicas: int = 1  # target processes; the orchestrator places each session on one (a target pool)
    # The orchestrator's own defaults (orchestrator/settings.py). The library keeps pipelining off (tests and chaos
    # runs count steps); `specdec run/up` and deploy/docker-compose.yml turn it on (auto), as measured best in bench/.
    draft_len: int = LoopConfig.default_draft_len
    adaptive_draft_len: bool = LoopConfig.adaptive_draft_len
    pipeline: str = LoopConfig.pipeline  # off | on | auto
    batch_window_ms: float = 0.0  # target: batch concurrent sessions' steps within this window
    # The orchestrator admits max_sessions generations; each target keeps that many sessions' caches (a llama.cpp
    # target allocates a KV stream for each at start). Also read from orchestrator_args, where those win.
    max_sessions: int = ServerSettings.max_sessions
    # Admission (orchestrator/policy/admission.py): generations decoding at once (auto: what the targets cache and batch),
    # the others wait in its queue up to queue_timeout_s. Also read from orchestrator_args, where those win.
    max_running: str = ServerSettings.max_running
    queue_timeout_s: float = ServerSettings.queue_timeout_s
    tree_budget: int = LoopConfig.tree_budget  # >0: token trees; a llama.cpp target then runs its unified KV cache
    store: str = "redis"  # redis (a private redis-server) or memory
    # The target's engine (target_service/engines/select.py). The library keeps torch (tests and chaos runs count on
    # its KV export to the int8 draft); `specdec run/up` pass auto: llama.cpp for the GGUF on a CPU where installed.
    engine: str = "torch"
    threads: int = 1
    device: str = "auto"
    dtype: str = "auto"
    orchestrator_args: list[str] = field(default_factory=list)
    target_args: list[str] = field(default_factory=list)
    draft_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    orchestrator_port: int = 0
    http_port: int | None = None  # the orchestrator's OpenAI-compatible HTTP API (0 = any free port; None = none)
    # >0: Prometheus endpoints on orchestrator=base, target=base+1, drafts=base+2+i, further targets after the drafts
    metrics_base_port: int = 0
    # auto: the target and each draft process on CPUs of their own where enough are allowed (cpu_affinity.py;
    # `specdec run`, the benchmark's single sessions); off: the scheduler places them (`specdec up`, tests).
    pin_cpus: str = "off"


def draft_model_args(strategy: str, draft_model: str, target_model: str, extra: list[str] = ()) -> list[str]:
    """`specdec serve draft` arguments naming its model (model strategies) and the target (its tokenizer, for the
    n-gram drafter's compatibility check and its datastore)."""
    if strategy == QUANTIZED:
        return ["--model", target_model, "--vocab-from", target_model]
    if strategy in MODEL_STRATEGIES:
        return ["--model", draft_model, "--vocab-from", target_model, *extra]
    return ["--vocab-from", target_model]


def resolve_engine(cfg: StackConfig) -> tuple[str, str]:
    """(the target's engine, why): cfg.engine, auto resolved (llama.cpp for a GGUF on a CPU where llama-cpp-python
    is installed). StartupError for an engine that cannot serve the target."""
    from specdec.core.grpc_util import StartupError
    from target_service.engines.select import choose_engine

    try:
        return choose_engine(cfg.engine, cfg.target_model, cfg.device)
    except ValueError as e:
        raise StartupError(str(e)) from None


def resolve_draft_strategy(cfg: StackConfig, engine: str = "torch") -> str:
    """auto, for the default target: on the llama.cpp engine, n-gram prompt lookup in the orchestrator with the
    goodput draft length (it drafts only where a block pays, else decodes target-only: measured best there,
    docs/engines.md); on torch, its own weights in int8 where the draft runs on a CPU with the native kernel
    (measured best on a CPU, docs/benchmark.md), else the distilled draft if its report predicts a speedup,
    else n-gram prompt lookup. Another target: the draft model given."""
    if cfg.draft_strategy != "auto":
        return cfg.draft_strategy
    if engine == "llamacpp":
        return LOCAL_NGRAM
    if cfg.target_model in ("smollm2", "smollm2-135m-instruct") and cfg.draft_model == "smollm2-draft":
        if int8_draft_runs_here(cfg.device):
            return QUANTIZED
        return "model" if distilled_draft_pays() else "ngram"
    return "model"


def int8_draft_runs_here(device: str = "auto") -> bool:
    """The int8 draft needs a CPU device and the native kernel (AVX2 + FMA, g++ at first use)."""
    from specdec.models import cpu_kernels
    from specdec.models import resolve_device

    try:
        if resolve_device(device).type != "cpu":
            return False
    except ValueError:
        return False
    return cpu_kernels.native_gemm() is not None


def distilled_draft_pays() -> bool:
    """Use the distilled draft only if `specdec distill` cached one whose own held-out measurement
    predicts a speedup (its report: expected speedup from acceptance and cost ratio); else n-gram."""
    from specdec.models import cache_dir

    d = cache_dir() / "models" / "smollm2-draft"
    try:
        report = json.loads((d / "distill_report.json").read_text())
        return (d / "config.json").exists() and float(report["latency"]["float32"]["expected_speedup_iid"]) > 1.0
    except (OSError, KeyError, TypeError, ValueError):
        return False


LLAMACPP_SPECULATION_MAX_SESSIONS = 1  # more sessions generating than this: target-only (serving benchmark)
# KV streams a llama.cpp target keeps beyond the sessions admission runs at once: caches of sessions that just ended
# or paused (a resumed one finds its cache), so a turnover does not evict a running session. A session whose stream
# is gone resyncs, bitwise as it was (docs/engines.md); each stream costs 45 MiB (SmolLM2, 2048 tokens).
LLAMACPP_SPARE_STREAMS = 8


def last_flag_value(args: list[str], flag: str, default):
    """The value `flag` has in `args` as argparse reads them (its last `flag V` or `flag=V`), else `default`."""
    value = default
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _number(flag: str, value) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"argument {flag} {value!r} is not a number") from None


class LocalStack:
    """Redis + target + draft replica(s) + orchestrator on loopback; stops everything it started."""

    def __init__(self, cfg: StackConfig, log_dir: str | None = None):
        self.cfg = cfg
        self.log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="specdec-stack-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis: RedisServer | None = None
        self.targets: list[ServiceProcess] = []
        self.drafts: list[ServiceProcess] = []
        self.orchestrator: ServiceProcess | None = None
        self.engine, self.engine_reason = resolve_engine(cfg)
        self.draft_strategy = resolve_draft_strategy(cfg, self.engine)
        self.target_threads = self._target_threads()
        self.cpu_plan = self._cpu_plan()

    def _target_threads(self) -> int:
        """--threads per model service; a llama.cpp target without a draft process (the drafter runs in the
        orchestrator) computes on the cores the draft replicas would have had, as many as this process may use."""
        cfg = self.cfg
        if self.engine != "llamacpp" or self.draft_strategy != LOCAL_NGRAM:
            return cfg.threads
        from specdec.ops.cpu_affinity import allowed_cpus

        return max(1, min(len(allowed_cpus()), cfg.threads * (1 + cfg.draft_replicas)))

    def _cpu_plan(self) -> dict[str, set[int]]:
        if self.cfg.pin_cpus not in ("auto", "off"):
            raise ValueError(f"pin_cpus must be auto or off, not {self.cfg.pin_cpus!r}")
        if self.cfg.pin_cpus == "off":
            return {}
        from specdec.ops.cpu_affinity import local_stack_plan

        if self.draft_strategy == LOCAL_NGRAM:
            return local_stack_plan(self.target_threads, 0) or {}
        return local_stack_plan(self.cfg.threads, self.cfg.draft_replicas) or {}

    def cpu_affinity(self) -> dict[str, str]:
        """Where the services were pinned ({"target": "1", "draft0": "0"}); empty when nothing was."""
        from specdec.ops.cpu_affinity import describe

        return describe(self.cpu_plan)

    def _affinity(self, name: str) -> list[str]:
        from specdec.ops.cpu_affinity import affinity_args

        return affinity_args(self.cpu_plan, name)

    @property
    def target(self) -> ServiceProcess | None:
        """The first target process (a one-target stack's only one)."""
        return self.targets[0] if self.targets else None

    @property
    def address(self) -> str:
        return self.orchestrator.address

    def _draft_count(self) -> int:
        return 0 if self.draft_strategy == LOCAL_NGRAM else self.cfg.draft_replicas

    def _target_metrics(self, i: int) -> list[str]:
        return self._metrics(1 if i == 0 else 1 + self._draft_count() + i)

    def _metrics(self, offset: int) -> list[str]:
        return ["--metrics-port", str(self.cfg.metrics_base_port + offset)] if self.cfg.metrics_base_port else []

    def _speculation(self) -> list[str]:
        if self.cfg.pipeline not in ("off", "on", "auto"):
            raise ValueError(f"pipeline must be off, on or auto, not {self.cfg.pipeline!r}")
        return ["--pipeline", self.cfg.pipeline,
                "--adaptive-draft-len" if self.cfg.adaptive_draft_len else "--no-adaptive-draft-len"]

    def _orchestrator_setting(self, flag: str, default: int) -> int:
        """The number the orchestrator gets for `flag`: its last one in cfg.orchestrator_args, else `default`."""
        return _number(flag, last_flag_value(self.cfg.orchestrator_args, flag, default))

    def _sessions(self) -> list[str]:
        """The orchestrator's admission, tree and load-switch settings (cfg.orchestrator_args, later on its command
        line, win). A llama.cpp target on a CPU is compute-bound: a batch of sessions' verify blocks costs nearly
        its rows one by one, so with two or more sessions generating it decodes target-only (docs/engines.md)."""
        args = ["--max-sessions", str(self.cfg.max_sessions)]
        if self.engine == "llamacpp":
            args += ["--speculation-max-sessions", str(LLAMACPP_SPECULATION_MAX_SESSIONS)]
        return args + (["--tree-budget", str(self.cfg.tree_budget)] if self.cfg.tree_budget else [])

    def _admission(self) -> list[str]:
        """How many generations run at once and how long the others may wait (orchestrator/policy/admission.py)."""
        return ["--max-running", str(self.cfg.max_running), "--queue-timeout-s", str(self.cfg.queue_timeout_s)]

    def target_sessions(self) -> int:
        """The sessions' caches each target keeps. torch: one for every session the orchestrator admits (its caches
        grow as they fill). llama.cpp allocates a KV stream for each at start, so a batching target keeps the
        sessions admission runs at once (--max-running, auto: every replica's batch, in case one replica takes
        them all after a failure) and LLAMACPP_SPARE_STREAMS more; the queued ones hold none yet. Without
        batching, auto admission runs as many as the target keeps: one for every admitted session."""
        admitted = self._orchestrator_setting("--max-sessions", self.cfg.max_sessions)
        if self.engine != "llamacpp":
            return admitted
        running = last_flag_value(self.cfg.orchestrator_args, "--max-running", self.cfg.max_running)
        if running == "auto":
            if not self.cfg.batch_window_ms > 0:
                return admitted
            from target_service.settings import TargetSettings

            batch = _number("--max-batch", last_flag_value(self.cfg.target_args, "--max-batch", TargetSettings.max_batch))
            running = batch * max(1, self.cfg.target_replicas)
        return min(admitted, _number("--max-running", running) + LLAMACPP_SPARE_STREAMS)

    def target_cache_args(self) -> list[str]:
        """A target keeps the caches of target_sessions() (a llama.cpp target sizes its KV streams from it at
        start), and a llama.cpp target verifies token trees only on its unified KV cache: a tree budget turns that
        on (a session's greedy tokens then depend on the other sessions' cache history)."""
        args = ["--max-sessions", str(self.target_sessions())]
        if self.engine == "llamacpp" and self._orchestrator_setting("--tree-budget", self.cfg.tree_budget) > 0:
            args.append("--llama-kv-unified")
        return args

    def _batching(self) -> list[str]:
        return ["--batch-window-ms", str(self.cfg.batch_window_ms)] if self.cfg.batch_window_ms > 0 else []

    def _common(self, threads: int | None = None) -> list[str]:
        return ["--threads", str(threads or self.cfg.threads), "--device", self.cfg.device, "--dtype", self.cfg.dtype]

    def _check_ports(self) -> None:
        """Fail before loading any model when a fixed port is taken (a second `specdec up`, say)."""
        from specdec.core.grpc_util import bind_problem, listen_error

        cfg = self.cfg
        wanted = [(cfg.host, cfg.orchestrator_port, "the orchestrator", "--port")] if cfg.orchestrator_port else []
        if cfg.http_port:
            wanted.append((cfg.host, cfg.http_port, "the HTTP API", "--http-port"))
        if cfg.metrics_base_port:
            from specdec.observability import metrics_host

            host = metrics_host()
            services = 1 + self._draft_count() + max(1, cfg.target_replicas)
            wanted += [(host, cfg.metrics_base_port + i, "metrics", "--metrics-base-port") for i in range(services)]
        for host, port, what, flag in wanted:
            problem = bind_problem(host, port)
            if problem:
                raise listen_error(what, f"{host}:{port}", problem,
                                   f"another `specdec up`? choose another with {flag}, or 0")

    def _check_draft_model(self) -> None:
        """The distilled draft exists only after `specdec distill`: say so before starting anything."""
        from specdec import models
        from specdec.core.grpc_util import StartupError

        distilled = self.draft_strategy in MODEL_STRATEGIES and self.draft_strategy != QUANTIZED  # int8: the target's
        if distilled and self.cfg.draft_model.lower() == models.DRAFT_DIRNAME:
            try:
                models.distilled_draft_dir()
            except FileNotFoundError as e:
                raise StartupError(f"{e}; or use --draft-strategy quantized (the default for SmolLM2) or ngram") \
                    from None

    def services(self) -> list[ServiceProcess]:
        return [p for p in (*self.targets, *self.drafts, self.orchestrator) if p is not None]

    def start(self, timeout: float = 600.0, progress=None) -> "LocalStack":
        """Start everything and wait until it serves. progress([(name, status), ...]), if given, is called about
        once a second meanwhile with what each service last said (the first start converts the model: ~20 s)."""
        cfg = self.cfg
        self._check_ports()
        self._check_draft_model()
        stop_reporting = threading.Event()
        reporter = None
        if progress is not None:
            def report() -> None:
                while not stop_reporting.wait(1.0):
                    progress([(p.name, p.status()) for p in self.services()])

            reporter = threading.Thread(target=report, daemon=True, name="stack-progress")
            reporter.start()
        try:
            if cfg.store == "redis":
                self.redis = RedisServer(data_dir=str(self.log_dir / "redis"))  # tracked before it starts
                self.redis.start()
            if cfg.target_replicas < 1:
                raise ValueError(f"target_replicas must be at least 1, got {cfg.target_replicas}")
            for _ in range(cfg.target_replicas):
                self.add_target()
            for i in range(0 if self.draft_strategy == LOCAL_NGRAM else cfg.draft_replicas):
                dargs = ["draft", "--strategy", self.draft_strategy, "--listen", f"{cfg.host}:0", *self._common(),
                         *self._metrics(2 + i), *self._affinity(f"draft{i}")]
                dargs += draft_model_args(self.draft_strategy, cfg.draft_model, cfg.target_model)
                self.drafts.append(ServiceProcess(f"draft{i}", dargs + cfg.draft_args, self.log_dir))
                self.drafts[-1].start()
            target_addr = ",".join(t.wait_ready(timeout) for t in self.targets)
            draft_addrs = [d.wait_ready(timeout) for d in self.drafts]
            self.start_orchestrator(target_addr, draft_addrs, timeout)
            return self
        except BaseException:
            self.stop()
            raise
        finally:
            stop_reporting.set()
            if reporter is not None:
                reporter.join(5.0)  # its last report is out before the caller writes on

    def add_target(self) -> ServiceProcess:
        """Start one more target replica (not yet ready); a running orchestrator sees it once restarted."""
        cfg, i = self.cfg, len(self.targets)
        name = "target" if i == 0 else f"target{i}"
        self.targets.append(ServiceProcess(
            name, ["target", "--model", cfg.target_model, "--listen", f"{cfg.host}:0", *self._common(self.target_threads),
                   "--engine", self.engine, *self._target_metrics(i), *self._batching(), *self._affinity(name),
                   *self.target_cache_args(), *cfg.target_args],
            self.log_dir))
        return self.targets[-1].start()  # tracked before its process exists: a Ctrl-C now still stops it

    def start_orchestrator(self, target_addr: str | None = None, draft_addrs: list[str] | None = None,
                           timeout: float = 120.0) -> str:
        target_addr = target_addr or ",".join(t.address for t in self.targets)
        draft_addrs = draft_addrs if draft_addrs is not None else [d.address for d in self.drafts]
        if self.draft_strategy == LOCAL_NGRAM:
            draft_addrs = ["local:ngram"]
        store = self.redis.url if self.redis else "memory"
        args = ["orchestrator", "--listen", f"{self.cfg.host}:{self.cfg.orchestrator_port}", "--target", target_addr,
                "--draft", ",".join(a for a in draft_addrs if a), "--redis", store,
                "--draft-len", str(self.cfg.draft_len), *self._speculation(), *self._sessions(), *self._admission(),
                *self._metrics(0),
                "--http-listen", "" if self.cfg.http_port is None else f"{self.cfg.host}:{self.cfg.http_port}",
                *self.cfg.orchestrator_args]
        self.orchestrator = ServiceProcess("orchestrator", args, self.log_dir)
        self.orchestrator.start()
        addr = self.orchestrator.wait_ready(timeout)
        # Restarts reuse the port so clients can reconnect to the same address.
        self.cfg.orchestrator_port = int(addr.rsplit(":", 1)[1])
        if self.orchestrator.http_url:
            self.cfg.http_port = int(self.orchestrator.http_url.rsplit(":", 1)[1])
        return addr

    @property
    def http_url(self) -> str | None:
        """The orchestrator's OpenAI-compatible API (http://HOST:PORT; its routes are under /v1)."""
        return self.orchestrator.http_url if self.orchestrator else None

    def stop(self) -> None:
        for p in [self.orchestrator, *self.drafts, *self.targets]:
            if p is not None:
                p.stop()
        if self.redis:
            self.redis.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
