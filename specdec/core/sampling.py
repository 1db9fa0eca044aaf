"""Speculative-sampling maths shared by the draft service, the target service and the orchestrator.

Everything that decides *which token comes next* lives here, so that every service warps logits
the same way and so that the correctness argument (the output distribution equals the target's,
Leviathan et al. 2023 / Chen et al. 2023) only has to be checked in one place.

Conventions
-----------
* ``k`` draft tokens ``x_0..x_{k-1}`` are verified against ``k + 1`` target rows: row ``i`` is the
  target's distribution for the position of ``x_i``; row ``k`` is for the bonus token that follows
  when every draft token is accepted.
* Probabilities are float32 and already "warped" (temperature / top-k / top-p applied).
* Randomness comes only from an explicit ``torch.Generator`` (CPU), so a session resumed after a
  restart, with a generator rebuilt by :func:`make_generator`, draws the same numbers.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import operator
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "SamplingParams",
    "VerifyResult",
    "warp_probs",
    "make_generator",
    "sample",
    "verify_greedy",
    "verify_rejection",
    "verify",
    "TreeVerifyResult",
    "sample_siblings",
    "verify_tree_greedy",
    "verify_tree_rejection",
    "verify_tree",
    "speculative_speedup",
    "expected_accepted_length",
]


# --------------------------------------------------------------------------------------------
# Parameters and results
# --------------------------------------------------------------------------------------------


def _is_real(x) -> bool:
    # bool is an int subclass, but `temperature=True` is almost certainly a bug.
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 -> greedy
    top_k: int = 0  # 0 -> disabled
    top_p: float = 1.0  # 1 -> disabled

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 means greedy decoding), got {t!r}"
            )
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(
                f"top_k must be a whole number >= 0 (0 disables top-k), got {self.top_k!r}"
            )
        p = self.top_p
        if not _is_real(p) or math.isnan(p) or not (0.0 < p <= 1.0):
            raise ValueError(
                f"top_p must be a number in (0, 1] (1 disables nucleus sampling), got {p!r}"
            )


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int  # how many draft tokens were accepted (0..k)
    next_token: int  # correction token (on rejection) or bonus token (all accepted)


# --------------------------------------------------------------------------------------------
# Logit warping
# --------------------------------------------------------------------------------------------


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits ``[..., V]`` (any float dtype) -> float32 probabilities ``[..., V]``.

    Greedy gives a one-hot at ``torch.argmax`` (first maximum wins). Otherwise: divide by the
    temperature, keep the top-k logits (ties with the k-th value are all kept, so the result does
    not depend on how ``topk`` orders equal values), then keep the smallest prefix of tokens ranked
    by logit (stable sort: lower token id first on ties, like argmax) whose cumulative probability
    reaches ``top_p``, always at least one token; finally softmax. Only tensor ops, batched over leading
    dims, no randomness: draft and target get the same answer from the same logits.
    """
    params.validate()
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")
    x = logits.float()
    if params.is_greedy:
        idx = greedy_tokens(x).unsqueeze(-1)
        return torch.zeros_like(x).scatter_(-1, idx, 1.0)

    # Top-k is chosen on the raw logits (dividing by T > 0 keeps their order) so that rounding in
    # the scaling below cannot turn near-ties into ties.
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))

    raw = x
    # Subtracting the max before dividing keeps tiny temperatures from overflowing to inf/NaN.
    x = (x - x.amax(dim=-1, keepdim=True)) / params.temperature

    if params.top_p < 1.0:
        probs = torch.softmax(x, dim=-1)
        # Rank by the raw logits, not the probabilities: rounding in the scaling and in exp() can
        # make distinct logits equal, and the argmax token (first max) must always rank first.
        order = torch.sort(raw, dim=-1, descending=True, stable=True).indices
        sorted_probs = probs.gather(-1, order)
        # Mass strictly before each sorted token; a token is kept while that mass is < top_p,
        # which is exactly "the smallest prefix whose cumulative prob >= top_p". The first token
        # always has 0 mass before it, so at least one token survives.
        before = torch.nn.functional.pad(torch.cumsum(sorted_probs, dim=-1)[..., :-1], (1, 0))
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))

    return torch.softmax(x, dim=-1)


# --------------------------------------------------------------------------------------------
# Randomness
# --------------------------------------------------------------------------------------------


