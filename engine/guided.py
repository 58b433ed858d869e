"""Guided decoding: a grammar (JSON schema, regex, choice list, Lark) decides which tokens a
sequence may sample next, through llguidance.

A request carries a GuidedSpec: plain strings, so it pickles to the engine core's process. The
serving side checks it (check_spec) before the request is queued; the core gives each guided
sequence a Constraint built from a per-spec cache of compiled matchers; the sampler fills the
constrained rows' allowed-token bitmasks on the host while the forward runs; the scheduler's
postprocess advances each matcher with its sampled token. llguidance was chosen over xgrammar by
per-token mask cost on CPU (docs/benchmark/, `bench grammar-masks`) and because it needs no
torch/triton of its own.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance

from engine.grammar_ends import endless_rules
from engine.sampling_params import RequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the stub only
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

GUIDED_KINDS = ("json", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar: bounds the compile time
MAX_CHOICES = 256
COMPILED_CACHE_SIZE = 64
DRY_RUN_TOKENS = 8  # how far check() follows a grammar before serving it
_CANNOT_END = "matches no finite string"  # the start of a dry-run failure
_ENDLESS = {  # why the parser blows up, by kind
    "grammar": "does every rule have an alternative that ends (unlike `start: \"a\" start`)?",
    "json": "does the schema require itself (a required property whose $ref leads back)?"}
# JSON as json.dumps writes it: ", " and ": ", no free whitespace. Free whitespace lets a model
# loop on newlines until max_tokens (a known failure of any-whitespace JSON grammars).
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                     "key_separator": ": "}


@dataclass(frozen=True)
class GuidedSpec:
    """What constrains a request's output. kind: json (value: a JSON schema, as text), regex,
    choice (value: a JSON list of strings, one of which is the whole answer) or grammar (Lark,
    llguidance's dialect). `field` names the request field it came from, for errors."""

    kind: str
    value: str
    field: str = "guided"

    @classmethod
    def choice(cls, options: list[str], field: str = "guided_choice") -> GuidedSpec:
        return cls("choice", json.dumps(options, ensure_ascii=False), field)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, field: str = "guided_json") -> GuidedSpec:
        return cls("json", json.dumps(schema, ensure_ascii=False), field)


def grammar_text(spec: GuidedSpec) -> str:
    """llguidance's grammar for `spec`."""
    matcher = llguidance.LLMatcher
    if spec.kind == "json":
        return matcher.grammar_from_json_schema(spec.value, defaults=_JSON_OPTIONS)
    if spec.kind == "regex":
        return matcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        options = json.loads(spec.value)
        return matcher.grammar_from_lark("start: " + " | ".join(
            json.dumps(option, ensure_ascii=False) for option in options))
    return matcher.grammar_from_lark(spec.value)


def check_spec(spec: GuidedSpec) -> None:
    """Raise RequestError naming spec.field when the spec is malformed or does not compile."""
    if spec.kind not in GUIDED_KINDS:
        raise RequestError(f"{spec.field}: unknown kind {spec.kind!r}; one of "
                           f"{', '.join(GUIDED_KINDS)}", spec.field)
    if len(spec.value) > MAX_SPEC_CHARS:
        raise RequestError(f"{spec.field} has {len(spec.value)} characters; at most "
                           f"{MAX_SPEC_CHARS}", spec.field)
    if spec.kind == "choice":
        _check_choices(spec)
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(spec))
    except ValueError as err:  # not JSON at all
        error = str(err)
    if error:
        first = error.strip().splitlines()[0][:300]
        raise RequestError(f"{spec.field} does not compile: {first}", spec.field)
    if spec.kind == "grammar" and (endless := endless_rules(spec.value)):
        raise RequestError(
            f"{spec.field} {_CANNOT_END}: rule{'s' * (len(endless) > 1)} "
            f"{', '.join(endless[:5])} cannot end (each alternative leads back into "
            f"{'them' if len(endless) > 1 else 'itself'}); give one an alternative that does, "
            f"e.g. `x: \"a\" x | \"a\"`", spec.field)


def _check_choices(spec: GuidedSpec) -> None:
    options = json.loads(spec.value)
    if not isinstance(options, list) or not 1 <= len(options) <= MAX_CHOICES or not all(
            isinstance(o, str) and o for o in options):
        raise RequestError(f"{spec.field} must be a list of 1 to {MAX_CHOICES} non-empty "
                           "strings", spec.field)


