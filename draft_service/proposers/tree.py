"""Tree drafting with a model proposer's KV cache: one batched draft forward (tree attention mask) per depth.

The context is fed into the session's cache as for a chain; the tree nodes' KV is appended while the tree
grows and dropped again before returning, so the cache holds exactly the context afterwards
(``cached_len`` = context length): the next request's delta re-feeds whatever the target accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core import sampling
from specdec.core import tree
from specdec.core import wire
from specdec.core.sampling import SamplingParams


@dataclass
class TreeProposal:
    tokens: list[int]
    parents: list[int]
    probs_fp16: torch.Tensor | None  # [n, V]: the distribution node i was drawn from (sampling), else None
    cached_len: int
    forwards: int = 0  # draft forward passes over tree nodes


def propose_tree(proposer, session_id: str, prefix_len: int, delta: list[int], shape: tree.TreeShape,
                 params: SamplingParams, seed: int, step: int) -> TreeProposal:
    """Sync the session (like ``get_candidates``) and grow a token tree of at most ``shape.budget`` nodes."""
    lm = proposer.lm
    sess = proposer.store.get(session_id)
    with sess.lock:
        new = lm.sync(sess, prefix_len, delta)
        root = lm.extend(sess, new, keep=1)[-1]
        ctx = len(sess.tokens)
        if ctx + 1 >= lm.loaded.max_context:  # no room for even one drafted position
            return TreeProposal([], [], None, ctx)
        shape = tree.TreeShape(shape.budget, shape.branch, shape.branch_below, shape.width,
                               min(shape.max_depth or shape.budget, lm.loaded.max_context - ctx - 1))
        gen = None if params.is_greedy else sampling.make_generator(seed, step, "draft")
        slot: dict[int, int] = {}  # tree node -> its index in the cache
        node_depth: list[int] = []

        def expand(nodes: list[int], t: tree.DraftTree) -> torch.Tensor:
            node_depth.extend(tree.depths(t.parents)[len(node_depth):])
            past = sess.cache.get_seq_length()
            allowed = torch.zeros(len(nodes), past + len(nodes), dtype=torch.bool)
            allowed[:, :ctx] = True
            for r, node in enumerate(nodes):
                a = t.parents[node]
                while a >= 0:
                    allowed[r, slot[a]] = True  # every ancestor was expanded, so its KV is cached
                    a = t.parents[a]
                allowed[r, past + r] = True
            for r, node in enumerate(nodes):
                slot[node] = past + r
            return tree.masked_forward(lm.loaded, sess.cache, [t.tokens[i] for i in nodes],
                                       [ctx + node_depth[i] for i in nodes], allowed)

        try:
            # Sampling: draw from the float16-rounded q that goes on the wire, so the verifier sees the same q.
            t = tree.build_tree(root, expand, shape, params, gen, round_fn=wire.to_fp16_distribution)
        finally:
            tree.drop_tree_kv(sess)  # back to exactly the context
            proposer.store.update_size(sess)
        return TreeProposal(t.tokens, t.parents, t.probs_fp16, len(sess.tokens), t.forwards)
