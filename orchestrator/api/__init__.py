"""The orchestrator's public APIs.

- http/  the OpenAI-compatible HTTP API (FastAPI), a second door to the gRPC servicer
"""
