"""Shared core: speculative-sampling maths, token trees, per-session KV caches, the wire format and gRPC plumbing."""
