"""The specdec services the benchmark talks to: one Redis, one target, one draft and several orchestrators.

All are real processes on loopback (children of the benchmark), started with the same
``specdec serve`` command lines as :class:`launcher.stack.LocalStack`. Orchestrators differ only in
their flags and share the target, the draft and Redis, so a configuration switch costs no model load:

* ``orch-sequential``: ``--draft-len 4 --adaptive-draft-len``. A request with ``max_draft_len = g`` runs a fixed
  draft length g; ``max_draft_len = 0`` runs the adaptive schedule; ``speculation = off`` is target-only.
* ``orch-pipe-on`` / ``orch-pipe-auto``: the same plus ``--pipeline on`` / ``auto`` (a switch-style
  ``--pipeline`` works too), when the orchestrator has that flag.
* ``orch-pipe-auto-local``: ``--pipeline auto`` with ``--draft local:ngram`` (the n-gram drafter inside the
  orchestrator, no Propose round trip), when the services draft with n-gram.
* ``orch-heuristic``: ``orch-sequential`` with ``--draft-len-policy heuristic`` (transformers' +2 / -1 schedule
  instead of the goodput policy), full mode only.
* ``orch-pipe-auto-batched`` / ``orch-pipe-auto-local-batched``: twins for the sessions sweep, pointed at a
  second target started with ``--batch-window-ms`` (when the target has that flag); a headline without a twin
  gets one started after the single-session sweep.

The target's engine, the draft strategy, the target's threads and the CPU plan are those `specdec run` resolves
for the same options (a :class:`launcher.stack.LocalStack` built, not started). With the llama.cpp engine and
the n-gram drafter in the orchestrator (`--engine auto`'s choice for the GGUF on a CPU) there is no draft
process: every orchestrator drafts with ``--draft local:ngram`` and the target computes on the draft's cores.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import tempfile
from dataclasses import dataclass, field

from specdec.ops.redis_server import RedisServer
from launcher.stack import LocalStack, ServiceProcess, StackConfig, draft_model_args
from specdec.core.strategies import LOCAL_DRAFTS

log = logging.getLogger("bench")


def _parser(add_arguments) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    return p


def available_flags() -> dict:
    """Which optional service flags this checkout's services accept (asked of their own argument parsers).

    ``pipeline_modes``: the orchestrator arguments that turn pipelining on: ``["--pipeline", "on"]`` and
    ``["--pipeline", "auto"]`` for a ``--pipeline {off,on,auto}`` option, ``["--pipeline"]`` for a switch."""
    out = {"orchestrator --pipeline": False, "orchestrator --adaptive-draft-len": False,
           "target --batch-window-ms": False, "target --batch-wait-fraction": False,
           "orchestrator --speculation-max-sessions": False,
           "orchestrator --draft local:ngram": False, "orchestrator --draft-len-policy": False,
           "target --cpu-affinity": False, "pipeline_modes": {}}
    try:
        from orchestrator.api.server import add_arguments as orch_args

        actions = _parser(orch_args)._option_string_actions
        out["orchestrator --adaptive-draft-len"] = "--adaptive-draft-len" in actions
        out["orchestrator --speculation-max-sessions"] = "--speculation-max-sessions" in actions
        out["orchestrator --draft local:ngram"] = "--local-datastore" in actions
        out["orchestrator --draft-len-policy"] = "--draft-len-policy" in actions
        a = actions.get("--pipeline")
        if a is not None:
            out["orchestrator --pipeline"] = True
            if a.nargs == 0:
                out["pipeline_modes"] = {"on": ["--pipeline"]}
            elif a.choices:
                out["pipeline_modes"] = {m: ["--pipeline", m] for m in a.choices if m in ("on", "auto")}
            else:
                out["pipeline_modes"] = {"on": ["--pipeline", "on"]}
    except Exception as e:  # noqa: BLE001 - a half-edited module just means "not available"
        log.warning("could not read orchestrator flags: %s", e)
    try:
        from target_service.server import add_arguments as target_args

        target_actions = _parser(target_args)._option_string_actions
        out["target --batch-window-ms"] = "--batch-window-ms" in target_actions
        out["target --batch-wait-fraction"] = "--batch-wait-fraction" in target_actions
        out["target --cpu-affinity"] = "--cpu-affinity" in target_actions
    except Exception as e:  # noqa: BLE001
        log.warning("could not read target flags: %s", e)
    return out


@dataclass
class BenchServices:
    target_model: str
    draft_model: str
    draft_strategy: str = "auto"
    threads: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    adaptive: bool = True
    orchestrators: dict = field(default_factory=dict)  # name -> (target process name, extra flags)
    batch_window_ms: float | None = None  # start a second, batching target for the sessions sweep
    batch_wait_fraction: float | None = None  # its --batch-wait-fraction (None: the target's default)
    draft_vocab: int = 8192  # draft service --draft-vocab (model and hybrid strategies)
    pin_cpus: bool = False  # target and draft on CPUs of their own, as `specdec run` (cpu_affinity.py); unpin()
    log_dir: str | None = None
    engine: str = "torch"  # the target's --engine (auto resolved as `specdec run` resolves it)
    redis: RedisServer | None = None
    procs: dict[str, ServiceProcess] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self.dir = pathlib.Path(self.log_dir or tempfile.mkdtemp(prefix="specdec-bench-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        # `specdec run`'s choices for these options (StartupError for an --engine that cannot serve the target)
        plan = LocalStack(StackConfig(target_model=self.target_model, draft_strategy=self.draft_strategy,
                                      draft_model=self.draft_model, engine=self.engine, threads=self.threads,
                                      device=self.device, dtype=self.dtype,
                                      pin_cpus="auto" if self.pin_cpus else "off"), log_dir=str(self.dir))
        self.engine, self.engine_reason = plan.engine, plan.engine_reason
        self.strategy = plan.draft_strategy
        self.target_threads = plan.target_threads
        self.target_cache_args = plan.target_cache_args()  # --max-sessions: a llama.cpp target sizes its KV from it
        # process name -> CPUs (the batched target is never pinned: sweeps only)
        self.cpu_plan: dict = {"draft" if name == "draft0" else name: cpus for name, cpus in plan.cpu_plan.items()}

    @property
    def has_draft_process(self) -> bool:
        return self.strategy not in LOCAL_DRAFTS

    def _affinity(self, name: str) -> list[str]:
        from specdec.ops.cpu_affinity import affinity_args

        return affinity_args(self.cpu_plan, name)

    def unpin(self) -> None:
        """Let the scheduler place the services again (the sessions sweeps: `specdec up` does not pin, as many
        sessions' gRPC work would share each service's one CPU with its compute)."""
        from specdec.ops.cpu_affinity import allowed_cpus, pin_threads

        for name in self.cpu_plan:
            p = self.procs.get(name)
            if p is not None and p.proc is not None:
                pin_threads(p.proc.pid, allowed_cpus())
        self.cpu_plan = {}

    def _common(self, threads: int | None = None) -> list[str]:
        return ["--threads", str(threads or self.threads), "--device", self.device, "--dtype", self.dtype]

    def target_args(self, extra: list[str] = (), keep_prompts: bool = False) -> list[str]:
        """`specdec serve` arguments of a target: its engine, and the threads `specdec run` would give it.
        Without `keep_prompts`, --llama-prompt-cache 0: every configuration computes each prompt, as the plain
        llama.cpp rows do (a prompt kept from the configuration before would give the next one a head start)."""
        keep = [] if keep_prompts else ["--llama-prompt-cache", "0"]
        return ["target", "--model", self.target_model, "--listen", "127.0.0.1:0", "--engine", self.engine,
                *self._common(self.target_threads), *self.target_cache_args, *keep, *extra]

    def _spawn(self, name: str, args: list[str]) -> ServiceProcess:
        p = ServiceProcess(name, args, self.dir).start()
        self.procs[name] = p
        return p

    def orchestrator_flags(self, extra: list[str] = ()) -> list[str]:
        return ["--draft-len", "4", *(["--adaptive-draft-len"] if self.adaptive else []), *extra]

    def add_orchestrators(self, specs: dict, timeout: float = 300.0) -> None:
        """Start orchestrators {name: (target process name, extra flags)} against the running services."""
        for name, (target, extra) in specs.items():
            self._spawn(name, ["orchestrator", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
                               "--target", self.addresses[target],
                               "--draft", self.addresses.get("draft", "local:ngram"), "--redis", self.redis.url,
                               *self.orchestrator_flags(extra)])
        for name in specs:
            self.addresses[name] = self.procs[name].wait_ready(timeout)

    def launch(self) -> "BenchServices":
        """Start Redis and the model services without waiting (the caller can load its own models meanwhile)."""
        try:
            self.redis = RedisServer(data_dir=str(self.dir / "redis")).start()
            self._spawn("target", self.target_args(self._affinity("target")))
            if self.batch_window_ms is not None and self.engine != "llamacpp":
                self._spawn_batched_target()
            if not self.has_draft_process:  # the orchestrators draft in process (--draft local:ngram)
                return self
            dargs = ["draft", "--strategy", self.strategy, "--listen", "127.0.0.1:0", *self._common(),
                     *self._affinity("draft")]
            dargs += draft_model_args(self.strategy, self.draft_model, self.target_model,
                                      ["--draft-vocab", str(self.draft_vocab)])
            self._spawn("draft", dargs)
            return self
        except BaseException:
            self.stop()
            raise

    def _spawn_batched_target(self) -> None:
        """The sessions sweep's target, as served: it keeps prompts (the default prompt cache), so the sweep's
        sessions, which repeat the prompt set, decode from kept prompts at 1 and at 8 sessions alike and the ratio
        measures batching, not the prefill every session count does one prompt at a time."""
        self._spawn("target-batched", self.target_args(
            ["--batch-window-ms", str(self.batch_window_ms),
             *(["--batch-wait-fraction", str(self.batch_wait_fraction)]
               if self.batch_wait_fraction is not None else [])], keep_prompts=True))

    def wait(self, timeout: float = 600.0) -> "BenchServices":
        """Wait for the model services, then start the orchestrators (they need the services' addresses)."""
        try:
            for name in list(self.procs):
                self.addresses[name] = self.procs[name].wait_ready(timeout)
            if self.batch_window_ms is not None and "target-batched" not in self.procs:
                # llama.cpp: the batched twin starts once the first target is up. Each profiles its forwards at
                # start-up (the goodput policy's costs); started together on the loaded 2-core host, their
                # one-token forwards profiled at 84 and 550 ms against 10 ms measured in this process after.
                self._spawn_batched_target()
                self.addresses["target-batched"] = self.procs["target-batched"].wait_ready(timeout)
            self.add_orchestrators(self.orchestrators, timeout)
            return self
        except BaseException:
            self.stop()
            raise

    def start(self, timeout: float = 600.0) -> "BenchServices":
        return self.launch().wait(timeout)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system, all threads) each service process, Redis and this process (the clients) have
        used."""
        out = {"bench clients": sum(os.times()[:2])}
        pids = {name: p.proc.pid for name, p in self.procs.items() if p.proc is not None}
        redis = getattr(self.redis, "proc", None)
        if redis is not None:
            pids["redis"] = redis.pid
        for name, pid in pids.items():
            used = _process_cpu_s(pid)
            if used is not None:
                out[name] = used
        return out

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()
        if self.redis is not None:
            self.redis.stop()

    def logs(self, n: int = 20) -> str:
        return "\n".join(f"--- {name} ---\n{p.tail(n)}" for name, p in self.procs.items())

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _process_cpu_s(pid: int) -> float | None:
    """A process's CPU seconds (user + system) from /proc; None where there is none (not Linux, or it exited)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
