"""Chaos suite: real services on loopback, load in client threads, faults injected at seeded moments.

    python -m chaos --scenario all --json          # every scenario, one JSON object per line
    python -m chaos --scenario kill_draft --quick  # the short version the tests run

See docs/chaos.md for what each scenario does and what it checks.
"""

SCENARIOS = ("slow_draft", "hang_draft", "kill_draft", "kill_all_drafts", "redis_restart", "kill_target",
             "kill_orchestrator")
SCENARIOS += ("kill_target_pool",)  # two target replicas: its own stack (chaos/target_pool.py)
DRAFT_FAULTS = ("slow_draft", "hang_draft", "kill_draft", "kill_all_drafts")
