"""The orchestrator's public APIs: gRPC (`specdec serve orchestrator`) and the OpenAI-compatible HTTP API.

    server.py   the Orchestrator servicer (Generate, GetSession, CancelSession, GetOutline), its flags and serve()
    limits.py   a request's admission check and its limits resolved once (GenerationParams), for gRPC and HTTP
    prompts.py  chat messages to token ids, shared by the gRPC and HTTP APIs
    cancel.py   CancelSession of a session another orchestrator streams, under its lease
    outline.py  the running system's design outline (GetOutline, `specdec outline`)
    http/       the OpenAI-compatible HTTP API: FastAPI routers onto the same servicer (its own map)
"""