def make_generator(seed: int, *stream) -> torch.Generator:
    """CPU generator seeded from ``blake2b(repr((seed, *stream)))`` truncated to 63 bits.

    Hashing (rather than e.g. ``seed + step``) makes ``(seed, step, "target")`` and
    ``(seed, step, "draft")`` unrelated streams, and ``repr`` of ints/strings is stable across
    processes (unlike ``hash()``), so a restarted service rebuilds the same stream.
    """
    digest = hashlib.blake2b(repr((seed, *stream)).encode("utf-8"), digest_size=8).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(digest, "big") & ((1 << 63) - 1))
    return g


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``[V]`` -> 0-d long tensor, ``[N, V]`` -> ``[N]`` long, on ``probs``' device.

    The draw happens on the generator's device (CPU for :func:`make_generator`), so the random
    numbers do not depend on where the model ran.
    """
    if probs.dim() not in (1, 2):
        raise ValueError(f"sample expects probs of shape [V] or [N, V], got {tuple(probs.shape)}")
    src = probs.to(generator.device)
    if src.dtype not in (torch.float32, torch.float64):
        src = src.float()  # multinomial is not implemented for every half type on every device
    out = torch.multinomial(src, 1, generator=generator).squeeze(-1)
    return out.to(probs.device)


# --------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------


def _token_list(draft_tokens, vocab: int) -> list[int]:
    if isinstance(draft_tokens, torch.Tensor):
        if draft_tokens.dim() != 1:
            raise ValueError(f"draft_tokens must be 1-D, got shape {tuple(draft_tokens.shape)}")
        dt = draft_tokens.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise ValueError(f"draft_tokens must be integers, got dtype {draft_tokens.dtype}")
        tokens = [int(t) for t in draft_tokens.tolist()]
    else:
        try:
            tokens = [operator.index(t) for t in draft_tokens]
        except TypeError as e:
            raise ValueError(f"draft_tokens must be integers: {e}") from None
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"draft token(s) {bad} outside the vocabulary [0, {vocab})")
    return tokens


def _check_rows(name: str, t: torch.Tensor, rows: int) -> None:
    if t.ndim != 2 or t.shape[0] != rows:
        raise ValueError(f"{name} must have shape [{rows}, V], got {tuple(t.shape)}")


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension (the first maximum on ties, as torch.argmax). ``max(...).indices``: on
    CPU over a 49152-token vocabulary it takes a third of torch.argmax's time (0.11 vs 0.35 ms for 5 rows here),
    which every verify and every drafted token pays. A numpy array (an engine's logits buffer, e.g. llama.cpp's)
    gets numpy's argmax, which also takes the first maximum: no conversion to torch."""
    if not isinstance(logits, torch.Tensor):
        return logits.argmax(axis=-1)
    return logits.max(dim=-1).indices


def verify_greedy(
    target_logits: torch.Tensor, draft_tokens: Sequence[int] | torch.Tensor
) -> VerifyResult:
    """Accept draft tokens while they equal the target's argmax; the first mismatching row's
    argmax (or row k's, if all match) is the next token. target_logits: a tensor or a numpy array."""
    if target_logits.ndim != 2 or target_logits.shape[0] < 1:
        raise ValueError(
            f"target_logits must have shape [k+1, V], got {tuple(target_logits.shape)}"
        )
    tokens = _token_list(draft_tokens, target_logits.shape[-1])
    _check_rows("target_logits", target_logits, len(tokens) + 1)
    best = greedy_tokens(target_logits).tolist()  # one device->host copy
    for i, tok in enumerate(tokens):
        if best[i] != tok:
            return VerifyResult(num_accepted=i, next_token=best[i])
    return VerifyResult(num_accepted=len(tokens), next_token=best[len(tokens)])


