"""In-process services on loopback for tests: real gRPC servers, real Redis, tiny deterministic models."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

from draft_service.proposers.model import ModelProposer
from draft_service.proposers.ngram import NgramProposer
from draft_service.server import build_server as build_draft_server
from orchestrator.settings import LoopConfig, OrchestratorSettings, ServerSettings
from orchestrator.replicas.local_draft import build_local_client, is_local
from orchestrator.api.server import Connections, OrchestratorServicer, build_server as build_orchestrator_server, check_compatible
from orchestrator.replicas.clients import TargetClient
from orchestrator.replicas.draft_pool import DraftPool
from orchestrator.store.session_store import open_store
from specdec.client import SpecdecClient
from specdec.core.kv_cache import SessionCacheStore
from specdec.models import load_model
from specdec.v1 import common_pb2
from target_service.engines.torch import TargetEngine
from target_service.server import build_server as build_target_server

# std=0.3 makes the random models' greedy output varied instead of one repeated token.
TARGET = "tiny:vocab=64,layers=2,hidden=64,seed=0,std=0.3"
DRAFT_SAME = TARGET                                              # identical model: every draft accepted
DRAFT_EARLY = "tiny:vocab=64,layers=1,hidden=64,seed=0,std=0.3"  # the target's first layer: partial acceptance
DRAFT_OTHER = "tiny:vocab=64,layers=1,hidden=32,seed=1,std=0.3"  # unrelated model: mostly rejected

_models: dict = {}


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    """Poll `condition` every 20 ms for up to timeout_s; whether it came true (checked once more at the end)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def model(spec: str):
    if spec not in _models:
        _models[spec] = load_model(spec, device="cpu", dtype="float32")
    return _models[spec]


def model_info(loaded, strategy: str) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(model_name=loaded.name, vocab_size=loaded.vocab_size,
                                tokenizer_fingerprint=loaded.fingerprint, max_context=loaded.max_context,
                                eos_token_ids=loaded.eos_token_ids, strategy=strategy)


@dataclass
class Stack:
    target_server: object
    draft_servers: list
    orchestrator_server: object
    servicer: OrchestratorServicer
    target_engine: TargetEngine
    client: SpecdecClient

    @property
    def draft_server(self):
        return self.draft_servers[0] if self.draft_servers else None

    @property
    def proposer(self):
        return self.draft_server.servicer.proposer if self.draft_servers else None

    def stop(self):
        self.client.close()
        self.servicer.close()
        if self.servicer.pool is not None:
            self.servicer.pool.close()
        for s in (self.orchestrator_server, *self.draft_servers, self.target_server):
            if s is not None:
                s.stop(0)


HYBRID = "hybrid:" + DRAFT_EARLY  # prompt lookup, the early-layer draft where it finds no match
INT8_SELF = "int8:" + TARGET  # the target's own weights in int8 (draft strategy quantized)


def make_proposer(spec: str, sessions: int = 64, vocab_size: int | None = None):
    if spec.startswith("hybrid:"):
        from draft_service.proposers.hybrid import HybridProposer

        model_proposer, info = make_proposer(spec.removeprefix("hybrid:"), sessions, vocab_size)
        info.strategy = "hybrid"
        info.drafts_trees = False
        return HybridProposer(NgramProposer(vocab_size=model_proposer.vocab_size), model_proposer), info
    if spec == "ngram":
        vocab = vocab_size or model(TARGET).vocab_size
        return NgramProposer(vocab_size=vocab), common_pb2.ModelInfo(model_name="ngram", strategy="ngram",
                                                                     drafts_trees=True)
    if spec.startswith("int8:"):
        from draft_service.int8_draft import int8_draft

        loaded = load_model(spec.removeprefix("int8:"), device="cpu", dtype="float32", prepack="off")  # own copy
        store = SessionCacheStore(max_sessions=sessions)
        proposer, info = ModelProposer(loaded, store, int8_draft(loaded, store)), model_info(loaded, "quantized")
        if proposer.kv_dims is not None:  # as draft_service.build.build_proposer: it takes the target's KV
            info.kv_fingerprint = loaded.kv_fingerprint
        info.drafts_trees = proposer.drafts_trees
        return proposer, info
    loaded = model(spec)
    proposer, info = ModelProposer(loaded, SessionCacheStore(max_sessions=sessions)), model_info(loaded, "model")
    info.drafts_trees = proposer.drafts_trees
    return proposer, info


def start_draft(spec: str, address: str = "127.0.0.1:0", sessions: int = 64, inject_latency_ms: float = 0.0,
                proposer=None, vocab_size: int | None = None):
    proposer_, info = make_proposer(spec, sessions, vocab_size)
    return build_draft_server(proposer or proposer_, info, address, inject_latency_ms=inject_latency_ms).start()


