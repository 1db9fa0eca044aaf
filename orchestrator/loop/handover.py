"""A new session's prompt: the target prefills it while the draft does, or hands its prompt KV to a draft that is
its own weights in int8 (equal kv fingerprints), so the draft does not prefill at all."""

from __future__ import annotations

import logging
import time

import grpc

from orchestrator.replicas.local_draft import is_local
from orchestrator.loop.state import LoopState
from specdec import observability as telemetry

log = logging.getLogger("specdec.orchestrator")

PARALLEL_PREFILL_MIN_TOKENS = 16  # below this a prefill is cheaper than the extra round trip


class PromptHandover:
    def __init__(self, state: LoopState):
        self.state = state

    def _draft_lags(self, replica) -> bool:
        """The draft must take in the whole context (a new session, a new replica), long enough to be worth a
        separate call, on a replica of its own."""
        rec = self.state.rec
        return (rec.draft_pos == 0 and len(rec.committed) - 1 >= PARALLEL_PREFILL_MIN_TOKENS
                and not is_local(replica.address))

    def start_parallel_prefill(self, replica):
        """When the draft must first prefill the context and the target also lags behind it, let the target
        prefill at the same time instead of after the Propose (a draft model as large as the target prefills as
        slowly; they run on different machines). The Verify then carries only the last token and the drafts. A
        future for finish_parallel_prefill, or None."""
        state, rec = self.state, self.state.rec
        lag = len(rec.committed) - 1 - rec.target_pos
        if not self._draft_lags(replica) or lag < PARALLEL_PREFILL_MIN_TOKENS:
            return None
        target = state.target_replica()
        if target is None:
            return None
        rec.stats.parallel_prefills += 1
        return target.client.prefill_async(rec.session_id, rec.committed[:-1], rec.target_pos,
                                           state.cfg.target_timeout_s, prompt_len=len(rec.prompt_ids))

    def finish_parallel_prefill(self, future) -> None:
        if future is None:
            return
        try:
            held = future.result().cached_len
        except grpc.RpcError as e:  # the Verify resends what the target lacks
            log.info("parallel prefill failed", extra={"session_id": self.state.rec.session_id,
                                                       "code": e.code().name})
            return
        self._target_prefilled(held)

    def target_kv(self, replica):
        """When the draft must take in a long context and it is the int8 copy of the target's own weights (equal kv
        fingerprints), the target prefills first and hands over its KV: the draft installs it instead of
        prefilling (its int8 prefill costs about twice the target's per token, and under load the prompts were half
        its work). The KvBlock, or None where that does not apply or the target failed (the draft then prefills as
        before)."""
        state, rec = self.state, self.state.rec
        fingerprint = state.backends.target_kv_fingerprint
        info = replica.info
        if (state.cfg.draft_prefill != "target-kv" or not fingerprint or info is None
                or info.kv_fingerprint != fingerprint or not self._draft_lags(replica)):
            return None
        target = state.target_replica()
        if target is None:
            return None
        t0 = time.perf_counter()
        try:
            with telemetry.call_attributes(session_id=rec.session_id):
                reply = target.client.prefill(rec.session_id, rec.committed[:-1],
                                                      min(rec.target_pos, len(rec.committed) - 1),
                                                      state.cfg.target_timeout_s, export_kv=True,
                                                      prompt_len=len(rec.prompt_ids))
        except grpc.RpcError as e:  # the Verify resends what the target lacks; the draft prefills itself
            log.info("target prefill for the draft's KV failed", extra={"session_id": rec.session_id,
                                                                         "code": e.code().name})
            return None
        finally:  # the step waits for it: neither drafting nor verifying (the stats' overhead must not hold it)
            rec.stats.prefill_ms += (time.perf_counter() - t0) * 1e3
        self._target_prefilled(reply.cached_len)
        if not reply.HasField("kv") or not 1 <= reply.kv.length < len(rec.committed):
            return None
        rec.stats.kv_imports += 1
        return reply.kv

    def _target_prefilled(self, held: int) -> None:
        """A Prefill left the target holding `held` tokens: the next call sends only the rest."""
        if held <= len(self.state.rec.committed):
            self.state.rec.target_pos = held