def verify_rejection(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: Sequence[int] | torch.Tensor,
    generator: torch.Generator,
) -> VerifyResult:
    """Speculative (rejection) sampling: the committed tokens are distributed exactly as if
    sampled from ``target_probs`` one at a time.

    ``draft_probs=None`` means a deterministic drafter (q is one-hot at the drafted token), which
    turns the test into "accept x with probability p(x)".

    Random numbers are drawn in a fixed order that does not depend on the outcome: first ``k``
    uniforms (float64) in one call, then exactly one categorical draw (correction or bonus).
    """
    if target_probs.dim() != 2 or target_probs.shape[0] < 1:
        raise ValueError(
            f"target_probs must have shape [k+1, V], got {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[-1]
    tokens = _token_list(draft_tokens, vocab)
    k = len(tokens)
    _check_rows("target_probs", target_probs, k + 1)
    if not bool(torch.isfinite(target_probs).all()):
        raise ValueError("target_probs contains NaN or inf")
    if draft_probs is not None:
        if draft_probs.dim() != 2 or tuple(draft_probs.shape) != (k, vocab):
            raise ValueError(
                f"draft_probs must have shape [k={k}, V={vocab}], got {tuple(draft_probs.shape)}"
            )
        if k and not bool(torch.isfinite(draft_probs).all()):
            raise ValueError("draft_probs contains NaN or inf")
        if k and bool((draft_probs < 0).any()):
            raise ValueError("draft_probs contains negative values")

    if k == 0:
        return VerifyResult(0, int(sample(target_probs[0], generator)))

    # Gather p_i(x_i) and q_i(x_i) with one small copy each, then decide in float64 on the host.
    rows = torch.arange(k, device=target_probs.device)
    cols = torch.tensor(tokens, device=target_probs.device)
    p_x = target_probs[rows, cols].double().tolist()
    if draft_probs is None:
        q_x = [1.0] * k
    else:
        q_x = draft_probs[rows.to(draft_probs.device), cols.to(draft_probs.device)].double().tolist()
    u = torch.rand(k, generator=generator, dtype=torch.float64, device=generator.device).tolist()

    for i in range(k):
        # u * q <= p  <=>  u <= min(1, p/q), without dividing. q == 0 means the drafter could not
        # have produced x_i (inconsistent input), so never accept it; fall through to the residual.
        if q_x[i] > 0.0 and u[i] * q_x[i] <= p_x[i]:
            continue
        p_row = target_probs[i].float()
        if draft_probs is None:
            residual = p_row.clone()
            residual[tokens[i]] = 0.0
        else:
            residual = (p_row - draft_probs[i].to(p_row.device).float()).clamp_min_(0.0)
        # All-zero residual only happens when p == q numerically; then p itself is the answer.
        if not float(residual.sum()) > 0.0:
            residual = p_row
        return VerifyResult(num_accepted=i, next_token=int(sample(residual, generator)))

    return VerifyResult(num_accepted=k, next_token=int(sample(target_probs[k], generator)))


def verify(
    target_logits: torch.Tensor,
    draft_tokens: Sequence[int] | torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Greedy params -> :func:`verify_greedy` (draft_probs and generator are ignored); otherwise
    warp the target logits with the same params the drafter used and :func:`verify_rejection`."""
    params.validate()
    if params.is_greedy:
        return verify_greedy(target_logits, draft_tokens)
    if generator is None:
        raise ValueError("a generator is required for non-greedy verification (temperature > 0)")
    return verify_rejection(warp_probs(target_logits, params), draft_probs, draft_tokens, generator)


# --------------------------------------------------------------------------------------------
# Tree verification: SpecInfer's multi-step speculative sampling (recursive rejection sampling)
# --------------------------------------------------------------------------------------------
#
# A tree of n nodes: tree_tokens[i], parents[i] (-1 = a child of the root, i.e. of the last committed
# token; otherwise an earlier node). Target rows: row 0 is the target's distribution after the context,
# row i + 1 the distribution after node i (so a chain [-1, 0, 1, ...] has exactly the chain's rows).
# Siblings are listed in the order they were drawn, and draft_probs[i] is the distribution node i was
# drawn from GIVEN its earlier siblings: the same q for all siblings drawn i.i.d. from q, or q with the
# earlier siblings zeroed and renormalised when they were drawn without replacement.
#
# Correctness, at one node with target distribution p_1 = p and siblings x_1..x_m, x_j ~ q_j given
# x_1..x_{j-1}: stage j accepts x_j with probability min(1, p_j(x_j) / q_j(x_j)), else moves on with the
# residual p_{j+1} = norm(max(0, p_j - q_j)); after the last stage the token is drawn from p_{m+1}. By
# induction from the last stage, what stage j emits is distributed as p_j: it emits x with probability
# min(q_j, p_j)(x) + beta_j * p_{j+1}(x) = min(q_j, p_j)(x) + max(0, p_j - q_j)(x) = p_j(x), where
# beta_j = sum(max(0, p_j - q_j)) is its rejection probability. So the node emits a token ~ p. An accepted
# sibling continues the walk in its own subtree, whose draws are independent of how it was accepted;
# a leaf (or a node whose children are all rejected) ends the step with a token drawn from the target
# (resp. the final residual). The argument needs only that how MANY children a node has does not depend on
# the children's values (it may depend on anything drawn before them).


@dataclass(frozen=True)
class TreeVerifyResult:
    path: tuple[int, ...]  # accepted node indices, root to deepest
    next_token: int  # correction (all children of the last node rejected) or bonus (the last node is a leaf)

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def _tree_children(parents, n: int) -> list[list[int]]:
    try:
        parents = [operator.index(p) for p in parents]
    except TypeError as e:
        raise ValueError(f"tree parents must be integers: {e}") from None
    if len(parents) != n:
        raise ValueError(f"tree has {len(parents)} parents for {n} tokens")
    kids: list[list[int]] = [[] for _ in range(n + 1)]
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree node {i} has parent {p}; a parent must be -1 (the root) or an earlier node")
        kids[p + 1].append(i)
    return kids


def sample_siblings(q: torch.Tensor, m: int, generator: torch.Generator, round_fn=None,
                    replace: bool = False) -> list[tuple[int, float, object]]:
    """Draw up to ``m`` siblings from the ``[V]`` distribution ``q``: ``[(token, q(token), payload)]``.

    Without replacement (default): sibling j is drawn from q with siblings 1..j-1 zeroed and renormalised,
    at most as many as q has nonzero entries. ``replace=True``: i.i.d. draws from q. ``round_fn(dist)``
    returns ``(payload, exact)``: what goes on the wire and the distribution it encodes (e.g.
    :func:`specdec.core.wire.to_fp16_distribution`); each sibling is drawn from ``exact``, so the verifier sees
    exactly the distribution that was used. Without ``round_fn`` the payload is the float32 distribution.
    """
    rf = round_fn or (lambda d: (d, d))
    payload, cur = rf(q.detach().float().cpu())
    base = cur
    count = m if replace else min(m, int((cur > 0).sum()))
    out: list[tuple[int, float, object]] = []
    for j in range(count):
        if j > 0 and not replace:
            nxt = cur.clone()
            nxt[out[-1][0]] = 0.0
            payload, cur = rf(nxt / nxt.sum())
        x = int(sample(cur, generator))
        out.append((x, float(base[x]), payload))
    return out


def verify_tree_greedy(target_logits: torch.Tensor, tree_tokens, parents) -> TreeVerifyResult:
    """Walk down from the root, each time into the first child whose token is the target's argmax; the
    argmax after the last accepted node is the next token (token-identical to target-only greedy decoding)."""
    if target_logits.dim() != 2 or target_logits.shape[0] < 1:
        raise ValueError(f"target_logits must have shape [n+1, V], got {tuple(target_logits.shape)}")
    tokens = _token_list(tree_tokens, target_logits.shape[-1])
    kids = _tree_children(parents, len(tokens))
    _check_rows("target_logits", target_logits, len(tokens) + 1)
    best = greedy_tokens(target_logits).tolist()
    path: list[int] = []
    node = -1
    while True:
        want = best[node + 1]
        nxt = next((c for c in kids[node + 1] if tokens[c] == want), None)
        if nxt is None:
            return TreeVerifyResult(tuple(path), want)
        path.append(nxt)
        node = nxt


def verify_tree_rejection(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    tree_tokens,
    parents,
    generator: torch.Generator,
) -> TreeVerifyResult:
    """Multi-branch rejection sampling over a token tree (see the comment above): the committed tokens are
    distributed exactly as if sampled from ``target_probs`` one at a time.

    ``draft_probs=None``: deterministic siblings (each q_j one-hot at its token), i.e. accept x_j with
    probability p_j(x_j) and drop x_j from the residual. Random numbers: first ``n`` float64 uniforms in one
    call (node i's test uses the i-th), then exactly one categorical draw.
    """
    if target_probs.dim() != 2 or target_probs.shape[0] < 1:
        raise ValueError(f"target_probs must have shape [n+1, V], got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[-1]
    tokens = _token_list(tree_tokens, vocab)
    n = len(tokens)
    kids = _tree_children(parents, n)
    _check_rows("target_probs", target_probs, n + 1)
    if not bool(torch.isfinite(target_probs).all()):
        raise ValueError("target_probs contains NaN or inf")
    if draft_probs is not None:
        if draft_probs.dim() != 2 or tuple(draft_probs.shape) != (n, vocab):
            raise ValueError(f"draft_probs must have shape [n={n}, V={vocab}], got {tuple(draft_probs.shape)}")
        if n and not bool(torch.isfinite(draft_probs).all()):
            raise ValueError("draft_probs contains NaN or inf")
        if n and bool((draft_probs < 0).any()):
            raise ValueError("draft_probs contains negative values")
    if n == 0:
        return TreeVerifyResult((), int(sample(target_probs[0], generator)))

    u = torch.rand(n, generator=generator, dtype=torch.float64, device=generator.device).tolist()
    path: list[int] = []
    node = -1
    while True:
        siblings = kids[node + 1]
        if not siblings:  # a leaf: bonus token from the target
            return TreeVerifyResult(tuple(path), int(sample(target_probs[node + 1], generator)))
        p = target_probs[node + 1].to("cpu", torch.float64)  # p_1; becomes the residual p_j
        accepted = None
        for c in siblings:
            x = tokens[c]
            q = None if draft_probs is None else draft_probs[c].to("cpu", torch.float64)
            q_x = 1.0 if q is None else float(q[x])
            # u * q <= p  <=>  u <= min(1, p/q); q(x) == 0 (the drafter could not have drawn x) never accepts.
            if q_x > 0.0 and u[c] * q_x <= float(p[x]):
                accepted = c
                break
            if q is None:
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = (p - q).clamp_min_(0.0)
            total = float(residual.sum())
            # All-zero only when p_j == q_j numerically (then rejecting had probability 0): keep p_j.
            if total > 0.0:
                p = residual / total
        if accepted is None:  # every sibling rejected: the correction comes from the final residual
            return TreeVerifyResult(tuple(path), int(sample(p, generator)))
        path.append(accepted)
        node = accepted


def verify_tree(
    target_logits: torch.Tensor,
    tree_tokens,
    parents,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> TreeVerifyResult:
    """Greedy params -> :func:`verify_tree_greedy`; otherwise warp the target logits with the drafter's params
    and :func:`verify_tree_rejection`."""
    params.validate()
    if params.is_greedy:
        return verify_tree_greedy(target_logits, tree_tokens, parents)
    if generator is None:
        raise ValueError("a generator is required for non-greedy verification (temperature > 0)")
    return verify_tree_rejection(warp_probs(target_logits, params), draft_probs, tree_tokens, parents, generator)


# --------------------------------------------------------------------------------------------
# Analytical performance model (Leviathan et al. 2023, section 3)
# --------------------------------------------------------------------------------------------


def _check_model_args(acceptance_rate: float, draft_len: int) -> None:
    if not _is_real(acceptance_rate) or not 0.0 <= acceptance_rate <= 1.0:
        raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate!r}")
    if isinstance(draft_len, bool) or not isinstance(draft_len, numbers.Integral) or draft_len < 0:
        raise ValueError(f"draft_len must be a whole number >= 0, got {draft_len!r}")


def expected_accepted_length(acceptance_rate: float, draft_len: int) -> float:
    """Expected tokens committed per verification step: (1 - a^(g+1)) / (1 - a); g+1 at a == 1."""
    _check_model_args(acceptance_rate, draft_len)
    # Summing the geometric series is the same formula, exact at a == 1 and stable near it.
    return math.fsum(acceptance_rate**i for i in range(draft_len + 1))


def speculative_speedup(acceptance_rate: float, draft_len: int, cost_ratio: float) -> float:
    """Expected walltime improvement factor (1 - a^(g+1)) / ((1 - a)(g c + 1)), where c is the
    cost of one draft step relative to one target step."""
    if not _is_real(cost_ratio) or not math.isfinite(cost_ratio) or cost_ratio < 0:
        raise ValueError(f"cost_ratio must be a finite number >= 0, got {cost_ratio!r}")
    return expected_accepted_length(acceptance_rate, draft_len) / (draft_len * cost_ratio + 1.0)
