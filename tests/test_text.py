"""Incremental detokenisation (orchestrator/loop/text.py) equals decoding the whole sequence at every step."""

import random

import pytest

from orchestrator.loop.text import TextTracker
from specdec.models import load_tokenizer

SAMPLE = ("Speculative decoding: a draft proposes, the target verifies. Ça marche très bien — even for 中文文本, "
          "emoji 🚀🎉 and code: def f(x):\n    return x ** 2  # squares\n\n\tTabs, \"quotes\" , spaces before . and ,")


def _llama_style_tokenizer():
    """A small SentencePiece-like BPE (Metaspace, byte fallback, the leading space stripped at the start of a
    decode), trained here: a token's text depends on what precedes it."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>", *bytes_], show_progress=False)
    tk.train_from_iterator([SAMPLE.replace("🚀", "").replace("中文", "")] * 3, trainer)  # some characters stay bytes
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", clean_up_tokenization_spaces=True)


def _replay(tok, ids: list[int], rng: random.Random, take_back: bool = True) -> TextTracker:
    """Feed `ids` in random blocks (sometimes taking tokens back, as a stop string does) and compare each step."""
    tracker = TextTracker(tok, [])
    seen: list[int] = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, 5)
        seen = seen + ids[i : i + n]
        i += n
        if take_back and rng.random() < 0.1 and len(seen) > 2:
            seen = seen[:-1]
        want = tok.decode(seen, skip_special_tokens=True)
        assert tracker.decode(seen) == want, seen
        assert tracker.decode(seen) == want, seen  # the cached answer
    return tracker


@pytest.mark.parametrize("seed", range(3))
def test_incremental_decode_equals_full_decode_llama_style(seed):
    tok = _llama_style_tokenizer()
    rng = random.Random(seed)
    ids = tok.encode(SAMPLE, add_special_tokens=False)
    assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids), "the sample must use byte fallback"
    _replay(tok, ids, rng)
    # Arbitrary ids too: byte tokens in any order (broken characters), special tokens, words.
    _replay(tok, [rng.randrange(len(tok)) for _ in range(300)], rng)


def test_incremental_decode_decodes_only_the_new_tokens():
    tok = _llama_style_tokenizer()
    ids = tok.encode(SAMPLE * 4, add_special_tokens=False)
    tracker = _replay(tok, ids, random.Random(0), take_back=False)
    assert tracker.full_decodes <= 3, f"{tracker.full_decodes} whole-sequence decodes for {len(ids)} tokens"


def test_incremental_decode_tiny_tokenizer():
    tok = load_tokenizer("tiny")
    rng = random.Random(1)
    _replay(tok, [rng.randrange(64) for _ in range(200)], rng)


@pytest.mark.smollm2
def test_incremental_decode_equals_full_decode_smollm2():
    tok = load_tokenizer("smollm2")
    rng = random.Random(2)
    ids = tok.encode(SAMPLE * 3)
    tracker = _replay(tok, ids, rng, take_back=False)
    assert tracker.full_decodes <= 3
    _replay(tok, ids, rng)  # with tokens taken back
    _replay(tok, [rng.randrange(len(tok)) for _ in range(400)], rng)  # arbitrary byte-level pieces


def test_stop_string_and_holdback_with_incremental_decode():
    tok = _llama_style_tokenizer()
    ids = tok.encode(SAMPLE, add_special_tokens=False)
    tracker = TextTracker(tok, ["—"])
    out, seen = "", []
    for i in range(0, len(ids), 3):
        seen = ids[: i + 3]
        stop = tracker.find_stop(seen)
        if stop is not None:
            out += tracker.delta(seen, True, stop)
            break
        out += tracker.delta(seen, False)
    full = tok.decode(ids, skip_special_tokens=True)
    assert out == full[: full.index("—")]
