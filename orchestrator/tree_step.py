"""One speculative step in tree mode (LoopConfig.tree_budget > 0, flag --tree-budget).

The draft proposes a token tree (ProposeRequest.tree_budget), the target verifies it in one forward pass
(VerifyRequest.tree) and answers with the accepted path (VerifyResponse.accepted_nodes) plus the next token.
Failure handling is the chain's: a failed or malformed draft reply makes the step decode target-only, a
drafter that cannot build trees (n-gram) answers with a chain, which is verified as a chain.
Pipelining and the adaptive draft length apply to chains only.
"""

from __future__ import annotations

import time

import grpc

from orchestrator import metrics
from orchestrator.generation import GenerationError, _valid_distributions
from specdec import observability as telemetry


def _valid_tree(parents, n: int, max_depth: int) -> bool:
    if len(parents) != n:
        return False
    depth: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            return False
        depth.append(0 if p < 0 else depth[p] + 1)
    return not depth or max(depth) < max_depth


def _propose_tree(gen, replica, max_depth: int):
    """(reply, False); (None, False) if nothing was drafted; (None, True) if the draft failed."""
    rec, cfg = gen.rec, gen.cfg
    chain_len = max(1, min(cfg.tree_budget, cfg.max_draft_len, max_depth))
    tree = dict(tree_budget=cfg.tree_budget, tree_branch=cfg.tree_branch, tree_branch_below=cfg.tree_branch_below,
                tree_max_depth=max_depth)
    t0 = time.perf_counter()
    try:
        with telemetry.call_attributes(session_id=rec.session_id, tree_budget=cfg.tree_budget,
                            replica=replica.address):
            reply = replica.client.propose(rec.session_id, rec.committed, rec.draft_pos, chain_len, gen.params,
                                           gen.seed, rec.step, gen._draft_timeout_s(cfg.tree_budget),
                                           cfg.draft_min_confidence,
                                           tree=tree)
    except grpc.RpcError as e:
        kind = "timeout" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name.lower()
        gen._draft_failed(replica, kind, e.details())
        return None, True
    n = len(reply.tokens)
    shape_ok = (n <= chain_len if reply.tree_parents is None
                else n <= cfg.tree_budget and _valid_tree(reply.tree_parents, n, max_depth))
    if (not shape_ok or any(t >= gen.vocab_size for t in reply.tokens)
            or (not gen.params.is_greedy and len(reply.probs) not in (0, n))
            or not _valid_distributions(reply.probs, gen.vocab_size)):
        gen._draft_failed(replica, "malformed", f"{n} tree tokens, {len(reply.probs)} distributions")
        return None, True
    replica.breaker.success()
    rec.stats["draft_ms"] += reply.draft_ms
    gen._count_overhead(t0, reply.draft_ms)
    if not reply.tokens:
        rec.draft_pos = min(len(rec.committed), reply.cached_len)
        return None, False
    return reply, False


def _verify_tree(gen, reply) -> list[int]:
    rec, stats = gen.rec, gen.rec.stats
    ctx = len(rec.committed)
    n = len(reply.tokens)
    t0 = time.perf_counter()
    with telemetry.call_attributes(session_id=rec.session_id, k=n, tree=True):
        v = gen._target_call(lambda t: gen.target.verify(
            rec.session_id, rec.committed, rec.target_pos, reply.tokens, reply.probs, gen.params, gen.seed,
            rec.step, t, wait_for_ready=True, tree_parents=reply.tree_parents), "verify")
    gen._count_overhead(t0, v.verify_ms)
    path = list(v.accepted_nodes)
    node = -1
    for i in path:  # the accepted nodes must be a root path of the tree we sent
        if not 0 <= i < n or reply.tree_parents[i] != node:
            raise GenerationError(grpc.StatusCode.INTERNAL, f"target accepted an invalid tree path {path}")
        node = i
    if len(path) != v.num_accepted:
        raise GenerationError(grpc.StatusCode.INTERNAL, "target's accepted path and count disagree")
    rec.target_pos = v.cached_len
    rec.draft_pos = min(ctx + len(path), reply.cached_len)  # the draft cropped its cache back to the context
    stats["verify_steps"] += 1
    stats["draft_tokens_proposed"] += n
    stats["draft_tokens_accepted"] += len(path)
    stats["verify_ms"] += v.verify_ms
    if gen.window is not None:
        gen.window.add(n, len(path))
    metrics.record_acceptance(n, len(path))
    gen._observe_target(v.verify_ms)
    return [reply.tokens[i] for i in path] + [v.next_token]


def tree_step(gen, remaining: int) -> tuple[list[int], bool]:
    """Like Generation.step for a tree: (newly committed tokens, whether it ran degraded)."""
    replica = gen._pick_replica()
    if replica is not None:
        reply, failed = _propose_tree(gen, replica, remaining - 1)
        if reply is not None:
            if reply.tree_parents is None:  # a drafter without trees answered with a chain
                return gen._verify(reply), False
            return _verify_tree(gen, reply), False
        if not failed:
            return gen._decode(1, False), False
    return gen._decode(min(gen.cfg.fallback_chunk, remaining), True), True
