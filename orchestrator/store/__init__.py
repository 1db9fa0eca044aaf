"""Per-session state in Redis: what a session is, where it is kept, and what a failure of the store means.

    session_store.py  SessionRecord and the store (Redis, or in memory for tests): leases, fencing, TTLs
    records.py        the request's parameters (GenerationParams) and the generation's statistics, as stored
    client.py         the Redis client: one server or a Sentinel-managed master, and the write's replica count
    status.py         the gRPC status of a store failure, for the API's handlers
"""
