"""The orchestrator: the public APIs, the speculative loop, and what the loop stands on. Each room has its map.

    api/       the public gRPC API (the servicer), prompts, cancellation, the design outline
    loop/      the speculative loop of one generation: propose, verify, commit, stream
    store/     the Redis session store: records, the client, the gRPC status of a store failure
    replicas/  draft and target replicas: pools, health, discovery, clients, the in-process drafter
    policy/    admission control and the draft-length policy
    http_api.py, http_request.py   the OpenAI-compatible HTTP API over the gRPC servicer
    settings.py  the orchestrator's settings (flags are generated from them)
    metrics.py   the orchestrator's metrics

An arrow runs down this list only: api -> loop -> store, replicas, policy; nothing below imports api/.
"""
