"""Guided decoding in the engine: a grammar-masked greedy answer equals transformers `generate`
with the same grammar applied as a logits processor, token for token, in every strategy and under
forced preemption; sampled guided answers still match their grammar; bad specs are refused."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

from engine import RequestError, SamplingParams
from engine.grammar_ends import endless_rules
from engine.guided import GuidedSpec, check_spec, grammar_text
from tests.engine_harness import Req, drive, make_engine
from tests.models_fixtures import build_tiny_model

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
SPECS = {
    "json": GuidedSpec.json_schema(SCHEMA),
    "regex": GuidedSpec("regex", r"(cat|dog)-[0-9]{2,3}", "guided_regex"),
    "choice": GuidedSpec.choice(["left", "right", "straight on"]),
    "grammar": GuidedSpec("grammar", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/'),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("guided"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, AutoTokenizer.from_pretrained(path)


class GrammarProcessor(LogitsProcessor):
    """The reference: one llguidance matcher masks transformers' logits, row 0 only."""

    def __init__(self, tokenizer, vocab: int, spec: GuidedSpec, prompt_len: int) -> None:
        llg = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=[2])
        self.matcher = llguidance.LLMatcher(llg, grammar_text(spec), log_level=0)
        self.prompt_len, self.vocab = prompt_len, vocab

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")[:self.vocab].astype(bool)
        return scores.masked_fill(~torch.from_numpy(bits)[None, :], float("-inf"))


def reference(tiny, prompt: list[int], spec: GuidedSpec, max_new: int) -> list[int]:
    path, model, tokenizer = tiny
    processor = GrammarProcessor(tokenizer, model.config.vocab_size, spec, len(prompt))
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), do_sample=False, max_new_tokens=max_new,
                             eos_token_id=2, pad_token_id=2, logits_processor=[processor])
    tokens = out[0, len(prompt):].tolist()
    return tokens[:-1] if tokens and tokens[-1] == 2 else tokens  # batchyard spares the EOS


def requests(tiny, max_new: int = 64) -> list[Req]:
    tokenizer = tiny[2]
    prompts = [tokenizer.encode(t) for t in ("The answer is", "Once upon a time there",
                                             "A", "Give me JSON: {")]
    reqs = [Req(f"{kind}{i}", prompt, SamplingParams(max_new_tokens=max_new, guided=spec), i)
            for i, (prompt, (kind, spec)) in enumerate(zip(prompts, SPECS.items(), strict=True))]
    reqs.append(Req("free", tokenizer.encode("x"), SamplingParams(max_new_tokens=9), 1))
    reqs.append(Req("json-again", prompts[1], SamplingParams(max_new_tokens=max_new,
                                                             guided=SPECS["json"]), 1))  # unguided
    return reqs


STRATEGIES = [("none", {}), ("dynamic", {}), ("continuous", {}), ("paged", {}),
              ("paged", {"max_num_seqs": 6, "block_size": 4, "num_kv_blocks": 20})]


@pytest.mark.parametrize(("batching", "overrides"), STRATEGIES,
                         ids=[f"{b}-{i}" for i, (b, _) in enumerate(STRATEGIES)])
def test_guided_greedy_equals_generate_with_the_grammar(tiny, batching, overrides) -> None:
    """Mixed guided and free rows in one batch; the last case forces preemption."""
    reqs = requests(tiny)
    engine = make_engine(tiny[0], batching, **overrides)
    drive(engine, reqs)
    if overrides:
        assert engine.scheduler.num_preemptions > 0
    for req in reqs:
        if req.params.guided is not None:
            assert req.tokens == reference(tiny, req.prompt, req.params.guided, 64), req.request_id
    texts = {r.request_id: tiny[2].decode(r.tokens) for r in reqs}
    jsonschema.validate(json.loads(texts["json0"]), SCHEMA)
    assert re.fullmatch(r"(cat|dog)-[0-9]{2,3}", texts["regex1"])
    assert texts["choice2"] in ("left", "right", "straight on")
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", texts["grammar3"])


def test_sampled_guided_rows_still_match_their_grammar(tiny) -> None:
    engine = make_engine(tiny[0], "paged")
    reqs = [Req(f"s{seed}", tiny[2].encode("Pick:"), SamplingParams(
        max_new_tokens=88, do_sample=True, temperature=1.5, top_k=50, top_p=0.9, seed=seed,
        guided=SPECS["json"])) for seed in range(6)]
    drive(engine, reqs)
    for req in reqs:
        jsonschema.validate(json.loads(tiny[2].decode(req.tokens)), SCHEMA)


