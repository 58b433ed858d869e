"""engine/text/tokenizer_pool.py: prompts encoded straight through the tokenizers backend give
transformers' ids, and anything the start-up probe cannot vouch for goes through transformers."""

from __future__ import annotations

import copy
import logging
import random
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from engine.text.tokenizer_pool import (
    MAX_CHARS_PER_TOKEN,
    TAIL_SLACK_TOKENS,
    TokenizerPool,
    encodes_alike,
)
from tests.models_fixtures import CORPUS, build_tokenizer

TEXTS = ["", "hello world", "The capital of France is", " leading and trailing ",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
         "caf\u00e9 \u00fcber \U0001f600", "the cat " * 300]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PreTrainedTokenizerFast:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_direct_encoding_gives_transformers_ids(tokenizer, add_special_tokens: bool) -> None:
    pool = TokenizerPool(tokenizer)
    assert pool.direct
    for text in TEXTS:
        assert pool.encode(text, add_special_tokens) == tokenizer.encode(
            text, add_special_tokens=add_special_tokens), text


def test_a_backend_saved_with_truncation_still_encodes_whole_prompts(tokenizer) -> None:
    """tokenizer.json may carry a truncation setting; transformers' encode turns it off unless
    asked to truncate, and so must the direct path (a cut prompt would change the answer)."""
    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.enable_truncation(max_length=8)
    truncating = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    text = TEXTS[-1]
    pool = TokenizerPool(truncating)
    assert len(pool.encode(text)) == len(truncating.encode(text)) > 8


def test_split_special_tokens_is_honoured(tokenizer, tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path)
    splitting = PreTrainedTokenizerFast.from_pretrained(tmp_path, split_special_tokens=True)
    pool = TokenizerPool(splitting)
    text = TEXTS[4]
    assert pool.direct
    assert pool.encode(text) == splitting.encode(text) != tokenizer.encode(text)


class _Renumbered:
    """A tokenizer whose own encode() differs from its backend's (as a wrapper that adds steps
    around the backend would)."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner = inner
        self.backend_tokenizer = inner.backend_tokenizer
        self.all_special_tokens = inner.all_special_tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0, *self.inner.encode(text, add_special_tokens=add_special_tokens)]


class _NoBackend:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(text)]


@pytest.mark.parametrize("odd", [_Renumbered, lambda _: _NoBackend()])
def test_what_the_probe_cannot_vouch_for_goes_through_encode(tokenizer, odd, caplog) -> None:
    wrapped = odd(tokenizer)
    with caplog.at_level(logging.INFO, logger="engine.text.tokenizer_pool"):
        pool = TokenizerPool(wrapped)
    assert not pool.direct and not encodes_alike(wrapped)
    assert "transformers' encode" in caplog.text
    assert pool.encode("hello world") == wrapped.encode("hello world")


def _ordinary_text(seed: int, words: int) -> str:
    """Sentences of the fixture corpus's words (multi-byte ones too), shuffled."""
    rng = random.Random(seed)
    vocab = " ".join(CORPUS).split() + ["\n", "\n\n", "  ", "\t"]
    return " ".join(rng.choice(vocab) for _ in range(words))


def _spied(pool: TokenizerPool) -> list[int]:
    """The lengths of the texts `pool` hands to its tokenizer from now on."""
    lengths: list[int] = []
    inner = pool._encode

    def spy(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
        lengths.append(len(text))
        return inner(tokenizer, text, add_special_tokens)

    pool._encode = spy  # type: ignore[method-assign]
    return lengths


@pytest.mark.parametrize("odd", [None, _Renumbered])  # direct, and via encode with a BOS-like 0
def test_a_tail_encodes_as_the_whole_texts_last_tokens(tokenizer, odd) -> None:
    """TGI's truncate: the last `keep` ids from tokenizing only a tail window equal the whole
    text's last `keep`, long texts and short ones (a text shorter than its window is whole)."""
    wrapped = tokenizer if odd is None else odd(tokenizer)
    pool = TokenizerPool(wrapped)
    for seed, words in enumerate([3, 40, 400, 3000]):
        text = _ordinary_text(seed, words)
        whole = wrapped.encode(text)
        for keep in (1, 2, 7, 64, 500):
            assert pool.encode_tail(text, keep) == whole[-keep:], (seed, keep)


def test_a_tail_keeps_white_space_runs_whole(tmp_path) -> None:
    """Byte-level BPE merges a run of spaces or newlines by its whole length: a window that
    starts inside one starts at its beginning (found in review: "\n" * 3000 + "hi" lost ids)."""
    runs = [c * n for c in (" ", "\n") for n in range(2, 17)]
    tokenizer = build_tokenizer(tmp_path, [*CORPUS, *runs, *(f"a{r}b" for r in runs)])
    pool = TokenizerPool(tokenizer)
    # runs up to the window's limit, (keep + TAIL_SLACK_TOKENS) * MAX_CHARS_PER_TOKEN
    for text in ("\n" * 500 + "hi", "word " + " " * 500 + "end", "x" + " " * 500,
                 _ordinary_text(3, 400) + "\n" * 300 + _ordinary_text(4, 5)):
        whole = tokenizer.encode(text)
        for keep in (1, 4, 16):
            assert pool.encode_tail(text, keep) == whole[-keep:], (text[:8], keep)


def test_a_huge_texts_tail_tokenizes_a_bounded_window(tokenizer) -> None:
    pool = TokenizerPool(tokenizer)
    text = _ordinary_text(7, 600_000)  # a few MB
    lengths = _spied(pool)
    ids = pool.encode_tail(text, 64)
    bound = (64 + TAIL_SLACK_TOKENS) * MAX_CHARS_PER_TOKEN * 2
    assert len(ids) == 64 and 0 < sum(lengths) <= bound < len(text) // 100
    assert ids == tokenizer.encode(text[-bound:])[-64:]
    # text the tokenizer packs densely still stops at MAX_CHARS_PER_TOKEN characters a token
    lengths.clear()
    assert pool.encode_tail("\u00e9" * 2_000_000, 4)
    assert sum(lengths) <= bound
