"""Token trees for tree speculation (SpecInfer / EAGLE-2 style): structure checks, the tree attention mask,
one forward pass over a tree on top of a session's KV cache, keeping only the accepted path's KV, and the
draft-side tree builder.

A tree of ``n`` nodes is two lists: ``tokens[i]`` and ``parents[i]``, where ``parents[i] == -1`` makes node
``i`` a child of the last committed token (the *root*) and otherwise ``parents[i] < i`` (topological order).
Siblings appear in the order they were drawn; the sampling verifier tests them in that order.

Logit rows follow the chain convention of :mod:`specdec.core.sampling`: row 0 is the model's distribution after
the context (the root's children), row ``i + 1`` the distribution after node ``i`` (node ``i``'s children).

Attention masks are FLOAT additive masks ``[1, 1, n_new, past + n_new]`` (0 = visible, dtype minimum =
hidden) with explicit position ids (context length + depth): transformers' Llama uses such a 4D mask as is
with sdpa attention. (A boolean 4D mask with eager attention silently gives wrong results in transformers
5.x, so never pass booleans.)
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from specdec.core import sampling
from specdec.models.ragged_batch import truncate_cache
from specdec.core.sampling import SamplingParams

__all__ = [
    "check_parents",
    "depths",
    "children",
    "root_paths",
    "ancestor_matrix",
    "float_mask",
    "masked_forward",
    "extend_tree",
    "keep_tree_path",
    "drop_tree_kv",
    "TreeShape",
    "DraftTree",
    "build_tree",
]


# --------------------------------------------------------------------------------------------
# Structure
# --------------------------------------------------------------------------------------------


def check_parents(parents: Sequence[int], n: int | None = None) -> list[int]:
    """Validate a parent list (``-1`` = root, else an earlier node); return it as a list of ints."""
    try:
        out = [operator.index(p) for p in parents]
    except TypeError as e:
        raise ValueError(f"tree parents must be integers: {e}") from None
    if n is not None and len(out) != n:
        raise ValueError(f"tree has {len(out)} parents for {n} tokens")
    for i, p in enumerate(out):
        if not -1 <= p < i:
            raise ValueError(f"tree node {i} has parent {p}; a parent must be -1 (the root) or an earlier node")
    return out


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 0 for the root's children."""
    d: list[int] = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def children(parents: Sequence[int]) -> list[list[int]]:
    """``kids[0]``: the root's children; ``kids[i + 1]``: node i's children; each in node (= draw) order."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        kids[p + 1].append(i)
    return kids


def root_paths(parents: Sequence[int]) -> list[list[int]]:
    """Every root-to-leaf path as a list of node indices."""
    kids = children(parents)
    paths = []
    for leaf in range(len(parents)):
        if not kids[leaf + 1]:
            path, node = [], leaf
            while node >= 0:
                path.append(node)
                node = parents[node]
            paths.append(path[::-1])
    return paths


def ancestor_matrix(parents: Sequence[int]) -> torch.Tensor:
    """Bool ``[n, n]``: ``m[i, j]`` iff node j is node i or one of its ancestors."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] = m[p]
        m[i, i] = True
    return m


# --------------------------------------------------------------------------------------------
# Forward passes with a tree mask
# --------------------------------------------------------------------------------------------


