"""The draft and target replicas the orchestrator calls.

    pool.py         replicas of one service: health checks, a breaker per replica, rendezvous ranking
    draft_pool.py   the draft replicas (pool.py with the draft client)
    target_pool.py  the target replicas and each session's seat on one of them
    discovery.py    ``dns:///name:port``: every address a name resolves to
    clients.py      the gRPC clients of the draft and target services (token deltas, deadlines)
    local_draft.py  ``--draft local:ngram``: an n-gram drafter inside the orchestrator's process
"""
