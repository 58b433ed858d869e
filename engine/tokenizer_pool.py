"""A few copies of the tokenizer for the HTTP threads, so that one long tokenization does not make
every other request wait for a single shared (lock-guarded) tokenizer."""

from __future__ import annotations

import contextlib
import copy
import queue
from collections.abc import Iterator

# Copies encoding at once. HF fast tokenizers release the GIL while they encode, so a few
# copies let short prompts pass a long one; more would only cost memory on a 2-core host.
POOL_SIZE = 4
# Prompts longer than max_model_len × this many characters cannot fit in max_model_len tokens
# with any real tokenizer (typical text averages ~4 characters per token), so they are refused
# before tokenizing: a 5 MiB prompt is not tokenized for seconds only to be refused then.
MAX_CHARS_PER_TOKEN = 64


class TokenizerPool:
    """Copies of one tokenizer, each used by one thread at a time (HF tokenizers are not safe
    to share between threads that encode)."""

    def __init__(self, tokenizer, size: int = POOL_SIZE) -> None:
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(size):
            self._free.put(copy.deepcopy(tokenizer))

    @contextlib.contextmanager
    def borrow(self) -> Iterator:
        tokenizer = self._free.get()
        try:
            yield tokenizer
        finally:
            self._free.put(tokenizer)
