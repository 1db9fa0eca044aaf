"""The machine a result was measured on: the hosts differ between runs, and so do their ratios."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's name (/proc/cpuinfo): the hosts differ between runs, and so do their ratios."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
