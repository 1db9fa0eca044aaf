"""The state one `python -m bench` run shares between its phases (bench/runner.py runs them, bench/result.py
reads what they found)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

from bench.configs import session_job_count
from specdec.eval_prompts import Prompt


@dataclass
class BenchRun:
    """One benchmark run's state, shared by its phases: what was started and loaded, and what it found."""

    args: argparse.Namespace
    flags: dict                     # which optional service flags this checkout has
    services: Any                   # bench.services.BenchServices
    target: Any = None              # the target model loaded in this process (HF anchors, microbenchmark)
    draft: Any = None
    prompts: list[Prompt] = field(default_factory=list)
    ids: dict[str, list[int]] = field(default_factory=dict)  # prompt name -> its token ids
    not_measured: dict[str, str] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)   # where the wall time went, to keep --quick short
    progress: Any = None
    _mark: float = field(default_factory=time.perf_counter)

    def phase(self, name: str) -> None:
        """The time since the previous phase ended goes to `name`."""
        now = time.perf_counter()
        self.phases[name] = round(self.phases.get(name, 0.0) + now - self._mark, 1)
        self._mark = now

    @property
    def strategy(self) -> str:
        return self.services.strategy  # resolved with the engine, as `specdec run` does

    def sweep_prompts(self) -> list[Prompt]:
        return self.prompts[: max(1, min(self.args.session_prompts, len(self.prompts)))]

    def jobs_for(self, n: int) -> list[tuple[str, list[int]]]:
        """The generations the sweep runs at n sessions, cycling through its prompts."""
        prompts = self.sweep_prompts()
        count = session_job_count(self.args, n, len(prompts))
        return [(prompts[i % len(prompts)].name, self.ids[prompts[i % len(prompts)].name]) for i in range(count)]
