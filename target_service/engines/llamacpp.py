"""llama.cpp as the target's engine (`specdec serve target --engine llamacpp`): the GGUF runs in llama.cpp's own
quantized CPU kernels instead of being dequantized to float32 for PyTorch.

One llama context holds every session: a session is a sequence (seq_id) with its own KV stream of
`llama_session_context` cells (llama_kv_unified off), so its logits do not depend on the other sessions;
llama_kv_unified shares one pool of cells (needed for trees, not batch-invariant). The cache is sized for
`max_sessions` sessions within a memory budget (llama_cache.py). The settings are the target's (TargetSettings).

Continuous batching: one engine thread runs a step loop (llama_steps.py). Every session with work in flight adds
its next rows to the step's single llama_decode: a decode stream its last sampled token, a Verify its context delta
and draft block (the verdict is specdec.core.sampling's, the rejected positions leave the sequence with
llama_memory_seq_rm), a prefill a bounded piece of its prompt. New work joins at the next step; nothing waits for a
batching window. Target-only decoding is the same row a Verify of an empty block has, so it gives the same tokens.
A session's prompt (its length comes with the delta) is computed in a second, float16 *prompt context* in llama.cpp's
fast tiled kernel and moved into the session's sequence (llama_prompt.py)."""

from __future__ import annotations

import ctypes
import functools
import heapq
import logging
import pathlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.core import sampling
from specdec.core import tree
from specdec.core.kv_cache import CacheMiss, ContextTooLong
from specdec.core.settings import LONG_DRAFT_LEN
from specdec.models import eos_token_ids, load_tokenizer, tokenizer_fingerprint
from target_service.engines.llama_cache import plan_cache
from target_service.engines.llama_prompt import PROMPT_KV_BYTES_PER_VALUE, PromptPath
from specdec.core.grpc_util import call_deadline
from target_service.engines.jobs import DecodeTask, VerifyJob, VerifyOutcome, VerifyTask
from target_service.engines.llama_steps import (SPLIT_SAFE_ROWS, CallWork, DecodeWork, PrefillWork, StepLoop,
                                                VerifyWork, Work, _by_sequence, _chunk_bounds)
from target_service.engines.profile import cpu_engine_profile
from target_service.settings import TargetSettings

log = logging.getLogger("specdec.target.llamacpp")

INSTALL_HINT = "pip install llama-cpp-python (a one-time native build of a few minutes)"
MAX_TREE_LEAVES = 64  # the target service's tree limit (TargetServicer.MAX_TREE_NODES): one scratch sequence each


def import_llama_cpp():
    """The llama_cpp module, or ImportError saying how to install it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ImportError(f"the llama.cpp engine needs the llama_cpp module ({e}); {INSTALL_HINT}") from e
    return llama_cpp


@functools.lru_cache(maxsize=2)
def _tokenizer(gguf: str):
    """The GGUF's tokenizer and its fingerprint: read once per file and process (reading it from the GGUF takes
    seconds; engines of one process, tests' say, share it read-only)."""
    tok = load_tokenizer(gguf)
    return tok, tokenizer_fingerprint(tok)


@dataclass
class LlamaModelInfo:
    """GetInfo's view of the GGUF (the fields of specdec.models.LoadedModel the service reports)."""

    name: str
    vocab_size: int
    max_context: int
    eos_token_ids: list[int]
    fingerprint: str
    tokenizer: object
    device: str = "cpu"
    dtype: str = "gguf"
    kv_fingerprint: str = ""  # llama.cpp's KV layout is its own: no export to a PyTorch draft


# The main context's KV cache holds float16 keys and q8_0 values (34 bytes per 32, stored Hadamard-rotated by
# llama.cpp), so that a row's logits do not depend on the shape of its ubatch: with keys and values of different
# types llama.cpp's CPU flash attention runs every shape in its one-pass kernel, accumulating in float32 (float16 ones
# split a lone row's keys by thread and tile 64+ rows: up to 1.06 apart in the logits at a 1416-token context; see
# docs/engines.md, "Kernel shape", and tests/test_llamacpp_long_context.py). A prompt takes the fast tiled kernel in
# the float16 prompt context instead, whose cache then moves here (llama_prompt.py). SPLIT_SAFE_ROWS (llama_steps.py):
# a session's rows per llama_decode; with q8_0 values calls of 48 to 512 rows measured bitwise equal to one by one.
KV_BYTES_PER_VALUE = 2 + 34 / 32  # a float16 key and a q8_0 value per layer, kv head and head dimension


