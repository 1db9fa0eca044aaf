"""Tree speculation (LoopConfig.tree_budget > 0, flag --tree-budget): the step's strategy in place of the chain.

The draft proposes a token tree (ProposeRequest.tree_budget), the target verifies it in one forward pass
(VerifyRequest.tree) and answers with the accepted path (VerifyResponse.accepted_nodes) plus the next token.
Failure handling is the chain's: a failed or malformed draft reply makes the step decode target-only; a drafter
that cannot build trees (n-gram) answers with a chain, which is verified as a chain. Pipelining and the adaptive
draft length apply to chains only.
"""

from __future__ import annotations

import grpc

from orchestrator.loop.accounting import record_verify
from orchestrator.loop.state import GenerationError, LoopState


class TreeStrategy:
    def __init__(self, state: LoopState, step):  # step: the Step that owns this strategy (loop/step.py)
        self.state, self.step = state, step

    def run(self, replica, k: int, remaining: int) -> tuple[list[int] | None, bool]:
        """Like Step.chain for a tree (k is not used: the tree budget sets its size)."""
        cfg, max_depth = self.state.cfg, remaining - 1
        tree = dict(tree_budget=cfg.tree_budget, tree_branch=cfg.tree_branch,
                    tree_branch_below=cfg.tree_branch_below, tree_max_depth=max_depth)
        chain_len = max(1, min(cfg.tree_budget, self.state.max_draft_len, max_depth))
        reply, failed = self.step.draft.propose_tree(replica, tree, chain_len, max_depth)
        if reply is None:
            return None, failed
        v = self.step.target.verify(reply)
        if reply.tree_parents is None:  # a drafter without trees answered with a chain
            return self.step.accept(reply, v), False
        return self.accept(reply, v), False

    def accept(self, reply, v) -> list[int]:
        """The accepted root path of the tree: count it, move the draft's position; the committed tokens."""
        rec, n = self.state.rec, len(reply.tokens)
        path = list(v.accepted_nodes)
        node = -1
        for i in path:  # the accepted nodes must be a root path of the tree we sent
            if not 0 <= i < n or reply.tree_parents[i] != node:
                raise GenerationError(grpc.StatusCode.INTERNAL, f"target accepted an invalid tree path {path}")
            node = i
        if len(path) != v.num_accepted:
            raise GenerationError(grpc.StatusCode.INTERNAL, "target's accepted path and count disagree")
        ctx = len(rec.committed)
        rec.target_pos = v.cached_len
        rec.draft_pos = min(ctx + len(path), reply.cached_len)  # the draft cropped its cache back to the context
        record_verify(self.state, self.step.draft_len, n, len(path), v.verify_ms)
        return [reply.tokens[i] for i in path] + [v.next_token]
