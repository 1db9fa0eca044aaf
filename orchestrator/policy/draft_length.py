"""How many tokens to draft per step, per session.

- `DraftLength`: fixed, or transformers' heuristic schedule for assisted generation (+2 after a fully accepted
  block, -1 after a rejection).
- `GoodputDraftLength` (the default adaptive policy): picks k to maximise expected tokens per millisecond, with
  the paper's expected accepted length (Leviathan et al. 2023) over what a step really costs here: the target's
  measured forward cost for k + 1 tokens (reported by the target service, scaled by the load it sees), the
  draft's measured cost per token and per call, and the orchestrator's own time per step (RPC, Redis commit,
  its Python among the other sessions), which target-only decoding pays once per Decode call of several tokens.
  k = 0, target-only, when no k pays; speculation is then probed again every few steps so the session can
  return to it.
- `DraftEvidence`: for a drafter that scores its tokens (the n-gram drafter's votes), goodput asks for a longer
  draft and verifies only the prefix that pays, from what each order of magnitude of score has meant in
  acceptance (the draft's confidence, as transformers' assistant confidence threshold and llama.cpp's p-min
  use a draft model's probability, but learned rather than a set threshold).
- A free drafter (FREE_DRAFTERS: the suffix tree, which costs microseconds and sizes its own drafts by its match)
  drafts every step and is asked for the longest block the target takes; each block is then priced on the
  target's measured forward-cost curve (up to 64 tokens: 8 tokens cost ~4.7 single steps on llama.cpp here, 32
  ~18) with each token's learned acceptance, and a block whose expected tokens per ms do not beat target-only
  decoding is not verified at all: the step decodes target-only instead (never slower where drafts are weak).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from orchestrator.policy.fixed_length import DraftLength
from specdec.core.sampling import expected_accepted_length

FREE_DRAFTERS = ("suffix",)  # ModelInfo.strategy of drafters that cost ~nothing per token and size their drafts


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
    size alike), plus an EMA of the rest of a step's time here (the target call's round trip, the Redis
    commit, the orchestrator's Python while other sessions hold the GIL; not the Propose call, which goodput
    costs apart from its draft's measured times). That rest grows with the sessions one orchestrator serves
    (measured at 8 sessions: ~50 ms a step against ~5 for one), and a target-only Decode call pays it once for
    several tokens, so under load it decides against speculating.

    A batching target verifies the blocks of concurrent sessions in one forward, whose cost grows with the
    tokens of all its rows: with n sessions generating (at most max_batch), a block of t tokens is costed as
    part of a forward over t + (n - 1) * b tokens, b the tokens per session the target's calls have carried
    lately (an EMA over this orchestrator's calls). So longer drafts get dearer as load grows, and under enough
    load no draft pays (vLLM's disable-by-batch-size, derived instead of set); but one session decoding
    target-only does not make the others' blocks shorter: its single token still waits for a forward over
    their blocks (costing it as n single tokens paused sessions at 8 sessions and their tokens came one per
    ~300 ms forward).

    Verify and Decode calls keep separate observed / profiled ratios: they take different paths through a target
    (a Decode's steps run back to back in one call; a Verify's rows go through the verifier), so each engine adds
    a different cost per forward to each, and one shared ratio would cost target-only steps by Verify
    measurements and the reverse.

    A long context adds attention to every token a forward carries, which the profile (after 32 tokens of context)
    does not show: on llama.cpp here one token costs ~9 ms after a short prompt and ~37 ms after 1.4k tokens, so a
    block of n tokens costs about n times that extra on top of its profiled forward, and the curve's gain from long
    blocks shrinks. Decode steps measure it per context bucket (powers of two from 256 tokens): attention_ms(c), a
    token's cost at context c beyond its cost in the shortest bucket measured, is added per token to every forward
    at that context (and taken out of what the observed / profiled ratios learn; a Verify at a bucket not measured
    yet teaches no ratio).

    Only a Verify teaches the Verify ratio, so one Verify slowed by a passing spell of load could price every later
    block out and, no Verify running, nothing would correct it. Once STALE_AFTER Decode observations have come with
    no Verify, each further one moves the Verify ratio toward the Decode ratio (what the target costs now), so a
    block that pays is tried again; a real Verify premium comes back with the next Verify."""

    SHORT_CONTEXT = 256  # contexts below this share the first bucket (the profile's own)
    STALE_AFTER = 8  # Decode observations with no Verify before the Verify ratio is taken as stale
    STALE_RELAX = 0.8  # a stale Verify ratio's distance to the Decode ratio kept per further Decode observation

    def __init__(self, forward_ms: list[float], max_batch: int = 1, sessions=lambda: 1):
        self.forward_ms = [float(x) for x in forward_ms]
        self.max_batch = max(1, int(max_batch))
        self.sessions = sessions  # generations running now (this orchestrator's view of the batch)
        self._lock = threading.Lock()
        self.load = Ema()  # Verify calls: observed / profiled
        self.decode_load = Ema()  # Decode calls' steps: observed / profiled
        self.overhead_ms = Ema()
        self.block = Ema()  # tokens per session in the target's calls
        self.switch_wait_ms = Ema()  # a Verify that closed the session's decode stream: its wait for the stream
        self.token_ms_at: dict[int, Ema] = {}  # context bucket -> ms per target-only token measured there
        self.decodes_since_verify = 0

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

    @classmethod
    def context_bucket(cls, context: int) -> int:
        return max(0, int(context) // cls.SHORT_CONTEXT).bit_length()

    def attention_ms(self, context: int) -> float:
        """A token's extra cost at this context over the shortest context bucket measured (0 until both are)."""
        b = self.context_bucket(context)
        here = self.token_ms_at.get(b)
        if b == 0 or here is None:
            return 0.0
        base = next((self.token_ms_at[i].value for i in sorted(self.token_ms_at) if i < b), None)
        return 0.0 if base is None else max(0.0, here.value - base)

    def context_measured(self, context: int) -> bool:
        """Whether a token's cost at this context is known (its bucket measured, or the profile's own)."""
        b = self.context_bucket(context)
        return b == 0 or b in self.token_ms_at

    def observe(self, tokens: int, server_ms: float, calls: int = 1, decode: bool = False, context: int = 0) -> None:
        """A target call that ran forwards over `tokens` new tokens each (`calls` of them) after `context` tokens,
        taking server_ms on the target; `decode`: a target-only Decode call (its steps), else a Verify."""
        if not self.forward_ms or tokens < 1 or tokens > self.max_tokens or server_ms <= 0:
            return
        if not decode and not self.context_measured(context):
            return  # its attention's share unknown: taken for load it would price every later Verify by it
        with self._lock:
            per_call = server_ms / calls
            if decode and tokens == 1:
                self.token_ms_at.setdefault(self.context_bucket(context), Ema()).observe(per_call)
            self.block.observe(tokens)
            own = max(0.1 * per_call, per_call - tokens * self.attention_ms(context))
            ratio = own / self.batched_forward(tokens, self.rows())
            (self.decode_load if decode else self.load).observe(ratio)
            self.decodes_since_verify = self.decodes_since_verify + 1 if decode else 0
            if decode and self.decodes_since_verify > self.STALE_AFTER and self.load.value is not None:
                now = self.decode_load.value
                self.load.value = now + (self.load.value - now) * self.STALE_RELAX

    def observe_switch(self, tokens: int, server_ms: float, context: int = 0) -> None:
        """A Verify over `tokens` tokens sent right after closing the session's decode stream, taking server_ms: the
        target first finishes the stream's step in flight (the session's earlier work), so it waits beyond its
        forward. Kept apart from the Verify load (it would make every verify look dearer) as the switch's cost."""
        if not self.forward_ms or tokens < 1 or tokens > self.max_tokens or server_ms <= 0:
            return
        with self._lock:
            forward = (self.batched_forward(tokens, self.rows()) * self.load.get(self.decode_load.get(1.0))
                       + tokens * self.attention_ms(context))
            self.switch_wait_ms.observe(max(0.0, server_ms - forward))

    def batched_forward(self, tokens: int, rows: int) -> float:
        """Profiled ms of a forward that carries a block of `tokens` and the other rows' usual blocks."""
        return self.forward(tokens + round((rows - 1) * self.block.get(tokens)))

    def shared_delay_ms(self, tokens: int, rows: int, context: int = 0) -> float:
        """What a block of `tokens` costs the other rows - 1 sessions of its step: its rows beyond one token's
        lengthen the forward each of them waits for, at the curve's marginal cost at this batch's size."""
        if rows <= 1 or tokens <= 1 or not self.forward_ms:
            return 0.0
        others = round((rows - 1) * self.block.get(tokens))
        scale = self.load.get(self.decode_load.get(1.0))
        extra = ((self.forward(tokens + others) - self.forward(1 + others)) * scale
                 + (tokens - 1) * self.attention_ms(context))
        return (rows - 1) * max(0.0, extra)

    def observe_step(self, step_ms: float, server_ms: float) -> None:
        """One step of a session (a Verify or one Decode call, with its commit; without the Propose call): step_ms
        of wall time here, of which the target reported server_ms."""
        if step_ms > 0:
            with self._lock:
                self.overhead_ms.observe(max(0.0, step_ms - server_ms))

    def stream_token_ms(self, rows: int = 1, context: int = 0) -> float:
        """ms per target-only token on the session's decode stream: the target's own step (as Decode steps measured
        it), no per-call overhead (the stream's blocks need no call, and their commits run off the stepper)."""
        return self.step_ms(1, rows, calls_per_token=0.0, decode=True, context=context)

    def step_ms(self, tokens: int, rows: int = 1, calls_per_token: float = 1.0, decode: bool = False,
                context: int = 0) -> float:
        """ms per call of a step over `tokens` tokens with `rows` sessions batched after `context` tokens (`decode`:
        a target-only Decode step, else a Verify); calls_per_token < 1 spreads the per-call overhead over the tokens
        of a multi-token Decode. A kind not observed yet takes the other kind's ratio (load slows both)."""
        own, other = (self.decode_load, self.load) if decode else (self.load, self.decode_load)
        scale = own.get(other.get(1.0))
        return (self.batched_forward(tokens, rows) * scale + tokens * self.attention_ms(context)
                + self.overhead_ms.get(0.0) * calls_per_token)

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


class DraftEvidence:
    """What a drafter's per-token score means: P(the token is accepted | the tokens before it were), per order of
    magnitude of the score (base 8: one more matched context token, for the n-gram drafter), each a discounted
    Beta(1, 1) learned from verified blocks and shared by an orchestrator's sessions. Replayed on the target's
    greedy replies to the 12 bench prompts (bench/policy_replay.py) with three forward-cost profiles measured
    on this CPU, verifying the prefix these estimates say pays ran 1.72x / 1.55x / 1.48x target-only against
    1.68x / 1.50x / 1.46x for goodput without them and 1.70x / 1.52x / 1.48x for transformers' heuristic."""

    DECAY = 0.995
    LOWEST, HIGHEST = -3, 6  # scores below 8^-3 or above 8^6 share the end buckets

    def __init__(self):
        self._lock = threading.Lock()
        self._accepted: dict[int, float] = {}
        self._rejected: dict[int, float] = {}

    @classmethod
    def bucket(cls, score: float) -> int:
        return max(cls.LOWEST, min(cls.HIGHEST, math.floor(math.log(max(score, 1e-12), 8))))

    def observations(self, score: float) -> float:
        """The (discounted) verified tokens behind acceptance(score)."""
        b = self.bucket(score)
        return self._accepted.get(b, 0.0) + self._rejected.get(b, 0.0)

    def acceptance(self, score: float) -> float:
        b = self.bucket(score)
        yes, no = self._accepted.get(b, 0.0), self._rejected.get(b, 0.0)
        return (yes + 1.0) / (yes + no + 2.0)

    def monotone_acceptance(self, score: float, tested: float) -> float:
        """acceptance(score), but never below that of a lower bucket with at least `tested` observations: a longer
        or likelier match is not worse than a shorter one, so an untested bucket above a tested one starts from it
        rather than from Beta(1, 1)'s 0.5 (which a block must beat by the cost of closing the decode stream)."""
        b = self.bucket(score)
        own = self.acceptance(score)
        if self.observations(score) >= tested:
            return own
        below = [self.acceptance(8.0**i) for i in range(self.LOWEST, b) if self.observations(8.0**i) >= tested]
        return max([own, *below])

    def update(self, scores: list[float], verified: int, accepted: int) -> None:
        """A block of `verified` scored tokens of which the first `accepted` were accepted: tokens up to and
        including the first rejection are observations; the ones after it were never tested."""
        with self._lock:
            for i in range(min(accepted + 1, verified, len(scores))):
                b = self.bucket(scores[i])
                self._accepted[b] = self.DECAY * self._accepted.get(b, 0.0) + (i < accepted)
                self._rejected[b] = self.DECAY * self._rejected.get(b, 0.0) + (i >= accepted)


class DraftCost:
    """What drafting costs, shared by an orchestrator's sessions (a new session's first calls need it before they
    have measured anything): per call (the round trip beyond the draft's own time), per drafted token, and per
    context token a draft takes in on a session's first call (its prompt prefill: for a draft as large as the
    target, like its int8 copy, as slow as the target's own). A draft serves concurrent sessions' calls on the
    same cores, so a token's cost depends on how many sessions are generating: it is kept per session count
    where measured there (a batching draft's 8 sessions cost ~3.5x one, not 8x), else taken as n times the
    per-session share of what was measured (a serial draft), so a cost measured under load neither keeps a lone
    session from drafting later nor the reverse."""

    MAX_LOADS = 64  # session counts with their own per-token estimate

    def __init__(self):
        self._lock = threading.Lock()
        self.call_ms = Ema()
        self.token_ms = Ema()  # per drafted token, divided by the sessions generating at the time
        self.token_ms_at: dict[int, Ema] = {}  # sessions generating -> per drafted token, as measured there
        self.prefill_token_ms = Ema()
        self.prefetch_token_ms = Ema()  # per drafted token of prefetched blocks (deadlines only)

    def observe(self, wall_ms: float, draft_ms: float, tokens: int, sessions: int = 1) -> None:
        """A Propose call that drafted `tokens` tokens (with `sessions` generating at the time)."""
        n = max(1, sessions)
        with self._lock:
            if tokens:
                self.token_ms.observe(draft_ms / tokens / n)
                if n <= self.MAX_LOADS:
                    self.token_ms_at.setdefault(n, Ema()).observe(draft_ms / tokens)
            self.call_ms.observe(max(0.0, wall_ms - draft_ms))

    def observe_prefetch(self, draft_ms: float, tokens: int, sessions: int = 1) -> None:
        """A prefetched block's drafting time per token: only for the draft deadline (with every block prefetched
        no Propose is measured). The draft length's cost model keeps to Propose calls: charging each fully accepted
        step the prefetch's k + 1 tokens at this rate beyond the verify (measured) made it draft shorter blocks,
        and 4.5% slower than this model in an interleaved A/B."""
        if tokens:
            with self._lock:
                self.prefetch_token_ms.observe(draft_ms / tokens / max(1, sessions))

    def deadline_per_token(self, sessions: int = 1) -> float | None:
        """Per drafted token, for deadlines: as measured by Propose calls, else by prefetches; None if neither."""
        if self.token_ms.value is not None:
            return self.per_token(sessions)
        value = self.prefetch_token_ms.value
        return None if value is None else value * max(1, sessions)

    def observe_prefill(self, draft_ms: float, context_tokens: int, tokens: int, sessions: int = 1) -> None:
        """A session's first Propose: the draft took in `context_tokens` tokens, then drafted `tokens`."""
        if context_tokens > 0:
            with self._lock:
                rest = max(0.0, draft_ms / max(1, sessions) - tokens * self.token_ms.get(0.0))
                self.prefill_token_ms.observe(rest / context_tokens)

    def timed_out(self, waited_ms: float, tokens: int, context_tokens: int = 0, sessions: int = 1) -> None:
        """A call asked for `tokens` tokens (after taking in `context_tokens` of context) and ran past its
        deadline of waited_ms: it costs at least that, so raise the estimate that set the deadline to it (never
        further: concurrent sessions timing out together must not compound). A timed-out call is never
        measured, so a cost learned under other conditions (a batching draft serves 8 sessions far better than
        8 times slower, so normalising per session undercounts a lone session's prefill) would otherwise time
        out every later call; the calls that then finish pull the averages back."""
        per = waited_ms / max(1, sessions)
        with self._lock:
            if context_tokens > 0:
                if self.prefill_token_ms.value is not None:  # unmeasured: the first-call deadline governs
                    floor = per / (context_tokens + tokens)
                    self.prefill_token_ms.value = max(self.prefill_token_ms.value, floor)
            else:
                self.token_ms.value = max(self.token_ms.get(0.0), per / max(1, tokens))
                at = self.token_ms_at.get(max(1, sessions))
                if at is not None:
                    at.value = max(at.get(0.0), waited_ms / max(1, tokens))

    def per_token(self, sessions: int = 1) -> float:
        n = max(1, sessions)
        at = self.token_ms_at.get(n)
        if at is not None and at.value is not None:
            return at.value
        return self.token_ms.get(0.0) * n

    def per_prefill_token(self, sessions: int = 1) -> float | None:
        value = self.prefill_token_ms.value
        return None if value is None else value * max(1, sessions)


class GoodputDraftLength:
    """k = argmax over 0..max_len of E(k) / T(k):
    E(k) = 1 + a + ... + a^k, the expected tokens one step commits with per-token acceptance a;
    T(k) = target step over k + 1 tokens + draft cost (per call + per token; nothing for k = 0).
    a is this session's DiscountedAcceptance, shrunk towards the orchestrator-wide one (worth PRIOR_WEIGHT
    observations).

    pipelined (the generation prefetches the next block while the target verifies this one): the next block's
    drafting overlaps this verify, so when this block is wholly accepted and the bonus token guessed (a^(k+1))
    the step saves min(drafting, verify). Without that the draft's time counts in full although the draft runs
    on its own cores meanwhile, and under load (a verify batched with other sessions' blocks is long) goodput
    paused a draft that paid (8 sessions, int8 draft: 28 tokens/s paused half the time vs 45 always drafting)."""

    DECAY = 0.97         # weight of the history per newly drafted token (about the last 30 drafted tokens count)
    PRIOR_WEIGHT = 8.0
    PROBE_EVERY = 4    # while paused (k = 0), try speculating again after this many target-only steps

    EVIDENCE_REQUEST = 10  # with a scoring drafter, ask for this many tokens (at least k) and verify what pays
    EXPLORE_BELOW = 4.0  # a free drafter's block is verified while its first token's score bucket has fewer
    # observations than this, whatever the estimate says: an untested bucket's 0.5 would never be tested otherwise

    def __init__(self, max_len: int, cost: TargetCost, prior: AcceptancePrior | None = None,
                 evidence: DraftEvidence | None = None, decode_chunk: int = 1, draft_cost: DraftCost | None = None):
        self.cost = cost
        self.draft_cost = draft_cost if draft_cost is not None else DraftCost()
        self.decode_chunk = max(1, int(decode_chunk))  # tokens per target-only Decode call
        self.prior = prior if prior is not None else AcceptancePrior()
        self.evidence = evidence
        self.scored = False  # the drafter has sent scores
        self.max_len = max(1, min(max_len, cost.max_tokens - 1))
        self.own = DiscountedAcceptance(self.DECAY)
        self.paused_steps = 0
        self.probing = False  # k was set by a paused session's probe, not by a verify
        self.pipelined = False  # set by the generation: whether it prefetches the next block
        self.free = False  # set by the generation: the drafter is a FREE_DRAFTERS one (draft every step)
        self.streamed = True  # target-only tokens come from the session's decode stream (no call per block)
        self.stream_open = False  # set by the step: the session's decode stream is open (verifying closes it)
        self.context = 0  # set by the step: the session's context length (TargetCost.attention_ms)
        self.k = self.best()

    @property
    def alpha(self) -> float:
        w, own = self.PRIOR_WEIGHT, self.own
        return (own.successes + w * self.prior.alpha) / (own.successes + own.failures + w)

    def target_only_ms(self, rows: int = 1) -> float:
        """ms per target-only token: on the decode stream (a paused session; a free drafter's blocks that do not
        pay), else one Decode call per decode_chunk tokens."""
        if self.streamed:
            return self.cost.stream_token_ms(rows, self.context)
        return self.cost.step_ms(1, rows, 1.0 / self.decode_chunk, decode=True, context=self.context)

    def switch_ms(self, rows: int = 1) -> float:
        """What a Verify costs beyond its own call while the session's decode stream is open: its wait for the
        stream's step in flight (measured by Verify calls that closed a stream; one stream token until then) and
        the call that opens a stream again after it."""
        if not (self.streamed and self.stream_open):
            return 0.0
        wait = self.cost.switch_wait_ms.get(self.cost.stream_token_ms(rows, self.context))
        return wait + self.cost.overhead_ms.get(0.0)

    def verify_ms(self, tokens: int, rows: int = 1) -> float:
        """A Verify of `tokens` priced for the batch: its call, plus the delay its extra rows give every other session
        of the step (TargetCost.shared_delay_ms) times the tokens each of them commits per step (1 - a^b) / (1 - a),
        b their usual block, a the orchestrator-wide acceptance: a block pays only where its extra tokens per ms
        beat the batch's own rate, however many tokens the others' blocks bring."""
        b, a = self.cost.block.get(tokens), min(self.prior.alpha, 0.999)
        return (self.cost.step_ms(tokens, rows, context=self.context)
                + self.cost.shared_delay_ms(tokens, rows, self.context) * (1 - a ** b) / (1 - a))

    def tokens_per_ms(self, k: int, rows: int = 1, alpha: float | None = None) -> float:
        if k == 0:
            return 1.0 / self.target_only_ms(rows)
        draft = self.draft_cost
        a = min(self.alpha if alpha is None else alpha, 0.999)
        verify = self.verify_ms(k + 1, rows) + self.switch_ms(rows)
        drafting = k * draft.per_token(self._sessions())
        t = verify + draft.call_ms.get(0.0) + drafting
        if self.pipelined:
            t -= a ** (k + 1) * min(drafting, verify)
        return expected_accepted_length(a, k) / t

    def _argmax(self, lowest: int, rows: int, alpha: float | None = None) -> int:
        return max(range(lowest, self.max_len + 1), key=lambda k: self.tokens_per_ms(k, rows, alpha))

    def best(self) -> int:
        """The best k for this session. It pauses (k = 0) only when the orchestrator-wide acceptance agrees that
        no k pays: a drafter that pays on average keeps drafting (at least 1 token) through one session's
        rejections, since n-gram matches come in bursts and a pause would miss the next one."""
        rows = self.cost.rows()
        k = self._argmax(0, rows)
        if k == 0 and (self.free or self._argmax(0, rows, self.prior.alpha)):
            k = self._argmax(1, rows)  # a free drafter's blocks are judged one by one (verify_len)
        return k

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.own.update(proposed, accepted)
        self.prior.update(proposed, accepted)
        self.paused_steps = 0
        self.probing = False
        self.k = self.best()

    def _sessions(self) -> int:
        return max(1, int(self.cost.sessions()))

    def steps_to_probe(self) -> int:
        """Paused: the target-only steps left before the next probe (a decode stream is opened for their tokens)."""
        return max(1, self.PROBE_EVERY - self.paused_steps)

    def step_taken(self) -> None:
        """A step without a verify; while paused, count towards the next probe."""
        if self.k == 0:
            self.paused_steps += 1
            if self.paused_steps >= self.PROBE_EVERY:
                self.k = self._argmax(1, self.cost.rows())
                self.probing = True

    def dry(self) -> bool:
        """The drafter proposed nothing this step. A paused session's probe that comes back dry pauses again: it
        decodes the target-only chunk and probes PROBE_EVERY steps later, as if it had not probed. Taking the dry
        ramp instead (1, then 2 tokens per Decode call, a Propose every step) made a paused session pay two extra
        round trips per dry probe that a target-only session does not (llama.cpp, one stream: 8-16 target calls for
        24 tokens against target-only's 6). True when it paused again."""
        if not self.probing:
            return False
        self.k, self.paused_steps, self.probing = 0, 0, False
        return True

    def use_free_drafter(self, free: bool) -> None:
        """The session drafts with a FREE_DRAFTERS drafter: draft every step, judge each block (verify_len)."""
        self.free = free
        self.k = self.best()

    def request_len(self, k: int) -> int:
        if self.free:
            return self.max_len  # its draft stops where its match does; verify_len prices the block
        if self.evidence is None or not self.scored:
            return k
        return max(k, min(self.max_len, self.EVIDENCE_REQUEST))

    def verify_len(self, scores: list[float], limit: int) -> int:
        """The d in 1..min(len(scores), limit) that maximises expected tokens per ms of the verify, with each
        token's acceptance from its score (the draft is already paid for). At least one token: whether to draft
        at all is k's decision, from the session's acceptance; trimming to nothing would also stop testing the
        low-score buckets, whose estimates then could never recover (replayed: 1.32x instead of 1.48x).
        A free drafter's block may be verified not at all (0): when even its best prefix is expected to commit
        fewer tokens per ms than target-only decoding and its first token's bucket has been tested enough."""
        self.scored = True
        if self.evidence is None:
            return min(len(scores), limit)
        rows = self.cost.rows()
        best_d, best = 0, 0.0
        reach, expected, switch = 1.0, 1.0, self.switch_ms(rows)
        for d in range(1, min(len(scores), limit, self.cost.max_tokens - 1) + 1):
            reach *= self.evidence.monotone_acceptance(scores[d - 1], self.EXPLORE_BELOW)
            expected += reach
            rate = expected / (self.verify_ms(d + 1, rows) + switch)
            if rate > best:
                best_d, best = d, rate
        explore = (switch == 0 and self.cost.context_measured(self.context)
                   and self.evidence.observations(scores[0]) < self.EXPLORE_BELOW)
        if self.free and best_d and best <= self.tokens_per_ms(0, rows) and not explore:
            return 0  # an untested bucket is tried only where that costs just its Verify, at a known context cost
        return best_d

    def observe_evidence(self, scores: list[float], verified: int, accepted: int) -> None:
        if self.evidence is not None and scores:
            self.evidence.update(scores, verified, accepted)


AdaptiveLength = DraftLength | GoodputDraftLength


def dry_decode_tokens(dry_steps: int, chunk: int) -> int:
    """Target tokens to decode after a step whose drafter proposed nothing (no n-gram match), the `dry_steps`-th in a
    row (0 first): 1, 2, then `chunk` per Decode call while it stays dry, so a dry spell does not cost a round trip
    per token (an n-gram stack on llama.cpp ran ~20 % behind target-only that way) and a new match is tried soon."""
    return min(chunk, 1 << min(dry_steps, 16))


def dry_step_tokens(draft_len: AdaptiveLength, dry_steps: int, chunk: int) -> int:
    """Target tokens to decode after a step whose drafter proposed nothing: `chunk` when that step was a paused
    session's probe (draft_len.dry(): it pauses again, decoding as target-only does), else dry_decode_tokens."""
    return chunk if draft_len.dry() else dry_decode_tokens(dry_steps, chunk)


@dataclass(frozen=True)
class Evidence:
    """What the goodput policy chooses from, measured across sessions (None: not measured)."""
    target_cost: TargetCost | None
    prior: AcceptancePrior | None = None
    draft_scores: DraftEvidence | None = None
    draft_cost: DraftCost | None = None


def make_draft_length(start: int, max_len: int, adaptive: bool, policy: str, evidence: Evidence,
                      decode_chunk: int = 1):
    """The per-session draft length: goodput when adaptive and the target reported its forward costs (it ignores
    `start`: its first k comes from the costs and the prior), otherwise transformers' heuristic (adaptive) or
    fixed, starting at `start`."""
    cost = evidence.target_cost
    if adaptive and policy == "goodput" and cost is not None and cost.max_tokens >= 2:
        return GoodputDraftLength(max_len, cost, evidence.prior, evidence.draft_scores, decode_chunk,
                                  evidence.draft_cost)
    return DraftLength(start, max_len, adaptive)
