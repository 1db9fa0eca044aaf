"""The one check of a draft's reply (chain, prefetched block or tree): a draft is never trusted blindly. A reply that
fails it counts as a failed draft; the step decodes target-only."""

from __future__ import annotations

import math

from specdec.core import wire


def tree_problem(parents: list[int], n: int, max_depth: int) -> str | None:
    """Why `parents` is not a token tree of `n` nodes at most `max_depth` deep (parents[i] < i), or None."""
    if len(parents) != n:
        return f"{len(parents)} parents for {n} tree nodes"
    depth: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            return f"node {i} has parent {p}"
        depth.append(0 if p < 0 else depth[p] + 1)
    if depth and max(depth) >= max_depth:
        return f"tree {max(depth) + 1} deep, longer than the {max_depth} tokens left"
    return None


def draft_reply_problem(tokens, probs, scores, *, vocab_size: int, greedy: bool, max_tokens: int,
                        tree_parents: list[int] | None = None, max_depth: int = 0) -> str | None:
    """Why a draft's reply cannot be verified, or None if it can: more tokens than asked for (`max_tokens`), a token
    outside the vocabulary, a distribution per token missing when sampling (none at all is allowed: the target then
    treats the drafts as one-hot), a malformed distribution (the target's own check, wire.decode_distribution),
    scores that are not one finite number per token, or (`tree_parents`) not a tree of at most `max_depth` levels."""
    n = len(tokens)
    if n > max_tokens:
        return f"{n} tokens, {max_tokens} asked for"
    if tree_parents is not None:
        problem = tree_problem(tree_parents, n, max_depth)
        if problem:
            return problem
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        return f"token id {bad[0]} outside the vocabulary of {vocab_size}"
    if not greedy and len(probs) not in (0, n):
        return f"{n} tokens, {len(probs)} distributions"
    if len(scores) not in (0, n) or not all(map(math.isfinite, scores)):
        return f"{n} tokens, {len(scores)} scores (each a finite number)"
    try:
        for m in probs:
            wire.decode_distribution(m, vocab_size)
    except ValueError as e:
        return f"malformed distribution: {e}"
    return None
