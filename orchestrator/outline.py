"""The running system's design outline (`specdec outline`, Orchestrator.GetOutline)."""

from __future__ import annotations


def build_outline(servicer) -> dict:
    raise NotImplementedError("outline not built yet")
