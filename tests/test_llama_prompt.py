"""The llama.cpp engine's prompt path, the parts that need no model: which positions the prompt context computes,
how a prompt is cut into calls (every call at least PROMPT_TILE_ROWS rows, so every row takes the tiled kernel),
and the state conversion into the main context's layout (values rotated and rounded to q8_0)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from target_service.engines.llama_prompt import (PROMPT_TILE_ROWS, STATE_MAGIC, hadamard_rotated, prompt_piece,
                                                 prompt_region, quantize_q8_0, requantized_state)


@pytest.mark.parametrize("limit", [64, 96, 300, 512])
def test_a_prompt_is_cut_into_calls_of_at_least_the_tile_rows_within_the_batch(limit):
    for total in range(PROMPT_TILE_ROWS, 2100):
        left, pieces = total, []
        while left:
            pieces.append(prompt_piece(left, limit, 512))
            left -= pieces[-1]
        assert sum(pieces) == total
        assert all(PROMPT_TILE_ROWS <= p <= 512 for p in pieces), (total, pieces)
        assert all(p <= limit for p in pieces[:-2]), (total, pieces)  # only the last two may differ from the cap


def test_the_prompt_region_is_the_prompt_but_its_last_token_and_never_a_wanted_row():
    assert prompt_region(1416, 0, 1416, True) == 1415  # a Decode of the whole prompt: the last row in the main
    assert prompt_region(1416, 0, 1415, False) == 1415  # a Prefill of all but the last token
    assert prompt_region(1416, 0, 1415, True) == 1414  # ... that wants logits keeps its last row for the main
    assert prompt_region(1416, 0, 1500, False) == 1415  # a resync: the generated tokens go to the main context
    assert prompt_region(1416, 1415, 1420, True) == 0  # the region already cached
    assert prompt_region(1416, 700, 1420, True) == 1415  # part of it cached: fed whole again (the engine crops)
    assert prompt_region(64, 0, 64, True) == 0  # too short for a tile: all in the main context
    assert prompt_region(65, 0, 65, True) == PROMPT_TILE_ROWS
    assert prompt_region(1416, 0, 40, False) == 0  # a short first piece of a long prompt


def test_values_are_rotated_by_the_orthonormal_hadamard_matrix_per_64():
    h = np.array([[1.0]])
    while len(h) < 64:
        h = np.block([[h, h], [h, -h]])
    x = np.random.default_rng(0).standard_normal((7, 192)).astype(np.float32)
    expected = (x.reshape(7, 3, 64) @ (h / 8).T).reshape(7, 192)
    assert np.allclose(hadamard_rotated(x), expected, atol=1e-5)
    assert np.allclose(hadamard_rotated(hadamard_rotated(x)), x, atol=1e-5)  # its own inverse


def test_q8_0_blocks_hold_a_float16_scale_and_32_rounded_values():
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    q = quantize_q8_0(x)
    assert q.shape == (5, 2 * 34)
    blocks = q.reshape(5, 2, 34)
    scale = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)
    values = blocks[:, :, 2:].view(np.int8).astype(np.float32)
    assert np.abs(values).max() == 127
    assert np.abs(scale * values - x.reshape(5, 2, 32)).max() <= scale.max() / 2 + 1e-3


def synthetic_state(cells: int, n_layer: int, row_values: int, prefix: bool = True, held: int = 0,
                    streams: int = 1) -> bytes:
    """A float16 sequence state as llama-cpp-python 0.3.36 writes it: `streams` streams, the sequence's cells in
    stream `held`, the others empty."""
    out = [struct.pack("<II", STATE_MAGIC, 0)] if prefix else []
    out.append(struct.pack("<I", streams) + b"\0\0\0\0" * held + struct.pack("<I", cells))
    out += [struct.pack("<iIi", pos, 1, 0) for pos in range(cells)]
    out.append(struct.pack("<II", 0, n_layer))
    rng = np.random.default_rng(2)
    for _ in range(2 * n_layer):
        out.append(struct.pack("<iQ", 1, 2 * row_values))
        out.append(rng.standard_normal((cells, row_values)).astype(np.float16).tobytes())
    out.append(b"\0\0\0\0" * (streams - 1 - held))
    return b"".join(out)


def test_the_prompt_state_becomes_the_main_contexts_layout():
    cells, n_layer, values = 5, 2, 192
    state = synthetic_state(cells, n_layer, values)
    converted, moved = requantized_state(state, streams=4, n_layer=n_layer)
    assert moved == cells
    assert converted[:8] == state[:8]  # magic and the version kept
    assert struct.unpack_from("<II", converted, 8) == (4, cells)
    assert converted.endswith(b"\0" * 12)  # the three other streams hold no cells
    at = 16 + 12 * cells + 8
    for layer in range(2 * n_layer):
        kind, row = struct.unpack_from("<iQ", converted, at)
        assert (kind, row) == ((1, 384) if layer < n_layer else (8, 204))
        at += 12 + cells * row
    assert at == len(converted) - 12
    with pytest.raises(ValueError):
        requantized_state(state[:-1], streams=4, n_layer=n_layer)


def test_a_kept_prompts_state_from_any_stream_of_the_prompt_context_moves_the_same():
    """The prompt context keeps prompts in several streams: the sequence's cells sit in its own, the others empty."""
    cells, n_layer, values = 5, 2, 192
    one = requantized_state(synthetic_state(cells, n_layer, values), streams=4, n_layer=n_layer)
    for held in (0, 3, 7):
        assert requantized_state(synthetic_state(cells, n_layer, values, held=held, streams=8), streams=4,
                                 n_layer=n_layer) == one
    two_held = synthetic_state(cells, n_layer, values, held=0, streams=2)[:-4] + struct.pack("<I", cells)
    with pytest.raises(ValueError):  # cells in a second stream: not a state this code wrote
        requantized_state(two_held, streams=4, n_layer=n_layer)