def test_a_finished_grammar_ends_the_answer_as_eos(tiny) -> None:
    engine = make_engine(tiny[0], "continuous")
    engine.add_request("c", tiny[2].encode("Go"), SamplingParams(
        max_new_tokens=30, guided=SPECS["choice"], ignore_eos=True))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    assert events[-1].finish_reason == "eos_token"
    assert "".join(e.text for e in events) in ("left", "right", "straight on")


def test_a_grammar_the_tokenizer_cannot_serve_ends_its_request_only(tiny) -> None:
    """A special token the tokenizer lacks passes the boundary's check (no tokenizer there);
    the engine ends that request with an error and serves the other."""
    engine = make_engine(tiny[0], "paged")
    bad = GuidedSpec("grammar", "start: <|no_such_token|>")
    check_spec(bad)
    engine.add_request("bad", [5, 6], SamplingParams(max_new_tokens=4, guided=bad))
    engine.add_request("good", [5, 6], SamplingParams(max_new_tokens=4))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    ends = {e.request_id: e.finish_reason for e in events if e.finished}
    assert ends == {"bad": "invalid", "good": "length"}  # invalid: a 400, not a 500
    [error] = [e.error for e in events if e.request_id == "bad"]
    assert error.startswith("guided does not compile for this model: ") and "no_such" in error


@pytest.mark.parametrize(("grammar", "endless"), [
    ('start: "a" start', ["start"]), ("start: a\na: b\nb: a", ["a", "b", "start"]),
    ('start: ("a")* "b" x\nx: "c" x', ["start", "x"]), ('start: x~2\nx: "a" x', ["start", "x"]),
    ('start: x\nx: "a" x\n   | "b" x', ["start", "x"]), ('start: "a" start -> loop', ["start"]),
    ('start: x\nx: "a" x | "b"', []), ('start: "a" | start start', []), ('start: "a"+ "!"', []),
    ('start: [x] "y"\nx: x "a"', []), ('start: x~0..3\nx: "a" x', []),
    ('?start: e\ne: t ("+" t)*\nt: N | "(" e ")"\nN: /[0-9]+/', []),
    ('// c\nstart: text\ntext[lazy]: /.*/ "end" | %json {\n "type": "object"\n}', []),
    ("start: x{1}", None),  # beyond the check: no verdict
])
def test_rules_that_cannot_end_are_found(grammar, endless) -> None:
    assert endless_rules(grammar) == endless


def test_a_grammar_with_no_finite_string_is_refused_at_the_boundary() -> None:
    with pytest.raises(RequestError, match="guided_grammar matches no finite string: rule "
                       "start cannot end") as err:
        check_spec(GuidedSpec("grammar", 'start: "a" start', "guided_grammar"))
    assert err.value.field == "guided_grammar"


@pytest.mark.parametrize(("spec", "message"), [
    (GuidedSpec("regex", "[0-9", "guided_regex"), "guided_regex does not compile"),
    (GuidedSpec.json_schema({"type": "frob"}), "guided_json does not compile"),
    (GuidedSpec("json", "{not json", "response_format"), "response_format does not compile"),
    (GuidedSpec.choice([]), "guided_choice must be a list of 1 to 256"),
    (GuidedSpec.choice(["a", ""]), "guided_choice must be a list"),
    (GuidedSpec("grammar", "start: " + "x" * 70000, "guided_grammar"), "at most 65536"),
    (GuidedSpec("lisp", "()"), "unknown kind"),
])
def test_bad_specs_are_refused_naming_the_field(spec, message) -> None:
    with pytest.raises(RequestError, match=re.escape(message)) as err:
        check_spec(spec)
    assert err.value.field == spec.field


def test_a_grammar_that_ends_on_the_eos_token_itself_is_not_refused(tiny) -> None:
    """The boundary's dry run never samples EOS; a grammar whose last lexeme is the EOS
    special token (Llama 3 tool grammars end on <|eot_id|>) ends cleanly there, and only an
    empty language, which fails its first mask, is refused (found in review)."""
    from engine.guided import GuidedDecoding

    _, model, tokenizer = tiny
    guided = GuidedDecoding(tokenizer, model.config.vocab_size, frozenset({2}))
    ending = GuidedSpec("grammar", 'start: ("yes" | "no") <|im_end|>', "guided_grammar")
    guided.check(ending)
    with pytest.raises(RequestError, match="guided_regex"):
        guided.check(GuidedSpec("regex", "a[^\\s\\S]b", "guided_regex"))