def float_mask(allowed: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """Bool ``[q, kv]`` (True = may attend) -> float additive mask ``[1, 1, q, kv]`` in the model's dtype."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed.to(device), torch.finfo(dtype).min)
    return mask[None, None]


@torch.inference_mode()
def masked_forward(loaded, cache: DynamicCache, tokens: list[int], positions: list[int],
                   allowed: torch.Tensor) -> torch.Tensor:
    """Feed ``tokens`` at ``positions`` on top of ``cache`` (appended to it) where token r may attend to the
    cache entries and new tokens marked in ``allowed[r]`` (bool ``[n_new, past + n_new]``).
    Returns float32 logits ``[n_new, V]``."""
    device = loaded.device
    past = cache.get_seq_length()
    if tuple(allowed.shape) != (len(tokens), past + len(tokens)):
        raise ValueError(f"mask shape {tuple(allowed.shape)} != ({len(tokens)}, {past + len(tokens)})")
    dtype = next(loaded.model.parameters()).dtype
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    pos = torch.tensor([positions], dtype=torch.long, device=device)
    out = loaded.model(input_ids=ids, attention_mask=float_mask(allowed, dtype, device), position_ids=pos,
                       cache=cache, use_cache=True)
    return out.logits[0, :, : loaded.vocab_size].float()


def _tree_allowed(past: int, n_ctx: int, parents: Sequence[int]) -> torch.Tensor:
    """Mask for ``n_ctx`` new context tokens (causal) followed by a tree whose nodes see the whole context,
    their ancestors and themselves."""
    n = len(parents)
    rows = n_ctx + n
    allowed = torch.zeros(rows, past + rows, dtype=torch.bool)
    allowed[:, :past] = True
    allowed[:n_ctx, past : past + n_ctx] = torch.ones(n_ctx, n_ctx, dtype=torch.bool).tril()
    allowed[n_ctx:, past : past + n_ctx] = True
    allowed[n_ctx:, past + n_ctx :] = ancestor_matrix(parents)
    return allowed


@torch.inference_mode()
def extend_tree(lm, sess, new_tokens: list[int], tree_tokens: list[int], parents: Sequence[int]) -> torch.Tensor:
    """ONE forward over the new context tokens (causal) and a token tree (tree mask, positions context + depth).

    Afterwards ``sess.tokens`` holds the context (``+ new_tokens``) and the cache holds the context's KV
    followed by every tree node's: the caller must call :func:`keep_tree_path` or :func:`drop_tree_kv`.
    Returns float32 logits ``[len(new_tokens) + n, V]`` (row ``len(new_tokens) - 1`` is the root's).
    """
    from specdec.core.kv_cache import check_context

    parents = check_parents(parents, len(tree_tokens))
    past = len(sess.tokens)
    ctx = past + len(new_tokens)
    check_context(lm.loaded, ctx + max(depths(parents), default=-1) + 1)
    if sess.cache is None:
        sess.cache = DynamicCache()
    positions = list(range(past, ctx)) + [ctx + d for d in depths(parents)]
    try:
        logits = masked_forward(lm.loaded, sess.cache, list(new_tokens) + list(tree_tokens), positions,
                                _tree_allowed(past, len(new_tokens), parents))
    except BaseException:
        truncate_cache(sess.cache, past)
        raise
    sess.tokens.extend(new_tokens)
    return logits


def drop_tree_kv(sess) -> None:
    """Forget the KV of the tree nodes: the cache matches ``sess.tokens`` again."""
    truncate_cache(sess.cache, len(sess.tokens))


@torch.inference_mode()
def keep_tree_path(sess, path: Sequence[int], tree_tokens: Sequence[int]) -> None:
    """Keep the KV of the accepted path's nodes (moved to just after the context), drop the other nodes'."""
    ctx = len(sess.tokens)
    path = list(path)
    if path and path != list(range(len(path))):  # a prefix of the node order is already in place
        for layer in sess.cache.layers:
            if getattr(layer, "keys", None) is None or not layer.keys.numel():
                continue
            idx = torch.tensor([ctx + i for i in path], dtype=torch.long, device=layer.keys.device)
            layer.keys[..., ctx : ctx + len(path), :] = layer.keys.index_select(-2, idx)
            layer.values[..., ctx : ctx + len(path), :] = layer.values.index_select(-2, idx)
    truncate_cache(sess.cache, ctx + len(path))
    sess.tokens.extend(int(tree_tokens[i]) for i in path)


# --------------------------------------------------------------------------------------------
# Draft side: growing a tree
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeShape:
    """How the draft spends its node budget.

    Depth by depth: every frontier node gets ``branch`` children where the draft is uncertain (its top
    probability < ``branch_below``) and one child where it is confident; frontier nodes are served most
    probable path first (EAGLE-2's observation: the draft's path probability tracks the acceptance
    probability), and the ``width`` most probable new nodes become the next frontier (one draft forward per
    depth). ``max_depth`` 0 means only the budget limits depth.
    """

    budget: int
    branch: int = 2
    branch_below: float = 0.75
    width: int = 0  # 0: same as branch
    max_depth: int = 0

    def validate(self) -> None:
        if self.budget < 1 or self.branch < 1 or self.width < 0 or self.max_depth < 0:
            raise ValueError(f"bad tree shape {self}")
        if not (math.isfinite(self.branch_below) and 0.0 <= self.branch_below <= 1.0):
            raise ValueError(f"tree branch_below must be in [0, 1], got {self.branch_below}")


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]
    probs_fp16: torch.Tensor | None  # [n, V]: the distribution each node was drawn from (sampling), else None
    forwards: int = 0  # draft forward passes spent on the tree (excluding the context)


def build_tree(root_logits: torch.Tensor, expand: Callable[[list[int], "DraftTree"], torch.Tensor],
               shape: TreeShape, params: SamplingParams, generator: torch.Generator | None,
               round_fn=None) -> DraftTree:
    """Grow a token tree from the draft's root logits.

    ``expand(nodes, tree)`` returns the draft's logits ``[len(nodes), V]`` after each of ``nodes`` (one
    batched forward). Greedy: children are the draft's top tokens. Sampling: children are drawn WITHOUT
    replacement (:func:`specdec.core.sampling.sample_siblings`), and ``probs_fp16[i]`` is the distribution node
    i was drawn from given its earlier siblings, which is what the verifier needs. How many children a node
    gets depends only on what was drawn before its children (never on the children themselves), which the
    multi-branch rejection sampler's correctness requires.
    """
    shape.validate()
    width = shape.width or shape.branch
    max_depth = shape.max_depth or shape.budget
    tree = DraftTree([], [], None)
    rows: list[torch.Tensor] = []
    logp: list[float] = []
    frontier = [(-1, root_logits, 0.0)]
    depth = 0
    while frontier and len(tree.tokens) < shape.budget and depth < max_depth:
        new: list[int] = []
        for node, logits, lp in sorted(frontier, key=lambda f: -f[2]):
            room = shape.budget - len(tree.tokens)
            if room <= 0:
                break
            if params.is_greedy:
                conf_probs = torch.softmax(logits.float(), -1)
                top = float(conf_probs.max())
                m = min(room, 1 if top >= shape.branch_below else shape.branch)
                vals, idx = torch.topk(conf_probs, m)
                drawn = [(int(t), float(v), None) for t, v in zip(idx.tolist(), vals.tolist())]
            else:
                q = sampling.warp_probs(logits, params)
                top = float(q.max())
                m = min(room, 1 if top >= shape.branch_below else shape.branch)
                drawn = sampling.sample_siblings(q, m, generator, round_fn)
            for tok, q_tok, payload in drawn:
                tree.tokens.append(tok)
                tree.parents.append(node)
                if payload is not None:
                    rows.append(payload)
                logp.append(lp + math.log(max(q_tok, 1e-30)))
                new.append(len(tree.tokens) - 1)
        depth += 1
        if len(tree.tokens) >= shape.budget or depth >= max_depth or not new:
            break
        chosen = sorted(new, key=lambda i: -logp[i])[:width]
        chosen.sort()
        out = expand(chosen, tree)
        tree.forwards += 1
        frontier = [(i, out[r], logp[i]) for r, i in enumerate(chosen)]
    tree.probs_fp16 = torch.stack(rows) if rows else None
    return tree