class Constraint:
    """One sequence's grammar state (the Sequence's `constraint`), with what the sampler needs
    to fill its mask: the vocabulary the mask covers and the executor that fills it."""

    def __init__(self, matcher: llguidance.LLMatcher, matcher_vocab: int,
                 executor: llguidance.LLExecutor) -> None:
        self.matcher = matcher
        self.matcher_vocab = matcher_vocab
        self.executor = executor

    def accept(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (but EOS)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GuidedDecoding:
    """llguidance's view of the tokenizer (1-2 s for a 50k vocabulary: built on a thread from
    start-up, so that the first guided request does not wait for it) and, in the core,
    compiled matchers cached per spec and copied per sequence. The serving side uses check()
    to refuse, with the tokenizer, what check_spec() alone lets through."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 eos_token_ids: frozenset[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids) or None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._failure: str | None = None  # why llguidance cannot use this tokenizer
        self._building: threading.Thread | None = None
        self._lock = threading.Lock()  # check() runs on many HTTP threads
        self._compiled: OrderedDict[GuidedSpec, llguidance.LLMatcher] = OrderedDict()
        self._checked: OrderedDict[GuidedSpec, str] = OrderedDict()  # spec → error ("": none)
        self.executor = llguidance.LLExecutor()  # fills a batch's masks on several threads

    def check(self, spec: GuidedSpec) -> None:
        """RequestError naming spec.field when the grammar does not compile for this tokenizer
        (e.g. a special token it lacks), or when guided decoding cannot run on it at all."""
        tokenizer = self._llg_tokenizer(spec.field)
        with self._lock:
            error = self._checked.get(spec)
        if error is None:
            error = (llguidance.LLMatcher.validate_grammar(grammar_text(spec), tokenizer)
                     or self._dry_run(spec, tokenizer))
            with self._lock:
                self._checked[spec] = error
                if len(self._checked) > 4 * COMPILED_CACHE_SIZE:
                    self._checked.popitem(last=False)
        if error.startswith(_CANNOT_END):
            raise RequestError(f"{spec.field} {error}", spec.field)
        if error:
            first = error.strip().splitlines()[0][:300]
            raise RequestError(f"{spec.field} does not compile: {first}", spec.field)

    def _dry_run(self, spec: GuidedSpec, tokenizer: llguidance.LLTokenizer) -> str:
        """Follow the grammar for a few tokens (the lowest allowed id each time, never EOS):
        "" when it ends or gets that far cleanly, else why it failed. Compiling cannot tell
        a grammar with no finite string (`start: "a" start`, a schema that requires itself)
        or an empty regex; their first masks do (the parser blows up, or only EOS is
        allowed), so they are refused here instead of failing the request mid-generation."""
        try:
            matcher = llguidance.LLMatcher(tokenizer, grammar_text(spec), log_level=0)
        except Exception as err:  # noqa: BLE001 - API misuse only; generation decides then
            logger.warning("guided decoding: no dry run for %s (%s)", spec.field, err)
            return ""
        eos = sum(1 << t for t in self._eos or () if t < tokenizer.vocab_size)
        for _ in range(DRY_RUN_TOKENS):
            if matcher.is_error() or matcher.is_accepting() or matcher.is_stopped():
                break
            mask = int.from_bytes(matcher.compute_bitmask(), "little")
            if matcher.is_error():  # an empty language fails here (only EOS in its mask)
                break
            allowed = mask & ~eos
            if not allowed:  # only EOS, cleanly: the grammar ends (maybe on EOS as a literal)
                return "" if mask else f"{_CANNOT_END}: no string matches it"
            matcher.consume_token((allowed & -allowed).bit_length() - 1)
        if not matcher.is_error():
            return ""
        first = matcher.get_error().strip().splitlines()[0][:200]
        if "Too many items" in first:  # Earley items pile up: a recursion without an end
            hint = _ENDLESS.get(spec.kind, "is it recursive with no way out?")
            return f"{_CANNOT_END}: {hint} ({first})"
        return f"{_CANNOT_END}: no string matches it ({first})"

    def constraint(self, spec: GuidedSpec) -> Constraint:
        """A fresh grammar state for one sequence (check `.error` before using it); raises
        RequestError when guided decoding cannot run on this tokenizer."""
        tokenizer = self._llg_tokenizer(spec.field)
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = llguidance.LLMatcher(tokenizer, grammar_text(spec), log_level=0)
            if compiled.is_error():  # not cached: it carries the error
                return Constraint(compiled, tokenizer.vocab_size, self.executor)
            self._compiled[spec] = compiled
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(spec)
        return Constraint(compiled.deep_copy(), tokenizer.vocab_size, self.executor)

    def build_in_background(self) -> None:
        """Start building llguidance's tokenizer now, on a thread of its own."""
        self._building = threading.Thread(target=self._build, name="guided-tokenizer",
                                          daemon=True)
        self._building.start()

    def wait_built(self) -> None:
        """Block until the background build is done. Servers call it before serving: the
        build holds the GIL for up to ~0.3 s at a stretch (~0.45 s in all for a 49k
        vocabulary on 2 vCPUs), which would stall every step and stream running beside it."""
        with self._lock:
            if self._building is not None:
                self._building.join()
                self._building = None

    @property
    def is_built(self) -> bool:
        """The tokenizer view exists, or why it cannot (no build running)."""
        return self._building is None and (self._tokenizer is not None
                                           or self._failure is not None)

    def _build(self) -> None:
        import llguidance.hf

        started = time.perf_counter()
        try:
            # Typed for fast tokenizers; it raises ValueError on a slow one, caught below.
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer,  # type: ignore[arg-type]
                n_vocab=max(self.vocab_size, len(self._hf_tokenizer)),
                eos_token=self._eos)
            logger.info("guided decoding: llguidance's tokenizer view built in %.0f ms",
                        1000 * (time.perf_counter() - started))
        except Exception as err:  # noqa: BLE001 - e.g. a slow (Python) tokenizer
            self._failure = (f"guided decoding needs a fast (Rust) tokenizer; this model's "
                             f"cannot be used ({type(err).__name__}: {str(err)[:200]})")
            logger.warning("%s", self._failure)

    def _llg_tokenizer(self, field: str) -> llguidance.LLTokenizer:
        self.wait_built()
        with self._lock:
            if self._tokenizer is None and self._failure is None:  # not started yet
                self._build()
        if self._tokenizer is None:
            raise RequestError(f"{field}: {self._failure}", field)
        return self._tokenizer
