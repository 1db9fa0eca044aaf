"""CPU affinity for the model services: `--cpu-affinity 2-3` pins a service's threads to those CPUs.

Why: when the target and the draft share a host, each runs one compute thread, and pipelined speculation sends
both a request within a fraction of a millisecond. Left to the scheduler, the second one to wake was often queued
behind the first one's compute on the same CPU: on this 2-vCPU VM its request reached the handler 4-15 ms late in
about one step in ten (median 0.8 ms), and a pipelined step waits for both. Pinned to different CPUs, neither waits
for the other: a Verify's gRPC overhead lost its tail (90th percentile 4.5 -> 1.8 ms), a pipelined step's fell from
~3.0 to ~2.0 ms, one session's tokens/s rose 0-5% in interleaved A/Bs (docs/benchmark.md).

The cost: a pinned service's gRPC threads share its CPUs with its compute. With 8 concurrent sessions (batched
target) that work is no longer small, and 8 sessions ran 4-18% slower pinned one CPU each. So `specdec run` (one
session) pins by default and `specdec up` (a server) does not; give a pinned server more CPUs than compute threads.
"""

from __future__ import annotations

import os


MAX_CPUS = 8192  # Linux's largest NR_CPUS; a list past it is a typo, not a set worth building


def parse_cpu_list(text: str) -> set[int]:
    """'0-3,6' -> {0, 1, 2, 3, 6} (the format of `taskset -c` and cgroup cpusets). Empty -> empty set."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU number or a range like 2-3") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a range of CPU numbers (low-high, low <= high)")
        if last >= MAX_CPUS:
            raise ValueError(f"CPU list {text!r}: CPU {last} is past the largest CPU number Linux has ({MAX_CPUS - 1})")
        cpus.update(range(first, last + 1))
    return cpus


def format_cpu_list(cpus) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


SUPPORTED = hasattr(os, "sched_setaffinity")  # Linux; not macOS or Windows


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its cgroup cpuset or taskset), not merely how many the machine has."""
    return set(os.sched_getaffinity(0)) if SUPPORTED else set(range(os.cpu_count() or 1))


def pin_process(spec: str) -> set[int] | None:
    """Pin every thread of this process, and the threads it starts later, to the CPUs in `spec`. An empty spec
    pins nothing (returns None). Raises ValueError naming the CPUs allowed when spec asks for others."""
    cpus = parse_cpu_list(spec)
    if not cpus:
        return None
    if not SUPPORTED:
        raise ValueError(f"--cpu-affinity {spec}: this platform cannot pin threads to CPUs (Linux only)")
    allowed = allowed_cpus()
    if not cpus <= allowed:
        raise ValueError(f"--cpu-affinity {spec}: CPU {format_cpu_list(cpus - allowed)} is not available to this "
                         f"process (allowed: {format_cpu_list(allowed)})")
    pin_threads("self", cpus)
    return cpus


def pin_threads(pid: int | str, cpus: set[int]) -> None:
    """Set the CPUs of every thread of process `pid` ("self": this one), as `taskset -a -p`. sched_setaffinity
    applies to one thread and new threads inherit their creator's mask, so every thread that exists already is set
    (grpc and torch may have started some at import)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        if pid != "self":
            raise
        tids = [0]  # no procfs: the calling thread, inherited by every thread started from now on
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def local_stack_plan(threads: int, drafts: int, allowed: set[int] | None = None) -> dict[str, set[int]] | None:
    """Disjoint CPUs for a one-host stack: the target gets the last `threads` allowed CPUs, draft i the `threads`
    before those (and so on); the orchestrator, Redis and clients are left to float, as their work is short.
    None when the CPUs do not go round (pinning two compute threads to one CPU would be worse than not pinning)."""
    if allowed is None and not SUPPORTED:
        return None
    cpus = sorted(allowed_cpus() if allowed is None else allowed)
    need = threads * (1 + drafts)
    if threads < 1 or len(cpus) < need or len(cpus) < 2:
        return None
    plan = {"target": set(cpus[len(cpus) - threads:])}
    for i in range(drafts):
        hi = len(cpus) - threads * (i + 1)
        plan[f"draft{i}"] = set(cpus[hi - threads:hi])
    return plan


def affinity_args(plan: dict[str, set[int]], name: str) -> list[str]:
    """The `--cpu-affinity` arguments of the service `name` in a plan; none where the plan leaves it alone."""
    return ["--cpu-affinity", format_cpu_list(plan[name])] if name in plan else []


def describe(plan: dict[str, set[int]]) -> dict[str, str]:
    """{"target": {1}, "draft0": {0}} -> {"target": "1", "draft0": "0"} (for JSON)."""
    return {name: format_cpu_list(cpus) for name, cpus in plan.items()}


def add_argument(p) -> None:
    p.add_argument("--cpu-affinity", default=os.environ.get("SPECDEC_CPU_AFFINITY", ""), metavar="CPUS",
                   help="pin this service's threads to these CPUs, e.g. 2-3 or 0,2 (default: no pinning). Where "
                        "the target and a draft share a host, give them different CPUs: pipelined steps then do not "
                        "queue one service's request behind the other's compute (specdec/ops/cpu_affinity.py)")


def apply_from_args(args) -> set[int] | None:
    """Pin as `--cpu-affinity` asks (call before the service starts threads of its own); SystemExit with a
    readable message on a bad list."""
    try:
        return pin_process(args.cpu_affinity or "")
    except ValueError as e:
        raise SystemExit(str(e)) from None


def log_pinning(log, cpus: set[int] | None, threads: int) -> None:
    if cpus is None:
        return
    log.info("pinned to CPUs", extra={"cpus": format_cpu_list(cpus), "threads": threads})
    if threads > len(cpus):
        log.warning("more torch threads than pinned CPUs: they will share", extra={
            "threads": threads, "cpus": format_cpu_list(cpus)})