def start_stack(redis_url: str, target: str = TARGET, draft: str | list[str] | None = "ngram", draft_len: int = 4,
                target_sessions: int = 64, draft_sessions: int = 64, cfg: LoopConfig | None = None,
                max_new_tokens_limit: int = 512, batch_window_ms: float = 0.0,
                forward_ms: list[float] | str | None = None, target_engine=None, **servicer_kwargs) -> Stack:
    """forward_ms: the target's reported forward-cost profile ("measure": measured like `serve target` does).
    target_engine: a built backend (e.g. the llama.cpp engine) to serve instead of a TargetEngine of `target`."""
    if target_engine is None:
        engine = TargetEngine(model(target), SessionCacheStore(max_sessions=target_sessions),
                              batch_window_ms=batch_window_ms)
    else:
        engine = target_engine
    tl = engine.loaded
    if forward_ms is not None:
        engine.forward_ms = engine.profile_forward_ms(17) if forward_ms == "measure" else list(forward_ms)
    tsrv = build_target_server(engine, "127.0.0.1:0").start()
    specs = [] if draft is None else [draft] if isinstance(draft, str) else list(draft)
    # "local:ngram" drafts inside the orchestrator: no server, the pool builds it.
    dservers = [start_draft(spec, sessions=draft_sessions, vocab_size=tl.vocab_size) for spec in specs
                if not is_local(spec)]
    target_client = TargetClient(tsrv.address)
    target_info = target_client.info()
    pool = None
    if specs:
        remote = iter(d.address for d in dservers)
        pool = DraftPool([spec if is_local(spec) else next(remote) for spec in specs],
                         local_client=lambda a: build_local_client(a, tl.tokenizer, tl.name, tl.vocab_size, "none"))
        for replica in pool.replicas:  # as orchestrator.api.server.connect does
            replica.info = replica.client.info()
            check_compatible(target_info, replica.info)
    # Generous draft deadline: these tests check outputs, and the shared CPU makes timing noisy. A fixed draft
    # length: tests count steps.
    cfg = cfg or LoopConfig(default_draft_len=draft_len, adaptive_draft_len=False, draft_timeout_floor_ms=5000)
    servicer = OrchestratorServicer(orchestrator_settings(cfg, max_new_tokens_limit=max_new_tokens_limit, **servicer_kwargs),
                                    Connections(target_client, pool, open_store(redis_url), tl.tokenizer, target_info))
    osrv = build_orchestrator_server(servicer, "127.0.0.1:0").start()
    return Stack(tsrv, dservers, osrv, servicer, engine, SpecdecClient(osrv.address, timeout_s=120))


def orchestrator_settings(cfg: LoopConfig | None = None, *, auth_tokens=(), admin_tokens=(), max_running: int = 0,
                          adaptive_admission: bool = True, max_active_sessions: int | None = None,
                          **server) -> OrchestratorSettings:
    """An orchestrator's settings as a test names them (ServerSettings fields in `server`)."""
    if max_active_sessions is not None:
        server["max_sessions"] = max_active_sessions
    server = ServerSettings(max_running=str(max_running or "auto"), admission="adaptive" if adaptive_admission
                            else "static", **server)
    return OrchestratorSettings(server, cfg or LoopConfig(), list(auth_tokens), list(admin_tokens))


def loop_state(rec=None, cfg: LoopConfig | None = None, vocab_size: int = 100, pool=None, **measured):
    """A session's loop state (orchestrator/loop/state.py) without services, for unit tests of the loop's parts;
    `measured`: Measurements fields."""
    from orchestrator.loop.state import Backends, LoopState, Measurements, StreamControl
    from orchestrator.store.session_store import SessionRecord

    rec = rec if rec is not None else SessionRecord("s", [1, 2, 3], {})
    rec.params.draft_len_limit = rec.params.draft_len_limit or (cfg or LoopConfig()).max_draft_len  # as admitted
    return LoopState(rec, cfg or LoopConfig(), Backends(None, pool, None, set(), vocab_size), Measurements(**measured),
                     StreamControl())


def count_sessions_at_target(engine, delay_s: float = 0.0, gate: threading.Event | None = None,
                             serial: bool = False) -> list[int]:
    """Wrap the target engine's session calls: the most sessions it worked on at once (the target's view), in a
    one-item list. Each call waits for `gate` (if given) and `delay_s` more. serial: the calls run one at a time,
    as a starved CPU's one llama.cpp compute thread runs them, so a call waits for every other running session's;
    one still waiting when its caller gives up is not computed (as the real target does)."""
    from specdec.core.grpc_util import call_deadline

    inflight, peak, lock, one_at_a_time = Counter(), [0], threading.Lock(), threading.RLock()

    def counting(fn):
        def call(first, *args, **kwargs):
            session_id = getattr(first, "session_id", first)  # prefill(session_id, ...), verify/decode(task)
            with lock:
                inflight[session_id] += 1
                peak[0] = max(peak[0], len(inflight))
            try:
                if gate is not None:
                    gate.wait(30)
                deadline = call_deadline()
                wait = 30.0 if deadline is None else max(0.0, deadline - time.monotonic())
                if serial and not one_at_a_time.acquire(timeout=wait):
                    raise TimeoutError("the target did not get to the call before its deadline")
                try:
                    time.sleep(delay_s)
                    return fn(first, *args, **kwargs)
                finally:
                    if serial:
                        one_at_a_time.release()
            finally:
                with lock:
                    inflight[session_id] -= 1
                    if not inflight[session_id]:
                        del inflight[session_id]
        return call

    for name in ("prefill", "verify", "decode"):
        setattr(engine, name, counting(getattr(engine, name)))
    return peak


def run_sampling(run, n: int, sample, every_s: float = 0.01, timeout_s: float = 60.0) -> None:
    """run(i) for i in range(n), each in its own thread, calling sample() every `every_s` meanwhile (what a
    dashboard sees); every thread has ended when it returns."""
    done = threading.Event()

    def sampling():
        while not done.is_set():
            sample()
            done.wait(every_s)

    sampler = threading.Thread(target=sampling)
    sampler.start()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    done.set()
    sampler.join(5)
    assert not any(t.is_alive() for t in threads), "a generation did not end in time"
