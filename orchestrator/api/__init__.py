"""The orchestrator's public gRPC API (`specdec serve orchestrator`).

    server.py   the Orchestrator servicer (Generate, GetSession, CancelSession, GetOutline), its flags and serve()
    prompts.py  chat messages to token ids, shared by the gRPC and HTTP APIs
    cancel.py   CancelSession of a session another orchestrator streams, under its lease
    outline.py  the running system's design outline (GetOutline, `specdec outline`)
"""
