"""Incremental detokenisation with stop strings: what text a client may see after each committed block."""

from __future__ import annotations


class TextTracker:
    """Decodes the generated tokens, finds stop strings, and holds back text that may still change
    (an incomplete UTF-8 sequence, or the start of a stop string)."""

    def __init__(self, tokenizer, stop: list[str], emitted_chars: int = 0):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.emitted = emitted_chars

    def decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def find_stop(self, tokens: list[int]) -> int | None:
        """Character index where the first stop string starts, or None."""
        if not self.stop:
            return None
        text = self.decode(tokens)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def delta(self, tokens: list[int], final: bool, stop_at: int | None = None) -> str:
        text = self.decode(tokens)
        if stop_at is not None:
            text = text[:stop_at]
        end = len(text)
        if not final:
            end = max(self.emitted, end - self.holdback)
            while end > self.emitted and text[end - 1] == "\ufffd":
                end -= 1
        out = text[self.emitted : end]
        self.emitted = end
        return out
