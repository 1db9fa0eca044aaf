"""The llama.cpp engine's prompt path: a session's prompt computed in llama.cpp's fast tiled flash-attention kernel,
then handed to the engine's main context, whose tokens after the prompt all take the one-pass kernel.

The main context keeps float16 keys and q8_0 values, which takes every row (a target-only step, a verify block,
rows beside other sessions') through the one-pass kernel: bitwise the same logits however a step is composed
(docs/engines.md, "Kernel shape"). That kernel is slow on long prompts: each row runs over all its keys one at a
time. A second context, the *prompt context* (one sequence, float16 keys and values, as plain llama.cpp's cache),
computes a prompt in calls of at least PROMPT_TILE_ROWS rows of the one sequence, which llama.cpp computes in tiles,
each row's result a function of its own query and keys alone (not of the other rows of its call). The sequence's
keys and values then move to the session's sequence in the main context (llama_state_seq_get_data / set_data),
the values rounded to q8_0 on the way.

What goes which way is a function of the session's tokens and its prompt length only (prompt_region), so a
session's cache is the same whichever calls brought its tokens, and a context resent after an eviction or a move
to another target (the orchestrator sends the prompt length with every delta) is rebuilt bit for bit.

The prompt context keeps the last `--llama-prompt-cache` prompts it computed, a stream each (LRU). A prompt that
starts with one of them continues from the longest common prefix (reused_prefix) and computes only the rest: each
row is a function of its own query and keys, so the reused rows are those the prompt would compute itself."""

from __future__ import annotations

import ctypes
import logging
import struct

import numpy as np

from specdec.core.kv_cache import ContextTooLong

log = logging.getLogger("specdec.target.llamacpp")

# llama.cpp's CPU flash attention (llama-cpp-python 0.3.36) computes a call's rows in tiles when a sequence has at
# least this many rows in it (GGML_FA_TILE_Q) and keys and values are of one float type.
PROMPT_TILE_ROWS = 64
PROMPT_KV_BYTES_PER_VALUE = 2 + 2  # the prompt context's float16 key and value per layer, kv head and dimension
GGML_TYPE_F16, GGML_TYPE_Q8_0 = 1, 8
STATE_MAGIC, STATE_PREFIX = 0xAF143CD8, 8  # a sequence state's leading u32 magic and u32 version (0.3.36)
Q8_0_BLOCK, Q8_0_BLOCK_BYTES = 32, 34  # values per q8_0 block; a float16 scale and 32 int8
VALUE_ROTATION = 64  # llama.cpp stores quantized values rotated by a Hadamard matrix of this size (n_rot_v)


def prompt_region(prompt_len: int, cached: int, total: int, wants_logits: bool) -> int:
    """How many of a session's first positions the prompt context computes, for a call that holds `cached`
    tokens and will hold `total`: the prompt but its last token (whose row gives the first generated token's
    logits, as any later step's, in the main context), never the row a call wants logits of; 0 (all in the main
    context) when that leaves fewer than PROMPT_TILE_ROWS rows, or when the cache already holds the region."""
    end = min(prompt_len - 1, total - (1 if wants_logits else 0))
    if end < PROMPT_TILE_ROWS or cached >= end:
        return 0
    return end


def prompt_piece(left: int, limit: int, batch: int) -> int:
    """Rows of the next prompt-context call with `left` (>= PROMPT_TILE_ROWS) rows to go: at most `limit` where
    that leaves no remainder under PROMPT_TILE_ROWS rows, so every call takes the tiled kernel."""
    if left <= limit or (left < limit + PROMPT_TILE_ROWS and left <= batch):
        return left
    if left - limit >= PROMPT_TILE_ROWS:
        return limit
    return left - PROMPT_TILE_ROWS


