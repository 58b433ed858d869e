"""A few copies of the tokenizer for the HTTP threads, so that one long tokenization does not make
every other request wait for a single shared (lock-guarded) tokenizer."""

from __future__ import annotations

import contextlib
import copy
import logging
import queue
import re
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# Copies encoding at once. HF fast tokenizers release the GIL while they encode, so a few
# copies let short prompts pass a long one; more would only cost memory on a 2-core host.
POOL_SIZE = 4
# Prompts longer than max_model_len × this many characters cannot fit in max_model_len tokens
# with any real tokenizer (typical text averages ~4 characters per token), so they are refused
# before tokenizing: a 5 MiB prompt is not tokenized for seconds only to be refused then.
MAX_CHARS_PER_TOKEN = 64
# encode_tail: the first window's guess at characters per token (ordinary text has ~4) and the
# tokens at the window's start dropped as possibly unlike the whole text's there.
FIRST_CHARS_PER_TOKEN = 8
TAIL_SLACK_TOKENS = 8
_RUN_START = re.compile(r"(?<=\S)\s")  # the first white space after a word


def _window_start(text: str, chars: int, limit: int) -> int:
    """Where a tail window of about `chars` characters starts: at the start of a white-space
    run near there (a word is not cut in two, and a run, which tokenizers split by its whole
    length, is whole), else back at the start of the run it cuts, where that is within `limit`
    characters more (a longer run is cut: the work stays bounded, that run's ids may differ)."""
    start = len(text) - chars
    space = _RUN_START.search(text, start, start + chars // 4)
    if space is not None:
        return space.start()
    if start > 0 and text[start].isspace() and text[start - 1].isspace():
        before = text[max(start - limit, 0):start]
        kept = len(before.rstrip())
        if kept or start <= limit:
            return start - (len(before) - kept)
    return start
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
            return self._encode(tokenizer, text, add_special_tokens)

    def encode_tail(self, text: str, keep: int, add_special_tokens: bool = True) -> list[int]:
        """encode(text)[-keep:] (TGI's `truncate`), from tokenizing only the text's tail: a
        window of about FIRST_CHARS_PER_TOKEN characters per token wanted, doubled while it
        gives too few tokens, up to MAX_CHARS_PER_TOKEN per token; so a prompt's size never
        costs more than (keep + TAIL_SLACK_TOKENS) x 2 x MAX_CHARS_PER_TOKEN characters of
        tokenizing. The window starts at a white space where one is near (a word is not cut
        in two) and its first TAIL_SLACK_TOKENS tokens are dropped: those can differ from the
        whole text's (a cut word, a prefix space or BOS added at a text's start). Past them
        the ids equal the whole text's wherever the tokenizer is local (pre-tokenized words,
        as BPE and SentencePiece tokenizers are on ordinary text)."""
        need = keep + TAIL_SLACK_TOKENS
        limit = need * MAX_CHARS_PER_TOKEN
        chars = need * FIRST_CHARS_PER_TOKEN
        with self.borrow() as tokenizer:
            while True:
                if chars >= len(text):
                    return self._encode(tokenizer, text, add_special_tokens)[-keep:]
                ids = self._encode(tokenizer, text[_window_start(text, chars, limit):],
                                   add_special_tokens)
                if len(ids) >= need or chars >= limit:
                    return ids[-keep:]
                chars = min(chars * 2, limit)

    def _encode(self, tokenizer, text: str, add_special_tokens: bool) -> list[int]:
        if not self.direct:
            ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return ids
        ids = tokenizer.backend_tokenizer.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens)[0].ids
        return ids

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
