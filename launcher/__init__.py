"""Starts the system: the `specdec` command line and the local stack (Redis, target, drafts, orchestrator)."""