def reused_prefix(cached: list[int], region: list[int]) -> int:
    """Rows of a prompt region (its tokens from position 0) that a kept prompt's `cached` tokens can give: their
    common prefix, less what leaves fewer than PROMPT_TILE_ROWS rows to compute (those would not take the tiled
    kernel); all of it when the region is wholly cached."""
    n = min(len(cached), len(region))
    common = next((i for i in range(n) if cached[i] != region[i]), n)
    if common == len(region):
        return common
    return max(0, min(common, len(region) - PROMPT_TILE_ROWS))


def quantize_q8_0(values: np.ndarray) -> np.ndarray:
    """[rows, n] floats -> [rows, n / 32 * 34] bytes of q8_0 blocks, as ggml's x86 quantize_row_q8_0: a float16
    scale amax / 127 and round-half-even(x * 127 / amax) per block of 32."""
    x = values.astype(np.float32).reshape(values.shape[0], -1, Q8_0_BLOCK)
    amax = np.abs(x).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    out = np.empty((x.shape[0], x.shape[1], Q8_0_BLOCK_BYTES), np.uint8)
    out[:, :, :2] = (amax / np.float32(127)).astype(np.float16).view(np.uint8)
    out[:, :, 2:] = np.rint(x * inv).astype(np.int8).view(np.uint8)
    return out.reshape(x.shape[0], -1)


def hadamard_rotated(values: np.ndarray) -> np.ndarray:
    """Each run of VALUE_ROTATION values times the orthonormal Walsh-Hadamard matrix, as llama.cpp rotates the
    values it stores quantized (llama-kv-cache.cpp, n_rot_v; the attention's output is rotated back): a butterfly of
    exact sums and differences, then the exact power-of-two scale."""
    x = values.astype(np.float32).reshape(-1, VALUE_ROTATION)
    h = 1
    while h < VALUE_ROTATION:
        x = x.reshape(x.shape[0], -1, 2, h)
        x = np.stack([x[:, :, 0] + x[:, :, 1], x[:, :, 0] - x[:, :, 1]], axis=2)
        h *= 2
    return (x.reshape(values.shape) * np.float32(VALUE_ROTATION ** -0.5)).astype(np.float32)


