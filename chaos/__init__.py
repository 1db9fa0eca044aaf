"""Chaos suite: real services on loopback, load in client threads, faults injected at seeded moments.

    python -m chaos --scenario all --json          # every scenario, one JSON object per line
    python -m chaos --scenario kill_draft --quick  # the short version the tests run

See docs/chaos.md for what each scenario does and what it checks.
"""

SCENARIOS = ("slow_draft", "hang_draft", "kill_draft", "kill_all_drafts", "redis_restart", "kill_target",
             "kill_orchestrator")
# The orchestrator's links to the target and to Redis through a fault proxy, and Redis losing data (faults_network.py)
NETWORK_SCENARIOS = ("target_latency", "target_partition", "target_conn_drop", "redis_latency", "redis_partition",
                     "redis_conn_drop", "redis_sigkill", "redis_empty_restart")
SCENARIOS += NETWORK_SCENARIOS
# A slowed or hung target, and sampling under draft faults (chaos/faults_target.py)
SCENARIOS += ("slow_target", "hang_target", "sampling_draft_faults")
# Two target replicas (chaos/target_pool.py); kept last: a second target joins the shared stack and the
# orchestrator restarts with both
SCENARIOS += ("kill_target_pool",)
DRAFT_FAULTS = ("slow_draft", "hang_draft", "kill_draft", "kill_all_drafts")
