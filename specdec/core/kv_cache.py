"""Per-session KV caches held by a model service, bounded by sessions and bytes (LRU eviction).

A session's cache holds KV entries for `tokens`. Requests say how many of those tokens are still valid
(`prefix_len`); the rest are cropped away (rejected drafts), and new tokens are appended, so a prefix
the service already holds is never recomputed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specdec.models import ragged_batch
from specdec.models import LoadedModel

log = logging.getLogger("specdec.kv")


class CacheMiss(Exception):
    """The service holds fewer tokens of the session than the request assumes; resend from prefix 0."""

    def __init__(self, session_id: str, have: int, need: int):
        super().__init__(f"cache-miss: session {session_id} holds {have} tokens, request assumes {need}")
        self.have = have
        self.need = need


class ContextTooLong(Exception):
    pass


def check_context(loaded: LoadedModel, total: int) -> None:
    if total > loaded.max_context:
        raise ContextTooLong(f"context of {total} tokens exceeds the model's limit of {loaded.max_context}")


@dataclass
class SessionKV:
    session_id: str
    tokens: list[int] = field(default_factory=list)
    cache: DynamicCache | None = None
    nbytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def cache_nbytes(cache: DynamicCache | None) -> int:
    if cache is None:
        return 0
    if isinstance(getattr(cache, "nbytes", None), int):  # draft_service/int8_draft.py LeanCache
        return cache.nbytes
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class SessionCacheStore:
    """LRU map session_id -> SessionKV with a bound on sessions and on total KV bytes."""

    def __init__(self, max_sessions: int = 64, max_bytes: int = 2 * 1024**3):
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self._sessions: OrderedDict[str, SessionKV] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def get(self, session_id: str, create: bool = True) -> SessionKV | None:
        with self._lock:
            sess = self._sessions.get(session_id)
            if sess is not None:
                self._sessions.move_to_end(session_id)
            elif create:
                sess = SessionKV(session_id)
                self._sessions[session_id] = sess
                self._evict_locked(keep=session_id)
            return sess

    def release(self, session_id: str) -> bool:
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def update_size(self, sess: SessionKV) -> None:
        with self._lock:
            sess.nbytes = cache_nbytes(sess.cache)
            self._evict_locked(keep=sess.session_id)

    def total_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._sessions.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    def _evict_locked(self, keep: str) -> None:
        total = sum(s.nbytes for s in self._sessions.values())
        while self._sessions and (len(self._sessions) > self.max_sessions or total > self.max_bytes):
            victim_id = next(iter(self._sessions))
            if victim_id == keep:
                if len(self._sessions) == 1:
                    break
                self._sessions.move_to_end(keep)
                victim_id = next(iter(self._sessions))
            victim = self._sessions.pop(victim_id)
            total -= victim.nbytes
            self.evictions += 1
            log.info("evicted session cache", extra={"session_id": victim_id, "bytes": victim.nbytes})


class CachedLM:
    """A causal LM plus per-session caches: extend a session with new tokens and get their logits."""

    drafts_trees = True  # its caches take a tree-masked forward (draft_service/proposers/tree.py)

    def __init__(self, loaded: LoadedModel, store: SessionCacheStore):
        self.loaded = loaded
        self.model = loaded.model
        self.store = store

    def sync(self, sess: SessionKV, prefix_len: int, delta: list[int]) -> list[int]:
        """Crop `sess` to prefix_len and return the tokens to feed next (delta, never empty)."""
        if prefix_len > len(sess.tokens):
            raise CacheMiss(sess.session_id, len(sess.tokens), prefix_len)
        if prefix_len < len(sess.tokens):
            self.crop(sess, prefix_len)
        if not delta:
            if not sess.tokens:
                raise ValueError("no tokens: the context is empty")
            # Logits of the last position are not stored, so re-feed the last token.
            last = sess.tokens[-1]
            self.crop(sess, len(sess.tokens) - 1)
            delta = [last]
        return list(delta)

    def crop(self, sess: SessionKV, length: int) -> None:
        if sess.cache is not None and length < len(sess.tokens):
            if length == 0:
                sess.cache = None
            else:
                sess.cache.crop(length - len(sess.tokens))  # negative: how many to drop
        del sess.tokens[length:]

    @torch.inference_mode()
    def extend(self, sess: SessionKV, new_tokens: list[int], keep: int = 0) -> torch.Tensor:
        """Append new_tokens to the session's cache; return float32 logits [len(new_tokens), V], or of the last
        `keep` positions only (the LM head over a long prompt costs as much as several layers: skip what no one reads)."""
        if self.loaded.ragged_batch:  # the same attention as a batched forward (and no repeated GQA keys)
            rows = keep if 0 < keep < len(new_tokens) else len(new_tokens)
            return _extend_packed(self, [(sess, new_tokens)], [rows])[0]
        check_context(self.loaded, len(sess.tokens) + len(new_tokens))
        if sess.cache is None:
            sess.cache = DynamicCache()
        ids = torch.tensor([new_tokens], dtype=torch.long, device=self.loaded.device)
        try:
            out = self.model(input_ids=ids, cache=sess.cache, use_cache=True,
                             logits_to_keep=_keep(keep, len(new_tokens)))
        except BaseException:
            ragged_batch.truncate_cache(sess.cache, len(sess.tokens))  # layers before the failure appended
            raise
        sess.cache = out.cache
        sess.tokens.extend(new_tokens)
        return out.logits[0, :, : self.loaded.vocab_size].float()

    def proposing(self, session_id: str):
        """Context of one proposal's run of extends (a batching runtime waits for its next step)."""
        return contextlib.nullcontext()

    def release(self, session_id: str) -> bool:
        return self.store.release(session_id)