def requantized_state(state: bytes, streams: int, n_layer: int) -> tuple[bytes, int]:
    """A sequence's state from the prompt context (float16 keys and values) as the main context reads it, and its
    cells: `streams` streams (the sequence's cells in the first, read into the destination sequence's own), the
    values as q8_0. Format (llama-kv-cache.cpp state_write): u32 streams; per stream u32 cells (0 for the streams
    that do not hold the sequence), then per cell i32 pos, u32 n_seq_id (1), i32 seq_id; then u32 v_trans, u32
    n_layer (and in newer llama.cpp two u32 rotation counts); per layer i32 key type, u64 row bytes, the rows; the
    same for the values. llama-cpp-python 0.3.36 puts a u32 magic and a u32 version before it (STATE_PREFIX), kept
    as they are."""
    prefix = STATE_PREFIX if struct.unpack_from("<I", state, 0)[0] == STATE_MAGIC else 0
    (n_stream,), at = struct.unpack_from("<I", state, prefix), prefix + 4
    held = 0  # the stream holding the sequence's cells
    while held < n_stream - 1 and struct.unpack_from("<I", state, at)[0] == 0:
        held, at = held + 1, at + 4
    (cells,) = struct.unpack_from("<I", state, at)
    rows_end = len(state) - 4 * (n_stream - 1 - held)  # the empty streams after it
    if not cells or state[rows_end:] != bytes(len(state) - rows_end):
        raise ValueError(f"the prompt context's state does not hold one stream's cells ({n_stream} streams)")
    meta_end = at + 4 + 12 * cells
    row = _row_bytes(state, rows_end, meta_end, cells, n_layer)
    header_end = rows_end - 2 * n_layer * (12 + cells * row)
    v_trans, layers = struct.unpack_from("<II", state, meta_end)
    if v_trans or layers != n_layer:
        raise ValueError(f"unexpected prompt state: v_trans {v_trans}, {layers} layers (expected {n_layer})")
    out = [state[:prefix], struct.pack("<II", streams, cells), state[at + 4:header_end]]
    at = header_end
    for section in range(2 * n_layer):
        kind, size = struct.unpack_from("<iQ", state, at)
        if kind != GGML_TYPE_F16 or size != row:
            raise ValueError(f"unexpected prompt state section: type {kind}, row {size} bytes")
        body = state[at + 12: at + 12 + cells * row]
        if section < n_layer:  # keys: float16 in both contexts
            out += [state[at: at + 12], body]
        else:
            q8 = quantize_q8_0(hadamard_rotated(np.frombuffer(body, np.float16).reshape(cells, row // 2)))
            out += [struct.pack("<iQ", GGML_TYPE_Q8_0, q8.shape[1]), q8.tobytes()]
        at += 12 + cells * row
    out.append(b"\0\0\0\0" * (streams - 1))  # the other streams: no cells
    return b"".join(out), cells


def _row_bytes(state: bytes, end: int, meta_end: int, cells: int, n_layer: int) -> int:
    """Bytes of one cell's key row (float16, equal to its value row): the first key section's header says it."""
    for header in (8, 16):  # u32 v_trans, u32 n_layer (+ two u32 rotation counts in newer llama.cpp)
        at = meta_end + header
        if at + 12 > end:
            break
        kind, size = struct.unpack_from("<iQ", state, at)
        if kind == GGML_TYPE_F16 and at + 2 * n_layer * (12 + cells * size) == end:
            return size
    raise ValueError("the prompt context's state is not in a known llama.cpp layout")


def first_layer_values(state: bytes, n_layer: int, values: int) -> np.ndarray:
    """The first layer's values of the first stream holding cells in a sequence state (float16 or q8_0; the layout
    of requantized_state), as float32 [cells, values]."""
    prefix = STATE_PREFIX if struct.unpack_from("<I", state, 0)[0] == STATE_MAGIC else 0
    (streams,), at = struct.unpack_from("<I", state, prefix), prefix + 4
    cells = 0
    for _ in range(streams):
        (cells,), at = struct.unpack_from("<I", state, at), at + 4
        if cells:
            break
    at += 12 * cells
    at += next(h for h in (8, 16) if struct.unpack_from("<iQ", state, at + h) == (GGML_TYPE_F16, 2 * values))
    for _ in range(n_layer):  # the keys
        at += 12 + cells * struct.unpack_from("<iQ", state, at)[1]
    kind, row = struct.unpack_from("<iQ", state, at)
    body = np.frombuffer(state, np.uint8, cells * row, at + 12).reshape(cells, row)
    if kind == GGML_TYPE_F16:
        return body.view(np.float16).astype(np.float32)
    blocks = body.reshape(cells, -1, Q8_0_BLOCK_BYTES)
    scale = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)
    return (scale * blocks[:, :, 2:].view(np.int8).astype(np.float32)).reshape(cells, -1)


def sequence_state(ll, ctx, seq_id: int) -> bytes:
    size = ll.llama_state_seq_get_size(ctx, seq_id)
    buf = (ctypes.c_uint8 * size)()
    got = ll.llama_state_seq_get_data(ctx, buf, size, seq_id)
    if got != size:
        raise RuntimeError(f"llama.cpp wrote {got} of sequence {seq_id}'s {size} state bytes")
    return bytes(buf)


def move_sequence(ll, src_ctx, src_seq: int, dst_ctx, dst_seq: int, streams: int, n_layer: int) -> int:
    """Copy src_seq of the prompt context into dst_seq of the main context (whose earlier cells it replaces),
    values rounded to q8_0; returns the cells moved. The prompt context's sequence is left as it was."""
    state, cells = requantized_state(sequence_state(ll, src_ctx, src_seq), streams, n_layer)
    src = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    if ll.llama_state_seq_set_data(dst_ctx, src, len(state), dst_seq) != len(state):
        raise RuntimeError(f"llama.cpp could not take the prompt's {cells} cells into sequence {dst_seq}")
    return cells


class PromptPath:
    """The prompt context's part of target_service.engines.llamacpp.LlamaCppEngine (which provides the contexts, the
    batch, _decode, _crop and the cache plan). Call with the engine's lock held, on its compute thread.

    `_prompt_slots[i]`: the tokens sequence i of the prompt context holds (a kept prompt, or the one being fed);
    `_prompt_slot`: the owner's; `_prompt_tokens`: that slot's list."""

    def _new_prompt_context(self, threads: int, session_context: int, slots: int):
        """The prompt context (llama_prompt.py): `slots` sequences of a session's context each, float16 keys and
        values."""
        cparams = self._ll.llama_context_default_params()
        cparams.n_seq_max = slots
        cparams.n_ctx = session_context * slots
        cparams.n_batch = cparams.n_ubatch = self.batch_tokens
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = False
        cparams.flash_attn_type = self._ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.type_k = cparams.type_v = self._ll.GGML_TYPE_F16
        cparams.no_perf = True
        ctx = self._ll.llama_init_from_model(self._model, cparams)
        if not ctx:
            raise MemoryError(f"llama.cpp could not create the prompt context of {slots} x {session_context} tokens")
        self._prompt_slots: list[list[int]] = [[] for _ in range(slots)]
        self._prompt_slot_used = [0] * slots  # LRU stamps
        self._prompt_slot = 0
        return ctx

    @property
    def _prompt_tokens(self) -> list[int]:
        return self._prompt_slots[self._prompt_slot]

    def _prompt_rows(self, seq, new: list[int], prompt_len: int, wants_logits: bool):
        """(the rows to feed, how many of the first go through the prompt context). A cache holding part of the
        prompt region only (an earlier call brought part of the prompt) is cropped and the region fed whole."""
        if self._prompt_ctx is None or prompt_len <= 0:
            return new, 0
        cached = len(seq.tokens)
        if cached + len(new) > self.loaded.max_context:
            raise ContextTooLong(f"context of {cached + len(new)} tokens exceeds the limit of "
                                 f"{self.loaded.max_context}")
        end = prompt_region(prompt_len, cached, cached + len(new), wants_logits)
        if not end:
            return new, 0
        if cached:
            new = seq.tokens + new
            self._crop(seq, 0)
        return new, end

    def _prompt_claim(self, work) -> None:
        """Give the prompt context to `work` (whose first prompt_rows rows are its prompt region, from position 0):
        the kept prompt sharing the longest usable prefix with it, cropped to that prefix, whose rows then count as
        fed; the least recently used slot, emptied, when none shares one."""
        region = work.rows[:work.prompt_rows]
        # A kept prompt is cut back to what it shares with the new one only where that is at least half of it (a
        # repeat, an earlier turn, a long common lead-in): a short shared lead-in (a chat template's system prompt)
        # would otherwise cut every kept prompt down to it.
        reuse = [r if 2 * r >= len(tokens) else 0
                 for r, tokens in ((reused_prefix(tokens, region), tokens) for tokens in self._prompt_slots)]
        slot = max(range(len(reuse)), key=lambda i: (reuse[i], self._prompt_slot_used[i]))
        if not reuse[slot]:
            slot = min(range(len(reuse)), key=lambda i: (bool(self._prompt_slots[i]), self._prompt_slot_used[i]))
        self._prompt_slot, self._prompt_owner = slot, work
        self.prompt_claims += 1
        self._prompt_slot_used[slot] = self.prompt_claims
        self._prompt_crop(reuse[slot])
        work.fed(reuse[slot])
        work.prompt_rows -= reuse[slot]
        self.prompt_reused_rows += reuse[slot]

    def _prompt_crop(self, length: int) -> None:
        """The owner's slot cut back to its first `length` tokens."""
        if length < len(self._prompt_tokens):
            mem = self._ll.llama_get_memory(self._prompt_ctx)
            if not self._ll.llama_memory_seq_rm(mem, self._prompt_slot, length, -1):
                raise RuntimeError(f"llama.cpp could not crop prompt slot {self._prompt_slot} to {length} tokens")
            del self._prompt_tokens[length:]

    def _decode_prompt(self, tokens: list[int], start: int) -> None:
        """llama_decode `tokens` at positions start.. of the owner's slot, no logits."""
        batch = self._batch
        for j, token in enumerate(tokens):
            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = token, start + j, 1, False
            batch.seq_id[j][0] = self._prompt_slot
        batch.n_tokens = len(tokens)
        rc = self._ll.llama_decode(self._prompt_ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode of a prompt piece failed (code {rc})")

    def _move_prompt(self, seq_id: int) -> None:
        """The owner's slot into the main context's seq_id (its values rotated and rounded to q8_0)."""
        moved = move_sequence(self._ll, self._prompt_ctx, self._prompt_slot, self._ctx, seq_id,
                              self.cache_plan.sessions + self._reserved, self._n_layer)
        if moved != len(self._prompt_tokens):
            raise RuntimeError(f"moved {moved} prompt cells, expected {len(self._prompt_tokens)}")

    def prompt_rows_reused(self) -> int:
        """Prompt rows a kept prompt gave since start (a gauge)."""
        return self.prompt_reused_rows

    def prompt_rows_computed(self) -> int:
        """Prompt rows the prompt context computed since start (a gauge)."""
        return self.prompt_context_rows

    def forget_prompts(self) -> int:
        """Empty every kept prompt no work is feeding (later prompts compute all their rows); returns how many."""
        def run() -> int:
            with self._lock:
                forgotten = 0
                for slot, tokens in enumerate(self._prompt_slots):
                    if tokens and not (self._prompt_owner is not None and slot == self._prompt_slot):
                        self._prompt_empty(slot)
                        forgotten += 1
                return forgotten

        return self._on_compute(run) if self._prompt_ctx else 0

    def _prompt_release(self) -> None:
        """No work holds the prompt context; what its slot holds stays for later prompts (with
        --llama-prompt-cache 0 it is emptied)."""
        if not self.keep_prompts and self._prompt_ctx:
            self._prompt_reset()
        self._prompt_owner = None

    def _prompt_reset(self) -> None:
        """Empty the owner's slot (a failed call may have left it in any state) and release it."""
        if self._prompt_ctx:
            self._prompt_empty(self._prompt_slot)
        self._prompt_owner = None

    def _prompt_empty(self, slot: int) -> None:
        self._ll.llama_memory_seq_rm(self._ll.llama_get_memory(self._prompt_ctx), slot, -1, -1)
        self._prompt_slots[slot].clear()

    def _check_prompt_context(self) -> None:
        """A token's first-layer values (a function of its embedding alone) moved from the prompt context against
        the main context's own: a llama.cpp whose state layout or value rotation is not the one llama_prompt.py
        writes fails this, and prompts then take the main context, with a warning. Runs before any session."""
        token, values = 1, self.prompt_kv_bytes_per_token // PROMPT_KV_BYTES_PER_VALUE // self._n_layer
        try:
            self._decode_prompt([token], 0)
            self._prompt_tokens.append(token)
            self._move_prompt(0)
            self._decode([((1,), token, 0, False)], [(1, 0)])
            moved, own = (first_layer_values(sequence_state(self._ll, self._ctx, s), self._n_layer, values)
                          for s in (0, 1))
            gap = float(np.abs(moved - own).max() / max(np.abs(own).max(), 1e-6))
            if gap > 0.05:
                raise ValueError(f"the values differ by {gap:.3g} of their largest")
        except (ValueError, RuntimeError, StopIteration, struct.error) as e:
            log.warning("llama.cpp prompt context off (prompts take the main context): moving a prompt's cache "
                        "into the main context failed its check (%s)", e)
            self._ll.llama_free(self._prompt_ctx)
            self._prompt_ctx = None
        finally:
            for seq_id in (0, 1):
                self._ll.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
            self._prompt_reset()
