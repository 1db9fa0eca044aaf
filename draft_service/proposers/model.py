"""Drafting with a small causal LM that shares the target's tokenizer, with per-session KV caches."""

from __future__ import annotations

import torch

from draft_service.proposers.base import Proposal, Proposer, ProposeTask
from specdec.core import sampling
from specdec.core import wire
from specdec.core.kv_cache import CachedLM, SessionCacheStore
from specdec.models import LoadedModel
from specdec.core.sampling import SamplingParams


class TopVocabHead(torch.nn.Module):
    """An LM head over the first `n` token ids only (FR-Spec, Zhao et al. 2025). BPE vocabularies number their
    tokens roughly by merge frequency, so the first ids cover most text: for SmolLM2 the first 8192 cover 88%
    of the target's own output tokens, and the distilled draft's acceptance is unchanged (0.234 vs 0.237),
    while the head (49152 x 256, 50 MB a token in float32) shrinks to 8 MB and the draft step from ~7.8 to
    ~1.5 ms here. The other ids get logit -inf: the draft never proposes them (q = 0 there), which keeps
    greedy and rejection-sampling verification exact."""

    def __init__(self, head: torch.nn.Module, n: int, vocab_size: int):
        super().__init__()
        self.n, self.vocab_size = n, vocab_size
        self.weight = torch.nn.Parameter(head.weight[:n].detach().clone(), requires_grad=False)
        bias = getattr(head, "bias", None)
        self.bias = None if bias is None else torch.nn.Parameter(bias[:n].detach().clone(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden.new_full((*hidden.shape[:-1], self.vocab_size), float("-inf"))
        out[..., : self.n] = torch.nn.functional.linear(hidden, self.weight, self.bias)
        return out


def limit_draft_vocab(loaded: LoadedModel, n: int) -> bool:
    """Give the draft a TopVocabHead over its first n ids (no-op for n <= 0 or a vocabulary that small)."""
    head = loaded.model.get_output_embeddings()
    if n <= 0 or n >= loaded.vocab_size or head is None or getattr(head, "weight", None) is None:
        return False
    loaded.model.set_output_embeddings(TopVocabHead(head, n, loaded.vocab_size))
    return True


class ModelProposer(Proposer):
    strategy = "model"

    def __init__(self, loaded: LoadedModel, store: SessionCacheStore | None = None, lm: CachedLM | None = None):
        """lm: how the model runs (default CachedLM; the int8 draft brings its own, draft_service/int8_draft.py)."""
        self.loaded = loaded
        self.vocab_size = loaded.vocab_size
        self.store = store if store is not None else SessionCacheStore()
        self.lm = lm if lm is not None else CachedLM(loaded, self.store)

    @property
    def kv_dims(self) -> tuple[int, int, int] | None:
        """(layers, kv_heads, head_dim) when the runtime takes KV computed elsewhere (get_candidates' kv), else None."""
        return getattr(self.lm, "kv_dims", None)

    def get_candidates(self, task: ProposeTask) -> Proposal:
        """task.should_stop: checked before touching the session and between tokens. A pipelined prefetch the
        orchestrator no longer wants (its block was not fully accepted) is cancelled: it must neither hold the
        session's lock for a whole block nor change the cache after the call that replaced it.
        task.kv: (keys, values) of delta's first tokens, to install instead of prefilling them (prefix_len 0 only)."""
        session_id, prefix_len, delta, params = task.session_id, task.prefix_len, task.delta, task.params
        should_stop, kv = task.should_stop, task.kv
        sess = self.store.get(session_id)
        with sess.lock:
            if should_stop is not None and should_stop():
                return Proposal([], None, len(sess.tokens))
            if kv is not None:
                n = kv[0].shape[2]
                if prefix_len != 0 or n >= len(delta):
                    raise ValueError(f"KV of {n} positions needs a new session's context (prefix_len 0) of more "
                                     f"tokens (got prefix_len {prefix_len}, {len(delta)} tokens)")
                self.lm.import_kv(sess, list(delta[:n]), *kv)
                prefix_len, delta = n, delta[n:]
            with self.lm.proposing(session_id):  # a batching runtime lets the other sessions' steps wait for ours
                new = self.lm.sync(sess, prefix_len, delta)
                gen = None if params.is_greedy else sampling.make_generator(task.seed, task.step, "draft")
                tokens: list[int] = []
                rows: list[torch.Tensor] = []
                for _ in range(task.max_len):
                    logits = self.lm.extend(sess, new, keep=1)[-1]
                    if params.is_greedy:
                        token = int(sampling.greedy_tokens(logits))
                        confidence = float(torch.softmax(logits, -1)[token])
                    else:
                        # Sample from the float16-rounded q that goes on the wire, so the verifier sees the same q.
                        q16, q = wire.to_fp16_distribution(sampling.warp_probs(logits, params))
                        token = int(sampling.sample(q, gen))
                        confidence = float(q[token])
                        rows.append(q16)
                    tokens.append(token)
                    new = [token]
                    if task.min_confidence > 0 and confidence < task.min_confidence:
                        break
                    if should_stop is not None and should_stop():
                        break
            self.store.update_size(sess)
            probs = torch.stack(rows) if rows else None
            return Proposal(tokens, probs, len(sess.tokens))

    @property
    def drafts_trees(self) -> bool:
        return self.lm.drafts_trees

    def get_tree(self, session_id, prefix_len, delta, shape, params: SamplingParams, seed, step):
        """Tree speculation: a token tree instead of a chain (see draft_service/proposers/tree.py)."""
        from draft_service.proposers.tree import propose_tree

        return propose_tree(self, session_id, prefix_len, delta, shape, params, seed, step)

    def release(self, session_id: str) -> bool:
        return self.lm.release(session_id)

    def num_sessions(self) -> int:
        return len(self.store)
