"""A few copies of the tokenizer for the HTTP threads, so that one long tokenization does not make
every other request wait for a single shared (lock-guarded) tokenizer."""

from __future__ import annotations

import contextlib
import copy
import logging
import queue
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# Copies encoding at once. HF fast tokenizers release the GIL while they encode, so a few
# copies let short prompts pass a long one; more would only cost memory on a 2-core host.
POOL_SIZE = 4
# Prompts longer than max_model_len × this many characters cannot fit in max_model_len tokens
# with any real tokenizer (typical text averages ~4 characters per token), so they are refused
# before tokenizing: a 5 MiB prompt is not tokenized for seconds only to be refused then.
MAX_CHARS_PER_TOKEN = 64
# Texts whose ids the tokenizers backend must give exactly as transformers' encode does before
# prompts skip transformers' wrapper; one more holds the tokenizer's special tokens as text.
PROBE_TEXTS = ("", "Hello, world!", "  two  spaces\tand a tab\nand a new line ",
               "h\u00e9llo w\u00f6rld \u2014 \u4f60\u597d \U0001f642", "1234567890 3.14159 x=y+z;")


class TokenizerPool:
    """Copies of one tokenizer, each used by one thread at a time (HF tokenizers are not safe
    to share between threads that encode)."""

    def __init__(self, tokenizer, size: int = POOL_SIZE) -> None:
        copies = [copy.deepcopy(tokenizer) for _ in range(size)]
        # Each copy probed: transformers' encode sets the backend's truncation, padding and
        # special-token splitting for its call, and a copy does not always keep what the
        # original had set (deepcopy lost split_special_tokens' switch in a test).
        self.direct = all(encodes_alike(each) for each in copies)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for each in copies:
            self._free.put(each)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """tokenizer.encode(text)'s ids. Where the start-up probe found them equal, straight
        from the tokenizers backend (~20 us of wrapper less per prompt on a 2-core host); its
        batch call, as transformers' own, lets other threads run while it encodes."""
        with self.borrow() as tokenizer:
            if not self.direct:
                return tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return tokenizer.backend_tokenizer.encode_batch_fast(
                [text], add_special_tokens=add_special_tokens)[0].ids

    @contextlib.contextmanager
    def borrow(self) -> Iterator:
        tokenizer = self._free.get()
        try:
            yield tokenizer
        finally:
            self._free.put(tokenizer)


def encodes_alike(tokenizer) -> bool:
    """Whether the tokenizers backend encodes as transformers' encode() over it does, on the
    probe texts (with and without special tokens added), with no truncation or padding set."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        logger.info("tokenizer: prompts go through transformers' encode (no tokenizers backend)")
        return False
    specials = " ".join(map(str, getattr(tokenizer, "all_special_tokens", ())))
    for text in (*PROBE_TEXTS, f"{specials} between {specials}"):
        for add in (True, False):
            wanted = tokenizer.encode(text, add_special_tokens=add)
            got = backend.encode_batch_fast([text], add_special_tokens=add)[0].ids
            if got != wanted:
                logger.info("tokenizer: prompts go through transformers' encode (the backend "
                            "alone gives other ids for %r)", text)
                return False
    if backend.truncation is not None or backend.padding is not None:
        logger.info("tokenizer: prompts go through transformers' encode (the backend truncates "
                    "or pads)")
        return False
    return True
