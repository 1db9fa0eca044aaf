"""Timed runs besides the single-session sweep: one configuration on one prompt, a level of the concurrency
sweep, the model-step microbenchmarks and the per-step system overheads (gRPC round trip, Redis commit)."""

from __future__ import annotations

import logging
import statistics
import threading
import time

from bench.configs import Config, Sample

log = logging.getLogger("bench")


def _run_one(cfg: Config, ids: list[int], max_new: int, prompt: str, rnd: int) -> Sample | None:
    try:
        s = cfg.run(ids, max_new)
    except Exception as e:  # noqa: BLE001 - one broken configuration must not sink the whole run
        cfg.available = False
        cfg.reason = f"failed during the run: {type(e).__name__}: {str(e)[:300]}"
        log.error("%s failed: %s", cfg.name, e)
        return None
    s.prompt, s.round = prompt, rnd
    return s


def run_sessions_level(n: int, jobs: list[tuple[str, list[int]]], max_new: int, clients: list,
                       draft_len: int = 0) -> tuple[float, list[Sample]]:
    """n worker threads (one client each) drain the job list; returns (wall seconds, samples)."""
    lock = threading.Lock()
    queue = list(jobs)
    out: list[Sample] = []
    errors: list[BaseException] = []

    def worker(client):
        while True:
            with lock:
                if not queue or errors:
                    return
                name, ids = queue.pop(0)
            try:
                r = client.generate(ids, max_new_tokens=max_new, speculation=True, max_draft_len=draft_len)
            except BaseException as e:  # noqa: BLE001
                with lock:
                    errors.append(e)
                return
            with lock:
                out.append(Sample(name, 0, list(r.token_ids), r.wall_s, dict(r.stats)))

    threads = [threading.Thread(target=worker, args=(clients[i],), daemon=True) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall, out


def microbench(target, draft, ids: list[int], draft_lens: list[int], reps: int = 8, target_session=None,
               engine: str = "torch") -> dict:
    """Target step time, (g+1)-token verify forwards and the draft step, in this process on the services'
    KV-cache code path, interleaved (see bench.hf.step_costs). target_session: the llama.cpp engine's (see
    bench.llamacpp_rows.llamacpp_session), else the torch model's."""
    from bench.hf import step_costs

    sizes = list(range(2, max(draft_lens) + 3))  # verify blocks of g + 1 tokens, g = 1 .. max + 1
    r = step_costs(target, draft, ids, sizes, reps=reps, target_session=target_session)
    t = r["target_ms"][1]
    how = ("the target's GGUF through llama_decode at the target service's threads" if engine == "llamacpp"
           else "torch threads as the services")
    out = {"target_step_ms": t, "target_block_ms": {str(n): r["target_ms"][n] for n in sizes},
           "draft_step_ms": r["draft_step_ms"], "c": None, "reps": reps, "engine": engine,
           "note": f"medians of interleaved in-process forwards ({how}) after prefilling the first prompt; "
                   "c = draft step / target step"}
    out["verify_cost_vs_step"] = {k: v / t for k, v in out["target_block_ms"].items()}
    if r["draft_step_ms"] is not None:
        out["c"] = r["draft_step_ms"] / t
    return out


def verify_forward(target, ids: list[int], n: int, target_session=None):
    """One cached forward of n new tokens on the target after the prompt, cropped back after: a verify's work
    (see bench.hf.step_costs; target_session as there)."""
    from bench.hf import prompt_session

    lm, sess, tok = target_session or prompt_session(target, ids)
    base = len(sess.tokens)

    def forward() -> None:
        lm.extend(sess, [tok] * n)
        lm.crop(sess, base)

    return forward


def bare_grpc_cost(wait_ms: float, reps: int = 20, forward=None) -> dict:
    """Medians of a bare gRPC call in this process (no interceptors, no service code) beyond what its handler
    did: nothing, sleeping wait_ms (a target step), and running `forward()` (a verify's forward of the target
    model, when given). Sleep minus nothing is this host waking threads that waited that long (a client blocked
    on the call, the server's poller); forward minus sleep is the same call's code running from caches the
    model's weights just swept. Every Verify pays both on top of gRPC's own cost: together they are the floor
    of a Python gRPC round trip around a target forward here, whatever the service code does."""
    from concurrent import futures

    import grpc

    work = {"grpc_bare_ms": lambda: None, "grpc_bare_after_wait_ms": lambda: time.sleep(wait_ms / 1e3)}
    if forward is not None:
        work["grpc_bare_after_forward_ms"] = forward

    def handler(request, context):  # the request names the case; the reply is what its work took
        t0 = time.perf_counter()
        work[request.decode()]()
        return repr(time.perf_counter() - t0).encode()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.Wait", {"Wait": grpc.unary_unary_rpc_method_handler(handler)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary("/bench.Wait/Wait")
    out = {}
    try:
        for key in work:
            call(key.encode(), timeout=60)
            extra = []
            for _ in range(reps):
                t0 = time.perf_counter()
                took = float(call(key.encode(), timeout=60))
                extra.append((time.perf_counter() - t0 - took) * 1e3)
            out[key] = statistics.median(extra)
    finally:
        channel.close()
        server.stop(0)
    return out


def measure_overheads(services, ids: list[int], k: int = 4, reps: int = 30, model_reps: int = 6,
                      step_ms: float = 50.0, forward=None) -> dict:
    """Loopback costs around the models, measured against the running services.

    * an empty unary RPC (TargetService.GetInfo) and the orchestrator's per-step Redis commit;
    * Verify (k drafts), Decode (1 token) and Propose (k tokens) called directly: client round trip minus the
      model time the service itself reports = what gRPC, (de)serialisation and the service's own Python cost
      per call."""
    from orchestrator.replicas.clients import DraftClient, TargetClient
    from specdec.core.sampling import SamplingParams

    out: dict = {}
    greedy = SamplingParams()
    sid = "bench-overhead"
    target = TargetClient(services.addresses["target"])
    draft = DraftClient(services.addresses["draft"]) if "draft" in services.addresses else None
    try:
        out["grpc_unary_roundtrip_ms"] = _unary_roundtrip_ms(target, reps)
        ctx, costs = _target_call_costs(target, sid, ids, k, greedy, model_reps)
        out.update(costs)
        if draft is not None:
            out.update(_propose_costs(draft, sid, ctx, k, greedy, model_reps))
        else:  # --draft local:ngram: the orchestrator drafts in process, no Propose round trip
            out.update(draft_propose_rpc_ms=None, draft_propose_service_ms=None, draft_propose_rpc_overhead_ms=None)
    finally:
        target.close()
        if draft is not None:
            draft.close()
    out["redis_commit_ms"] = _redis_commit_ms(services.redis.url, ids, reps)
    out.update(bare_grpc_cost(step_ms, forward=forward))
    out["grpc_wait_ms"] = step_ms
    out["per_step_system_overhead_ms"] = (out["target_verify_rpc_overhead_ms"]
                                          + (out["draft_propose_rpc_overhead_ms"] or 0.0) + out["redis_commit_ms"])
    # --draft local:ngram drafts inside the orchestrator: no Propose round trip
    out["per_step_system_overhead_local_draft_ms"] = out["target_verify_rpc_overhead_ms"] + out["redis_commit_ms"]
    out["note"] = (f"medians; Verify with k={k} drafts and Propose of k={k} tokens ({model_reps} calls each), GetInfo "
                   f"and Redis commit ({reps} each); *_rpc_overhead = client round trip - the model time the service "
                   "reports; per_step_system_overhead = Verify + Propose overheads + one Redis commit (the orchestrator's "
                   "own Python per step is on top); grpc_bare_ms / grpc_bare_after_wait_ms: a bare gRPC call in the "
                   "benchmark process beyond its handler's time, without work and after sleeping grpc_wait_ms (a target "
                   "step): the difference is this host waking threads that waited, part of every call's overhead; "
                   f"grpc_bare_after_forward_ms: the same call around the target's forward of k+1 = {k + 1} tokens "
                   "(the services' KV-cache path): the floor of a gRPC round trip around a verify on this host")
    if draft is None:
        out["note"] += "; no draft process (the orchestrator drafts with --draft local:ngram): no Propose"
    return out


def _unary_roundtrip_ms(target, reps: int) -> float:
    """The median round trip of an empty unary call (GetInfo), after one to connect."""
    target.info(timeout=10)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        target.info(timeout=10)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _target_call_costs(target, sid: str, ids: list[int], k: int, greedy, model_reps: int) -> tuple[list[int], dict]:
    """Verify (k drafts) and Decode (1 token) at a fixed position, and a DecodeStream: each call's round trip, the
    model time the target reports and the difference (medians). Returns the context they ran at too."""
    from orchestrator.replicas.clients import DecodeCall, VerifyCall

    med = statistics.median
    out: dict = {}
    first = target.decode(DecodeCall(sid, list(ids), 0, 1, greedy), 120.0)
    ctx = list(ids) + list(first.tokens)
    drafts = [ctx[-1]] * k
    rt, model = [], []
    for i in range(model_reps):  # Verify at a fixed position: crop to ctx - 1, feed 1 + k tokens
        t0 = time.perf_counter()
        v = target.verify(VerifyCall(sid, ctx, len(ctx) - 1, drafts, [], greedy, 0, i + 1), 120.0)
        rt.append((time.perf_counter() - t0) * 1e3)
        model.append(v.verify_ms)
    out["target_verify_rpc_ms"] = med(rt)
    out["target_verify_service_ms"] = med(model)
    out["target_verify_rpc_overhead_ms"] = med([a - b for a, b in zip(rt, model)])
    rt, model = [], []
    for i in range(model_reps):  # Decode one token at a fixed position
        t0 = time.perf_counter()
        d = target.decode(DecodeCall(sid, ctx, len(ctx) - 1, 1, greedy, 0, 100 + i), 120.0)
        rt.append((time.perf_counter() - t0) * 1e3)
        model.append(d.decode_ms)
    out["target_decode_rpc_ms"] = med(rt)
    out["target_decode_service_ms"] = med(model)
    out["target_decode_rpc_overhead_ms"] = med([a - b for a, b in zip(rt, model)])
    out.update(_stream_costs(target, sid, ctx, greedy))
    target.release(sid)
    return ctx, out


def _redis_commit_ms(redis_url: str, ids: list[int], reps: int) -> float:
    """The median time of the orchestrator's per-step commit of a 3-token block to a session record."""
    from orchestrator.store.session_store import SessionRecord, open_store

    store = open_store(redis_url)
    rec = SessionRecord("bench-overhead", list(ids), {"temperature": 0.0, "max_new_tokens": 96},
                        stats={k: 0 for k in ("verify_steps", "draft_tokens_proposed", "draft_tokens_accepted",
                                              "fallback_steps", "decode_steps", "draft_ms", "verify_ms", "wall_ms")})
    store.create(rec)
    rtimes = []
    for i in range(reps):
        rec.generated.extend([1, 2, 3])
        rec.step = i
        t0 = time.perf_counter()
        store.commit(rec, [1, 2, 3])
        rtimes.append((time.perf_counter() - t0) * 1e3)
    store.delete(rec.session_id)
    return statistics.median(rtimes)


def _stream_costs(target, sid: str, ctx: list[int], greedy, tokens: int = 32, block: int = 4) -> dict:
    """A DecodeStream of `tokens` tokens in blocks of `block` after the context: the wait for its first block, and
    per token after it the client's wall time, the engine's time the blocks report, and the part of the wall time
    that was neither (what the stream costs beyond the engine when the caller keeps up)."""
    from orchestrator.replicas.clients import DecodeCall

    t0 = time.perf_counter()
    stream = target.decode_stream(DecodeCall(sid, ctx, len(ctx) - 1, tokens, greedy, 0, 500, (), block, 1), 120.0)
    first_ms = (time.perf_counter() - t0) * 1e3
    t1, n, engine_ms = time.perf_counter(), 0, 0.0
    while (d := stream.next()) is not None:
        n += len(d.tokens)
        engine_ms += d.decode_ms
    wall_ms = (time.perf_counter() - t1) * 1e3
    per = (lambda v: v / n) if n else (lambda v: None)
    return {"target_stream_first_block_ms": first_ms, "target_stream_ms_per_token": per(wall_ms),
            "target_stream_engine_ms_per_token": per(engine_ms),
            "target_stream_overhead_ms_per_token": per(max(0.0, wall_ms - engine_ms)),
            "target_stream_tokens": n + len(stream.first.tokens), "target_stream_block_tokens": block}


def target_only_breakdown(row: dict, llamacpp_tokens_per_s: float | None,
                          llamacpp_cpu: dict | None = None) -> dict | None:
    """Where each ms of a target-only token through the stack goes (the configuration's own service stats): the
    engine's decode time, the target calls' round trips beyond it, the Redis commit the steps waited for, the rest
    of the orchestrator and the client's stream; next to plain llama.cpp's ms a token on the same cores."""
    st, tokens = row.get("service_stats"), row.get("tokens")
    if not st or not tokens or not row.get("tokens_per_s"):
        return None
    wall = 1e3 / row["tokens_per_s"]
    engine = (st["decode_ms"] + st["prefill_ms"]) / tokens
    rpc, commit = st["rpc_overhead_ms"] / tokens, (st["store_ms"] - st["store_overlapped_ms"]) / tokens
    out = {"client_wall": wall, "target_engine": engine, "target_rpc_beyond_engine": rpc,
           "redis_commit_critical": commit, "orchestrator_and_client_rest": max(0.0, wall - engine - rpc - commit),
           "llamacpp": 1e3 / llamacpp_tokens_per_s if llamacpp_tokens_per_s else None}
    out["vs_llamacpp"] = wall - out["llamacpp"] if out["llamacpp"] else None
    out["cpu_ms_per_token"] = row.get("cpu_ms_per_token")
    out["llamacpp_cpu_ms_per_token"] = (llamacpp_cpu or {}).get("bench clients")
    out["note"] = ("ms per generated token of specdec-target-only (prefill included as the engine's), from the "
                   "orchestrator's stats; target_rpc_beyond_engine = round trips the steps waited for beyond the "
                   "engine's reported time (a decode stream's blocks arrive while the next ones decode); "
                   "vs_llamacpp = client_wall - llamacpp; cpu_ms_per_token = CPU time of each process during "
                   "the target-only samples per generated token (bench clients = this process), against plain "
                   "llama.cpp's in this process (llamacpp_cpu_ms_per_token): what each process takes from the "
                   "cores llama.cpp's threads run on")
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


def _propose_costs(draft, sid: str, ctx: list[int], k: int, greedy, model_reps: int) -> dict:
    """Propose of k tokens at a fixed position: round trip, the service's draft_ms, and their difference."""
    from orchestrator.replicas.clients import ProposeCall

    med = statistics.median
    rt, model = [], []
    draft.propose(ProposeCall(sid, ctx, 0, k, greedy), 120.0)  # the draft prefills the prompt once
    for i in range(model_reps):
        t0 = time.perf_counter()
        r = draft.propose(ProposeCall(sid, ctx, len(ctx) - 1, k, greedy, 0, i + 1), 120.0)
        rt.append((time.perf_counter() - t0) * 1e3)
        model.append(r.draft_ms)
    draft.release(sid)
    return {"draft_propose_rpc_ms": med(rt), "draft_propose_service_ms": med(model),
            "draft_propose_rpc_overhead_ms": med([a - b for a, b in zip(rt, model)])}
