"""Incremental detokenization and stop-string matching for one request. No torch here."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalText:
    """Turns sampled token ids into text deltas that are always whole characters.

    tokenizers' DecodeStream holds back bytes of an unfinished multi-byte character. Stop strings
    are searched in the decoded text; while they could still match, the last
    `len(longest stop) - 1` characters are held back so streamed deltas never need retracting.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # the text so far, where stop strings are searched in it
        self._num_sent = 0

    def add(self, token_id: int, *, check_stop: bool) -> tuple[str, bool]:
        """Decode one token; returns (new text to emit, whether a stop string ended the text)."""
        piece = self._stream.step(self._tokenizer, token_id) or ""
        if not self._stop:  # nothing searched, nothing held back: the piece goes out whole
            return piece, False
        searched_from = max(0, len(self.text) - self._holdback)
        self.text += piece
        stopped = check_stop and self._truncate_at_stop(searched_from)
        return self._release(final=stopped), stopped

    def flush(self) -> str:
        """Release held-back text at the end of the sequence."""
        return self._release(final=True)

    def _truncate_at_stop(self, searched_from: int) -> bool:
        hits = [i for s in self._stop if (i := self.text.find(s, searched_from)) >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        return True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self._num_sent, len(self.text) - self._holdback)
        delta = self.text[self._num_sent:end]
        self._num_sent = end
        return delta
