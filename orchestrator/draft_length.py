"""How many tokens to draft per step, per session.

- `DraftLength`: fixed, or transformers' heuristic schedule for assisted generation (+2 after a fully accepted
  block, -1 after a rejection).
- `GoodputDraftLength` (the default adaptive policy): picks k to maximise expected tokens per millisecond, with
  the paper's expected accepted length (Leviathan et al. 2023) over what a step really costs here: the target's
  measured forward cost for k + 1 tokens (reported by the target service, scaled by the load it sees), the
  draft's measured cost per token and per call, and the fixed RPC costs. k = 0, target-only, when no k pays;
  speculation is then probed again every few steps so the session can return to it.
"""

from __future__ import annotations

import threading

from specdec.sampling import expected_accepted_length


class DraftLength:
    """Fixed, or the heuristic transformers uses for assisted generation: +2 after a fully accepted block,
    -1 after a rejection."""

    def __init__(self, start: int, max_len: int, adaptive: bool):
        self.k = max(1, min(start, max_len))
        self.max_len = max_len
        self.adaptive = adaptive

    def update(self, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        self.k = min(self.max_len, self.k + 2) if accepted == proposed else max(1, self.k - 1)

    def observe_draft(self, wall_ms: float, draft_ms: float, tokens: int) -> None:
        """Heuristic and fixed lengths ignore costs."""

    def step_taken(self) -> None:
        """Heuristic and fixed lengths never pause."""


class Ema:
    """Exponential moving average; nothing until the first observation."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.value: float | None = None

    def observe(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.weight) * self.value + self.weight * x

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


class TargetCost:
    """The target's cost of one step, shared by an orchestrator's sessions: its start-up forward profile
    (forward_ms[i] = a forward over i + 1 tokens) times an EMA of observed / profiled (load and drift scale every
    size alike), plus the RPC overhead around a target call.

    A batching target verifies the blocks of concurrent sessions in one forward, whose cost grows with the
    tokens of all its rows: with n sessions generating (at most max_batch), a block of t tokens is costed as
    part of a forward over n * t tokens (every session drafting alike). So longer drafts get dearer as load
    grows, and under enough load no draft pays (vLLM's disable-by-batch-size, derived instead of set)."""

    def __init__(self, forward_ms: list[float], max_batch: int = 1, sessions=lambda: 1):
        self.forward_ms = [float(x) for x in forward_ms]
        self.max_batch = max(1, int(max_batch))
        self.sessions = sessions  # generations running now (this orchestrator's view of the batch)
        self._lock = threading.Lock()
        self.load = Ema()
        self.rpc_ms = Ema()

    def rows(self) -> int:
        return max(1, min(self.max_batch, int(self.sessions())))

    def forward(self, tokens: int) -> float:
        """Profiled ms of a forward over `tokens` tokens; linear beyond the profile's end."""
        f = self.forward_ms
        if tokens <= len(f):
            return f[tokens - 1]
        mid = len(f) // 2
        slope = (f[-1] - f[mid - 1]) / max(1, len(f) - mid)
        return f[-1] + slope * (tokens - len(f))

    def observe(self, tokens: int, server_ms: float, wall_ms: float, calls: int = 1) -> None:
        """A target call that ran forwards over `tokens` new tokens each (`calls` of them), taking server_ms on
        the target and wall_ms here."""
        if not self.forward_ms or tokens < 1 or tokens > self.max_tokens or server_ms <= 0:
            return
        with self._lock:
            self.load.observe(server_ms / (calls * self.forward(self.rows() * tokens)))
            self.rpc_ms.observe(max(0.0, wall_ms - server_ms))

    def step_ms(self, tokens: int, rows: int = 1) -> float:
        return self.forward(rows * tokens) * self.load.get(1.0) + self.rpc_ms.get(0.0)

    @property
    def max_tokens(self) -> int:
        """The longest single block (draft + 1) the profile covers."""
        return len(self.forward_ms)


class DiscountedAcceptance:
    """Per-token acceptance from verified blocks: accepted tokens are successes, a block that ended in a rejection
    is one failure (the maximum-likelihood estimate for truncated geometric runs), both discounted per drafted
    token, so the estimate follows the text (a copied passage, then free prose) as fast after long blocks as
    after short ones."""

    def __init__(self, decay: float, successes: float = 0.0, failures: float = 0.0):
        self.decay = decay
        self.successes, self.failures = successes, failures
        self._lock = threading.Lock()  # the orchestrator-wide one is updated by every session's thread

    def update(self, proposed: int, accepted: int) -> None:
        with self._lock:
            keep = self.decay ** proposed
            self.successes = keep * self.successes + accepted
            self.failures = keep * self.failures + (accepted < proposed)

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)


class AcceptancePrior(DiscountedAcceptance):
    """The orchestrator-wide per-token acceptance (all sessions' blocks, over a few hundred drafted tokens): a new
    session starts from it, and one session's short run of rejections (n-gram acceptance comes in bursts) moves
    its estimate only so far. Starts at 0.5, worth one success and one failure."""

    def __init__(self):
        super().__init__(decay=0.995, successes=1.0, failures=1.0)


class GoodputDraftLength:
    """k = argmax over 0..max_len of E(k) / T(k):
    E(k) = 1 + a + ... + a^k, the expected tokens one step commits with per-token acceptance a;
    T(k) = target step over k + 1 tokens + draft cost (per call + per token; nothing for k = 0).
    a is this session's DiscountedAcceptance, shrunk towards the orchestrator-wide one (worth PRIOR_WEIGHT
    observations)."""

    DECAY = 0.97         # weight of the history per newly drafted token (about the last 30 drafted tokens count)
    PRIOR_WEIGHT = 8.0
    PROBE_EVERY = 4    # while paused (k = 0), try speculating again after this many target-only steps

    def __init__(self, max_len: int, cost: TargetCost, prior: AcceptancePrior | None = None):
        self.cost = cost
        self.prior = prior if prior is not None else AcceptancePrior()
        self.max_len = max(1, min(max_len, cost.max_tokens - 1))
        self.own = DiscountedAcceptance(self.DECAY)
        self.draft_call_ms = Ema()
        self.draft_token_ms = Ema()
        self.paused_steps = 0
        self.k = self.best()

    @property
    def alpha(self) -> float:
        w, own = self.PRIOR_WEIGHT, self.own
        return (own.successes + w * self.prior.alpha) / (own.successes + own.failures + w)

    def tokens_per_ms(self, k: int, rows: int = 1, alpha: float | None = None) -> float:
        t = self.cost.step_ms(k + 1, rows)
        if k:
            t += self.draft_call_ms.get(0.0) + k * self.draft_token_ms.get(0.0)
        return expected_accepted_length(min(self.alpha if alpha is None else alpha, 0.999), k) / t

    def _argmax(self, lowest: int, rows: int, alpha: float | None = None) -> int:
        return max(range(lowest, self.max_len + 1), key=lambda k: self.tokens_per_ms(k, rows, alpha))

    def best(self) -> int:
        """The best k for this session. It pauses (k = 0) only when the orchestrator-wide acceptance agrees that
        no k pays: a drafter that pays on average keeps drafting (at least 1 token) through one session's
        rejections, since n-gram matches come in bursts and a pause would miss the next one."""
        rows = self.cost.rows()
        k = self._argmax(0, rows)
        if k == 0 and self._argmax(0, rows, self.prior.alpha):
            k = self._argmax(1, rows)
        return k

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.own.update(proposed, accepted)
        self.prior.update(proposed, accepted)
        self.paused_steps = 0
        self.k = self.best()

    def observe_draft(self, wall_ms: float, draft_ms: float, tokens: int) -> None:
        """A Propose call: wall_ms here, of which the draft spent draft_ms drafting `tokens` tokens."""
        if tokens:
            self.draft_token_ms.observe(draft_ms / tokens)
        self.draft_call_ms.observe(max(0.0, wall_ms - draft_ms))

    def step_taken(self) -> None:
        """A step without a verify; while paused, count towards the next probe."""
        if self.k == 0:
            self.paused_steps += 1
            if self.paused_steps >= self.PROBE_EVERY:
                self.k = self._argmax(1, self.cost.rows())


AdaptiveLength = DraftLength | GoodputDraftLength


def make_draft_length(start: int, max_len: int, adaptive: bool, policy: str, cost: TargetCost | None,
                      prior: AcceptancePrior | None = None):
    """The per-session draft length: goodput when adaptive and the target reported its forward costs (it ignores
    `start`: its first k comes from the costs and the prior), otherwise transformers' heuristic (adaptive) or
    fixed, starting at `start`."""
    if adaptive and policy == "goodput" and cost is not None and cost.max_tokens >= 2:
        return GoodputDraftLength(max_len, cost, prior)
    return DraftLength(start, max_len, adaptive)