def _keep(keep: int, n: int) -> int:
    """transformers' logits_to_keep: 0 means every position."""
    return 0 if keep <= 0 or keep >= n else keep


def _layer_kv(cache: DynamicCache | None):
    return [] if cache is None else [(layer.keys, layer.values) for layer in cache.layers]


MAX_BATCHED_NEW_TOKENS = 16  # a verify block (<= 16 drafts + 1) or a decode step; longer inputs run alone


@torch.inference_mode()
def extend_batch(lm: CachedLM, items: list[tuple[SessionKV, list[int]]], keep: list[int] | None = None
                 ) -> list[torch.Tensor]:
    """Like CachedLM.extend for several sessions in ONE forward pass; returns each one's logits (of its last
    keep[i] positions when `keep` is given).

    Where the model allows (LoadedModel.ragged_batch), the sessions' new tokens are packed into one sequence and
    each attends to its own cache (specdec/models/ragged_batch.py); a prompt prefill joins the forward too. Otherwise
    the batch is padded: every row feeds M = max(len(new)) tokens, a row with fewer new tokens re-feeding its
    last cached tokens (their KV is recomputed), caches are copied left-padded with masked zeros to a common
    length, and each row gets its true position ids; rows shorter in total than M, and inputs longer than
    MAX_BATCHED_NEW_TOKENS (prefills, which would widen every row to their length), run on their own.
    """
    keeps = {id(s): (k if 0 < k < len(new) else len(new)) for (s, new), k in zip(items, keep or [0] * len(items))}
    if lm.loaded.ragged_batch:
        return _extend_packed(lm, items, [keeps[id(s)] for s, _ in items])
    short = [len(new) for _, new in items if len(new) <= MAX_BATCHED_NEW_TOKENS]
    m = max(short) if short else 0
    batch, single = [], []
    for sess, new in items:
        (batch if len(new) <= m <= len(sess.tokens) + len(new) else single).append((sess, new))
    out: dict[int, torch.Tensor] = {id(s): lm.extend(s, new, keeps[id(s)]) for s, new in single}
    if len(batch) == 1:
        s, new = batch[0]
        out[id(s)] = lm.extend(s, new, keeps[id(s)])
    elif batch:
        check_context(lm.loaded, max(len(s.tokens) + len(new) for s, new in batch))
        device = lm.loaded.device
        refeed = [m - len(new) for _, new in batch]
        cache_lens = [len(s.tokens) - r for (s, _), r in zip(batch, refeed)]
        c = max(cache_lens)
        ids = torch.tensor([s.tokens[len(s.tokens) - r:] + new for (s, new), r in zip(batch, refeed)],
                           dtype=torch.long, device=device)
        mask = torch.zeros(len(batch), c + m, dtype=torch.long, device=device)
        pos = torch.empty(len(batch), m, dtype=torch.long, device=device)
        for i, cl in enumerate(cache_lens):
            mask[i, c - cl:] = 1
            pos[i] = torch.arange(cl, cl + m, device=device)
        layers = []
        per_row = [_layer_kv(s.cache) for s, _ in batch]
        n_layers = max(len(kv) for kv in per_row)
        for layer in range(n_layers):
            ref_k, ref_v = next(kv[layer] for kv in per_row if kv)
            shape = (len(batch), ref_k.shape[1], c, ref_k.shape[3])
            keys = torch.zeros(shape, dtype=ref_k.dtype, device=device)
            values = torch.zeros(shape, dtype=ref_v.dtype, device=device)
            for i, kv in enumerate(per_row):
                cl = cache_lens[i]
                if cl:
                    keys[i, :, c - cl:] = kv[layer][0][0, :, :cl]
                    values[i, :, c - cl:] = kv[layer][1][0, :, :cl]
            layers.append((keys, values))
        cache = DynamicCache(ddp_cache_data=layers) if c else DynamicCache()
        rows = max(keeps[id(s)] for s, _ in batch)  # every row's new tokens end at position m
        res = lm.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                       logits_to_keep=_keep(rows, m))
        logits = res.logits[:, :, : lm.loaded.vocab_size].float()
        for i, (s, new) in enumerate(batch):
            cl = cache_lens[i]
            s.cache = DynamicCache(ddp_cache_data=[
                (k[i : i + 1, :, c - cl:].clone(), v[i : i + 1, :, c - cl:].clone()) for k, v in _layer_kv(res.cache)])
            s.tokens.extend(new)
            out[id(s)] = logits[i, logits.shape[1] - keeps[id(s)]:]
    return [out[id(s)] for s, _ in items]


def _extend_packed(lm: CachedLM, items: list[tuple[SessionKV, list[int]]], keep: list[int]) -> list[torch.Tensor]:
    """CachedLM.extend of one or more sessions as one packed forward (specdec/models/ragged_batch.py); keep[i] in
    1..len(new)."""
    check_context(lm.loaded, max(len(s.tokens) + len(new) for s, new in items))
    for s, _ in items:
        if s.cache is None:
            s.cache = DynamicCache()
    logits = ragged_batch.forward_rows(lm.model, [s.cache for s, _ in items], [len(s.tokens) for s, _ in items],
                                       [new for _, new in items], keep, lm.loaded.device)
    for s, new in items:
        s.tokens.extend(new)
    return [row[:, : lm.loaded.vocab_size].float() for row in logits]