@dataclass
class _Sequence:
    session_id: str
    seq_id: int
    tokens: list[int] = field(default_factory=list)


class LlamaCppEngine(StepLoop, PromptPath):
    """The target_service.engines.base.TargetBackend interface on llama.cpp."""

    BATCH_TOKENS = 512  # rows of one llama_decode call (n_batch = n_ubatch)

    def __init__(self, model_path: str | pathlib.Path, settings: TargetSettings):
        """The target's settings (target_service/settings.py), read here: threads, max_sessions, llama_context (KV
        cells in all, 0 = enough for max_sessions sessions of llama_session_context and the profile's stream),
        llama_session_context, llama_kv_unified and max_cache_mb (the cache's plan: target_service/engines/
        llama_cache.py), max_draft_len (0: LONG_DRAFT_LEN), batch_window_ms and max_batch; settings.model names it."""
        llama_cpp = import_llama_cpp()
        self._ll = llama_cpp
        from llama_cpp import _logger

        _logger.set_verbose(False)  # llama.cpp's load chatter off; its errors still reach stderr
        llama_cpp.llama_backend_init()
        path = pathlib.Path(model_path)
        self._model = self._load_model(path)
        self._ctx = self._prompt_ctx = None
        self._prompt_slots, self._prompt_slot_used, self._prompt_slot = [[]], [0], 0  # llama_prompt.py
        try:
            session_context = self._plan_cache(settings)
            self._ctx = self._new_context(settings.threads)
            if not self.kv_unified:  # the unified pool is not batch-invariant anyway: its prompts take the main path
                self._prompt_ctx = self._new_prompt_context(settings.threads, session_context, self.prompt_slots)
        except BaseException:
            for ctx in (self._ctx, self._prompt_ctx):
                if ctx:
                    llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(self._model)
            raise
        self._prompt_owner = None  # the work whose prompt the prompt context holds (llama_prompt.py)
        self.prompt_context_rows = 0  # prompt rows computed in the prompt context so far
        self.prompt_reused_rows = 0  # prompt rows a kept prompt gave instead
        self.prompt_claims = 0
        self.threads = settings.threads  # llama.cpp's threads: all busy during a forward (the profile's guard)
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(self.batch_tokens, 0, 1 + MAX_TREE_LEAVES)  # a token's sequences
        self.loaded = self._describe(path, settings.model, session_context)
        self._lock = threading.RLock()  # a llama context is not thread-safe: every call into it holds this
        # Every llama_decode runs on the engine's one step-loop thread. llama.cpp's OpenMP build gives each calling
        # thread its own team of workers, and an idle team keeps spinning for a while: decodes arriving on the gRPC
        # server's many handler threads left earlier teams spinning on the cores the current one needs (2-thread
        # target, 2 cores: raw Decode RPCs ran at 0.64-0.75x a bare llama_decode loop from many threads, 0.94-0.97x
        # from this one). A decode stream's steps never leave that thread: no hand-off per token.
        self._compute_ident = None
        self._works: list[Work] = []  # in arrival order; a session's later work waits for its earlier one
        self._calls: list[CallWork] = []
        self._work_cond = threading.Condition()
        self._closing = False
        self._sequences: OrderedDict[str, _Sequence] = OrderedDict()  # LRU order
        # Sessions whose work is admitted (holding their sequence): never evicted for another session, so a stream
        # or a chunked prefill cannot lose its tokens between its steps.
        self._busy: set[str] = set()
        # Free sequence ids, a min-heap: sessions hold the lowest ids, so a step's sessions are mostly consecutive
        # ids, which llama.cpp's split of a batch over per-session streams (split_equal, sequential) needs to put
        # them in one ubatch (see _by_sequence).
        self._free_ids = list(range(self.max_sessions + 1))
        self.evictions = 0
        self.max_draft_len = settings.max_draft_len or LONG_DRAFT_LEN
        self.forward_ms: list[float] = []
        # The step loop batches every session's work continuously; batch_window_ms > 0 only says this target is
        # meant to serve many sessions at once (the orchestrator's admission and goodput cost read max_batch).
        self.batcher = None
        batching, max_batch = settings.batch_window_ms > 0, settings.max_batch
        self.max_batch = max_batch if batching else 1
        self.step_sessions = max(1, max_batch) if batching else max(16, max_batch)
        self.steps = 0  # llama_decode steps of the loop, and the sessions' works they carried (batching metrics)
        self.step_works = 0
        self.step_rows = 0  # rows the steps fed, and the ubatches llama.cpp made of them (llama_steps.ubatch_count)
        self.step_ubatches = 0
        self.last_step_sessions = 0
        self._loop_thread = threading.Thread(target=self._step_loop, name="llama-compute", daemon=True)
        self._loop_thread.start()
        if self._prompt_ctx:
            self._on_compute(self._check_prompt_context)
        log.info("llama.cpp engine: %s, %d threads, %d sessions in %d KV cells", path.name, settings.threads,
                 self.max_sessions, self.context_tokens)

    def _load_model(self, path: pathlib.Path):
        """The GGUF's weights (on the CPU), and what the cache is sized from: the vocabulary and a token's KV bytes."""
        llama_cpp = self._ll
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} not found")
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise ValueError(f"llama.cpp could not load {path}")
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(model))
        head_dim = llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)
        self._n_layer = int(llama_cpp.llama_model_n_layer(model))
        values = self._n_layer * llama_cpp.llama_model_n_head_kv(model) * head_dim  # a token's, per K or V
        self.kv_bytes_per_token = int(KV_BYTES_PER_VALUE * values)
        self.prompt_kv_bytes_per_token = int(PROMPT_KV_BYTES_PER_VALUE * values)
        return model

    def _plan_cache(self, settings: TargetSettings) -> int:
        """Size the KV cache (llama_cache.plan_cache): sessions, cells, and the tree scratch sequences; returns a
        session's context."""
        kv_unified = settings.llama_kv_unified
        # Sequence ids: the sessions', one for the profile (it never evicts a session), and on the unified cache
        # a tree's scratch ones.
        self._reserved = 1 + (MAX_TREE_LEAVES if kv_unified else 0)
        asked_context = min(self._n_ctx_train, settings.llama_session_context)
        # the prompt context's streams of a session's context (float16 keys and values) come out of the budget:
        # one, and the kept prompts' within a quarter of it (sessions' streams come first)
        slot_mib = -(-asked_context * self.prompt_kv_bytes_per_token // (1 << 20))
        self.keep_prompts = settings.llama_prompt_cache > 0
        self.prompt_slots = max(1, min(settings.llama_prompt_cache, settings.max_cache_mb // 4 // slot_mib))
        prompt_mib = 0 if kv_unified else slot_mib * self.prompt_slots
        plan = plan_cache(settings.max_sessions, asked_context, cell_bytes=self.kv_bytes_per_token,
                          budget_mib=max(1, settings.max_cache_mb - prompt_mib), context_cells=settings.llama_context,
                          reserved_sequences=self._reserved,
                          max_sequences=int(self._ll.llama_max_parallel_sequences()), unified=kv_unified)
        if plan.shortfall:
            prompt_note = (f" ({prompt_mib} MiB of --max-cache-mb {settings.max_cache_mb} hold the prompt context, the "
                           "rest the sessions' streams)") if prompt_mib else ""
            log.warning(plan.describe(settings.max_sessions, asked_context) + prompt_note)
        self.cache_plan = plan
        self.max_sessions = plan.sessions
        if kv_unified:
            # One pool of cells for all: a session's cells land wherever others left holes, which changes the
            # attention's summation order, so greedy output can differ with the cache's history.
            self._scratch_ids = list(range(self.max_sessions + 1, self.max_sessions + 1 + MAX_TREE_LEAVES))
        else:
            # Each sequence its own stream of session_context cells, filled from cell 0 in position order: a
            # session's logits do not depend on the other sessions (batch-invariant greedy output). No tree
            # scratch streams.
            self._scratch_ids = []
        self.kv_unified = kv_unified
        self.context_tokens = plan.cells
        self.batch_tokens = self.BATCH_TOKENS
        return min(self._n_ctx_train, plan.session_context)

    def _new_context(self, threads: int):
        """The llama context the plan sized (every KV cell allocated now)."""
        cparams = self._ll.llama_context_default_params()
        cparams.n_seq_max = self.cache_plan.sessions + self._reserved
        cparams.n_ctx = self.context_tokens
        cparams.n_batch = cparams.n_ubatch = self.batch_tokens
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = self.kv_unified
        cparams.flash_attn_type = self._ll.LLAMA_FLASH_ATTN_TYPE_ENABLED  # quantized values need it
        cparams.type_k, cparams.type_v = self._ll.GGML_TYPE_F16, self._ll.GGML_TYPE_Q8_0  # see KV_BYTES_PER_VALUE
        cparams.no_perf = True
        ctx = self._ll.llama_init_from_model(self._model, cparams)
        if not ctx:
            raise MemoryError(f"llama.cpp could not create a context of {self.context_tokens} tokens "
                              f"({self.context_tokens * self.kv_bytes_per_token >> 20} MiB of KV cache)")
        return ctx

    def _describe(self, path: pathlib.Path, name: str, session_context: int) -> LlamaModelInfo:
        """GetInfo's view of the model: its tokenizer (read from the GGUF), end tokens and context."""
        llama_cpp = self._ll
        tok, fingerprint = _tokenizer(str(path))
        eos = eos_token_ids(None, tok)
        for special in (llama_cpp.llama_vocab_eos(self._vocab), llama_cpp.llama_vocab_eot(self._vocab)):
            if 0 <= special and special not in eos:
                eos.append(int(special))
        desc = ctypes.create_string_buffer(128)
        llama_cpp.llama_model_desc(self._model, desc, len(desc))
        return LlamaModelInfo(
            name=name, vocab_size=self._n_vocab,
            max_context=min(session_context, int(llama_cpp.llama_n_ctx_seq(self._ctx))),
            eos_token_ids=eos, fingerprint=fingerprint, tokenizer=tok,
            dtype="llama.cpp " + desc.value.decode(errors="replace"))

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    def _on_compute(self, fn, *args):
        """fn(*args) on the step-loop thread: at once when already there, else run between two steps and waited for."""
        if threading.get_ident() == self._compute_ident:
            return fn(*args)
        call = CallWork(fn, args)
        with self._work_cond:
            if self._closing:
                raise RuntimeError("the llama.cpp engine is closed")
            self._calls.append(call)
            self._work_cond.notify()
        return call.wait()

    def _enqueue(self, works: list[Work]) -> None:
        """Hand works to the step loop; given together, they join the same step."""
        with self._work_cond:
            if self._closing:
                raise RuntimeError("the llama.cpp engine is closed")
            self._works.extend(works)
            self._work_cond.notify()

    def close(self) -> None:
        with self._work_cond:
            self._closing = True
            self._work_cond.notify()
        if threading.current_thread() is not self._loop_thread:
            self._loop_thread.join(timeout=60)
        with self._lock:
            if self._ctx:
                self._ll.llama_batch_free(self._batch)
                self._ll.llama_free(self._ctx)
                if self._prompt_ctx:
                    self._ll.llama_free(self._prompt_ctx)
                self._ll.llama_model_free(self._model)
                self._ctx = self._prompt_ctx = self._model = None

    # ----- sessions (call with self._lock held) -----

    def _sequence(self, session_id: str, keep=()) -> _Sequence:
        """The session's sequence, a new one if it has none; `keep`: sessions that must not be evicted for it (the
        others in the same batch: a reused sequence id would merge two sessions' tokens)."""
        seq = self._sequences.get(session_id)
        if seq is not None:
            self._sequences.move_to_end(session_id)
            return seq
        if len(self._sequences) >= self.max_sessions and not self._evict(keep=keep):
            raise MemoryError(f"all {self.max_sessions} KV streams of the llama.cpp engine are held by sessions with "
                              "work in flight (in this step, a decode stream or a prefill)")
        seq = _Sequence(session_id, heapq.heappop(self._free_ids))
        self._sequences[session_id] = seq
        return seq

    def _evict(self, keep) -> bool:
        """Drop the least recently used session not in `keep`; False when there is none."""
        victim = next((sid for sid in self._sequences if sid not in keep and sid not in self._busy), None)
        if victim is None:
            return False
        self._drop(victim)
        self.evictions += 1
        log.info("evicted session cache", extra={"session_id": victim})
        return True

    def _drop(self, session_id: str) -> bool:
        seq = self._sequences.pop(session_id, None)
        if seq is None:
            return False
        self._ll.llama_memory_seq_rm(self._mem, seq.seq_id, -1, -1)
        heapq.heappush(self._free_ids, seq.seq_id)
        return True

    def _crop(self, seq: _Sequence, length: int) -> None:
        if length < len(seq.tokens):
            if not self._ll.llama_memory_seq_rm(self._mem, seq.seq_id, length, -1):
                raise RuntimeError(f"llama.cpp could not crop session {seq.session_id} to {length} tokens")
            del seq.tokens[length:]

    def _sync(self, seq: _Sequence, prefix_len: int, delta: list[int]) -> list[int]:
        """Crop to prefix_len and return the tokens to feed next (never empty): as CachedLM.sync."""
        if prefix_len > len(seq.tokens):
            raise CacheMiss(seq.session_id, len(seq.tokens), prefix_len)
        self._crop(seq, prefix_len)
        if not delta:
            if not seq.tokens:
                raise ValueError("no tokens: the context is empty")
            delta = [seq.tokens[-1]]  # its logits are not kept: feed it again
            self._crop(seq, len(seq.tokens) - 1)
        return list(delta)

    def _forward(self, rows: list[tuple[_Sequence, list[int], int]]) -> list[np.ndarray]:
        """Append each row's tokens to its sequence in as few llama_decode calls as the batch size allows;
        returns each row's logits for its last n_logits tokens, float32 [n_logits, vocab] (see _decode)."""
        for seq, tokens, _ in rows:
            if len(seq.tokens) + len(tokens) > self.loaded.max_context:
                raise ContextTooLong(f"context of {len(seq.tokens) + len(tokens)} tokens exceeds the limit of "
                                     f"{self.loaded.max_context}")
        self._make_room(sum(len(tokens) for _, tokens, _ in rows), keep={seq.session_id for seq, _, _ in rows})
        order = _by_sequence([seq.seq_id for seq, _, _ in rows])
        rows = [rows[i] for i in order]
        entries = [((seq.seq_id,), token, len(seq.tokens) + i, i >= len(tokens) - n_logits)
                   for seq, tokens, n_logits in rows for i, token in enumerate(tokens)]
        logits = self._decode(entries, [(seq.seq_id, len(seq.tokens)) for seq, _, _ in rows],
                              [len(tokens) for _, tokens, _ in rows])
        for seq, tokens, _ in rows:
            seq.tokens.extend(tokens)
        result, at = [None] * len(rows), 0
        for i, (_, _, n_logits) in zip(order, rows):
            result[i] = logits[at:at + n_logits]
            at += n_logits
        return result

    def _make_room(self, need: int, keep) -> None:
        if not self.kv_unified:
            return  # each session's stream holds its max_context: only the session count is bounded
        while sum(len(s.tokens) for s in self._sequences.values()) + need > self.context_tokens:
            if not self._evict(keep=keep):
                raise MemoryError(f"llama.cpp KV cache of {self.context_tokens} tokens is full")

    def _decode(self, entries, rollback, group_sizes=None) -> np.ndarray:
        """llama_decode `entries` (sequence ids, token, position, logits wanted) in order, batch by batch;
        returns the wanted logits rows, float32 [n, vocab]. On the compute thread (the engine's own calls, which
        use the rows before their next llama_decode) the last call's rows are llama.cpp's buffer, not a copy of
        49152 floats a token; a caller elsewhere gets copies. `group_sizes`: the entries' sessions, in order (None:
        one); see _chunk_bounds. On failure every (seq_id, start) in `rollback` is cut back to `start` (a failed
        decode may keep some of its ubatches) and the error raised."""
        out: list[np.ndarray] = []
        batch = self._batch
        try:
            bounds = _chunk_bounds(group_sizes or [len(entries)], self.batch_tokens)
            view = threading.get_ident() == self._compute_ident
            for lo, hi in bounds:
                chunk = entries[lo:hi]
                n_out = 0
                for j, (seq_ids, token, pos, want) in enumerate(chunk):
                    batch.token[j] = token
                    batch.pos[j] = pos
                    batch.n_seq_id[j] = len(seq_ids)
                    for k, seq_id in enumerate(seq_ids):
                        batch.seq_id[j][k] = seq_id
                    batch.logits[j] = want
                    n_out += want
                batch.n_tokens = len(chunk)
                rc = self._on_compute(self._ll.llama_decode, self._ctx, batch)
                if rc == 1:
                    raise MemoryError("llama.cpp found no KV cache slot for the batch")
                if rc != 0:
                    raise RuntimeError(f"llama_decode failed (code {rc})")
                if n_out:
                    rows = np.ctypeslib.as_array(self._ll.llama_get_logits(self._ctx), shape=(n_out, self._n_vocab))
                    out.append(rows if view and hi == bounds[-1][1] else rows.copy())  # the next call overwrites
        except BaseException:
            for seq_id, start in rollback:
                self._ll.llama_memory_seq_rm(self._mem, seq_id, start, -1)
            raise
        return np.concatenate(out) if len(out) > 1 else out[0] if out else np.zeros((0, self._n_vocab), np.float32)

    # ----- the TargetBackend interface -----

    DEFAULT_WAIT_S = 60.0  # how long a call without a deadline waits for its work

    @staticmethod
    def _wait_s() -> tuple[float | None, float]:
        """(the calling RPC's deadline, time.monotonic(); None without one, how long to wait for the work)."""
        deadline = call_deadline()
        now = time.monotonic()
        return deadline, (LlamaCppEngine.DEFAULT_WAIT_S if deadline is None else max(0.0, deadline - now))

    def prefill(self, session_id: str, prefix_len: int, delta: list[int], prompt_len: int = 0) -> int:
        deadline, wait = self._wait_s()
        work = PrefillWork(session_id, prefix_len, delta, deadline, prompt_len)
        self._enqueue([work])
        return work.result(wait)

    def verify(self, task: VerifyTask) -> VerifyOutcome:
        job = task.job()
        self.verify_many([job])
        return job.outcome()

    def verify_many(self, jobs: list[VerifyJob]) -> None:
        """Several sessions' blocks, joining the next engine step together (a tree: a llama_decode of its own);
        each job gets its outcome or its error."""
        deadline, wait = self._wait_s()
        chains = []
        for job in jobs:
            if job.task.tree_parents is not None:
                self._on_compute(self._verify_tree, job)
                job.done.set()
            else:
                job.deadline = job.deadline or deadline
                chains.append(VerifyWork(job))
        if not chains:
            return
        self._enqueue(chains)
        end = time.monotonic() + wait
        for work in chains:
            if not work.job.done.wait(max(0.0, end - time.monotonic())):
                work.cancelled = True
                work.job.error = TimeoutError("the target was busy: this step did not get its turn before the "
                                              "call's deadline")

    def _verify_tree(self, job: VerifyJob) -> None:
        """A token tree in one llama_decode. Each leaf gets a scratch sequence, a copy of the session's (its cells
        tagged, not duplicated); a node belongs to the scratch sequences of the leaves below it, the first of
        them leading. llama.cpp shows a token the cells of its leading sequence up to its position: the context
        and the node's ancestors, exactly the tree mask. The accepted path's cells are then tagged with the
        session's sequence and the scratch sequences dropped."""
        t0 = time.perf_counter()
        task = job.task
        with self._lock:
            try:
                parents = tree.check_parents(task.tree_parents, len(task.draft_tokens))
                kids, depth = tree.children(parents), tree.depths(parents)
                leaves = [i for i in range(len(parents)) if not kids[i + 1]]
                if not self.kv_unified:
                    raise ValueError("tree verification needs the llama.cpp engine's unified KV cache "
                                     "(kv_unified, not batch-invariant); send a chain draft")
                if len(leaves) > len(self._scratch_ids):
                    raise ValueError(f"a tree of {len(leaves)} leaves exceeds this engine's {MAX_TREE_LEAVES}")
                seq = self._sequence(task.session_id, keep=self._busy)
                new = self._sync(seq, task.prefix_len, task.delta)
                context_len = len(seq.tokens) + len(new)
                if context_len + max(depth, default=-1) + 1 > self.loaded.max_context:
                    raise ContextTooLong(f"context of {context_len + max(depth) + 1} tokens exceeds the limit of "
                                         f"{self.loaded.max_context}")
                self._make_room(len(new) + len(parents), keep={seq.session_id})
            except Exception as e:  # noqa: BLE001 - reported to this job's caller
                job.error = e
                return
            scratch = dict(zip(leaves, self._scratch_ids))
            below: list[list[int]] = [[] for _ in parents]  # node -> the scratch sequences of its leaves
            for i in reversed(range(len(parents))):  # children come after their parent
                below[i] = [scratch[i]] if i in scratch else [s for c in kids[i + 1] for s in below[c]]
            start = len(seq.tokens)
            for sid in scratch.values():
                self._ll.llama_memory_seq_cp(self._mem, seq.seq_id, sid, -1, -1)
            entries = [((seq.seq_id, *scratch.values()), t, start + j, j == len(new) - 1) for j, t in enumerate(new)]
            entries += [(tuple(below[i]), t, context_len + depth[i], True) for i, t in enumerate(task.draft_tokens)]
            try:
                logits = self._decode(entries, [(seq.seq_id, start)])
                seq.tokens.extend(new)
                gen = None if task.params.is_greedy else sampling.make_generator(task.seed, task.step, "verify")
                # Row 0: the root (after the last context token); row i + 1: after node i.
                result = sampling.verify_tree(torch.from_numpy(logits), task.draft_tokens, parents, task.draft_probs,
                                              task.params, gen)
                if result.path:  # the path's positions of a leaf below its last node: the accepted path
                    self._ll.llama_memory_seq_cp(self._mem, below[result.path[-1]][0], seq.seq_id, context_len,
                                                 context_len + len(result.path))
                    seq.tokens.extend(task.draft_tokens[i] for i in result.path)
                job.result = VerifyOutcome(result.num_accepted, int(result.next_token), len(seq.tokens),
                                           (time.perf_counter() - t0) * 1e3, 1, tuple(result.path))
            except Exception as e:  # noqa: BLE001
                self._crop(seq, min(context_len, len(seq.tokens)))
                job.error = e
            finally:
                for sid in scratch.values():
                    self._ll.llama_memory_seq_rm(self._mem, sid, -1, -1)

    def decode_stream(self, task: DecodeTask) -> DecodeWork:
        """Start target-only decoding of up to max_tokens tokens; the engine decodes on, one row per step, while the
        caller takes the tokens in blocks (DecodeWork.take) or stops it (DecodeWork.cancel)."""
        deadline, _ = self._wait_s()
        work = DecodeWork(task, deadline)
        self._enqueue([work])
        return work

    def decode(self, task: DecodeTask) -> tuple[list[int], int, float]:
        t0 = time.perf_counter()
        _, wait = self._wait_s()
        work = self.decode_stream(task)
        end, tokens = time.monotonic() + wait, []
        try:
            while True:  # one take unless an error follows some tokens (then the next take raises it)
                block = work.take(task.max_tokens, max(0.0, end - time.monotonic()))
                tokens += block.tokens
                if block.finished:
                    return tokens, block.cached_len, (time.perf_counter() - t0) * 1e3
        except BaseException:
            work.cancel()
            raise

    def release(self, session_id: str) -> bool:
        with self._lock:
            for work in list(self._works):  # a work still holding the session's sequence stops with it
                if work.session_id == session_id and work.seq is not None and not work.done:
                    work.fail(ValueError(f"session {session_id} was released"))
                    self._busy.discard(session_id)
                    work.seq = None
            return self._drop(session_id)

    def export_kv(self, session_id: str, max_bytes: int) -> None:
        return None  # llama.cpp's cache layout is not the wire's (loaded.kv_fingerprint is empty)

    def profile_forward_ms(self, max_tokens: int, context: int = 32, reps: int = 3) -> list[float]:
        """As TargetEngine.profile_forward_ms: one forward over n tokens with logits for all n, after `context`."""
        return self._on_compute(self._profile_forward_ms, max_tokens, context, reps)

    def _profile_forward_ms(self, max_tokens: int, context: int, reps: int) -> list[float]:
        vocab = self._n_vocab
        with self._lock:
            seq = _Sequence("\x00profile", heapq.heappop(self._free_ids))  # the spare sequence: no session is evicted
            try:
                self._forward([(seq, [(7 * i + 1) % vocab for i in range(context)], 1)])

                def forward_ms(n: int) -> float:
                    t0 = time.perf_counter()
                    self._forward([(seq, [(3 * j + 2) % vocab for j in range(n)], n)])
                    dt = (time.perf_counter() - t0) * 1e3
                    self._crop(seq, context)
                    return dt

                return cpu_engine_profile(forward_ms, max_tokens, reps, threads=self.threads)
            finally:
                self._ll.llama_memory_seq_rm(self._mem, seq.seq_id, -1, -1)
                heapq.heappush(self._free_ids, seq.seq_id)

    def cache_bytes(self) -> int:
        with self._lock:
            return self.kv_bytes_per_token * sum(len(s.tokens) for s in self._sequences.values())

    def cached_sessions(self) -> int:
        with self._lock:
            return len(self._sequences)

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sequences
