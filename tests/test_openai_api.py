"""The official `openai` client against a real server (gunicorn, tiny model, paged and
continuous): models, completions and chat, whole and streamed (SSE whatever the Accept header,
usage chunk on request), logprobs, and errors in OpenAI's shape."""

from __future__ import annotations

import openai
import pytest
import requests

from tests.engine_harness import MAX_MODEL_LEN
from tests.models_fixtures import build_tiny_model
from tests.server_harness import running_server

CHAT = [{"role": "user", "content": "The capital of France is"}]
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module", params=["paged", "scheduler"])
def server(request, tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("openai-model"))
    properties = (f"option.rolling_batch={request.param}\noption.max_rolling_batch_size=4\n"
                  f"option.max_model_len={MAX_MODEL_LEN}\n")
    with running_server(tmp_path_factory.mktemp("openai-server"), path, properties) as srv:
        yield srv, path.name


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0].url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(server) -> None:
    [model] = client(server).models.list().data
    assert model.id == server[1] and model.owned_by == "batchyard"


def test_completions_whole_and_streamed_agree_with_usage(server) -> None:
    api = client(server)
    whole = api.completions.create(model=server[1], prompt="Once upon a time", **GREEDY)
    [choice] = whole.choices
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 12
    chunks = list(api.completions.create(model=server[1], prompt="Once upon a time", stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    echoed = api.completions.create(model=server[1], prompt="Once upon a time", echo=True,
                                    logprobs=2, **GREEDY)
    assert echoed.choices[0].text == "Once upon a time" + choice.text
    logprobs = echoed.choices[0].logprobs
    # a dict by text: two ids that decode alike (partial UTF-8 bytes) share one key
    assert len(logprobs.tokens) == 12 and all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)


def test_a_list_of_prompts_answers_one_choice_each_in_order(server) -> None:
    prompts = ["Once upon a time", "The capital of Japan is"]
    batch = client(server).completions.create(model=server[1], prompt=prompts, **GREEDY)
    alone = [client(server).completions.create(model=server[1], prompt=p, **GREEDY)
             for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]


def test_chat_streams_sse_chunks_with_the_same_text_and_usage(server) -> None:
    """Written by the engine's output thread, as every stream of these routes is (a stream
    long enough not to end before its first line is written: that one the request thread
    writes, rightly)."""
    api = client(server)
    by_output_thread = 'batchyard_streamed_requests_total{writer="output_thread"}'
    before = server[0].metric(by_output_thread)
    long = {**GREEDY, "max_tokens": 48}
    whole = api.chat.completions.create(model=server[1], messages=CHAT, **long)
    chunks = list(api.chat.completions.create(model=server[1], messages=CHAT, stream=True,
                                              stream_options={"include_usage": True}, **long))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    server[0].wait_metric(by_output_thread, before + 1)


def test_a_v1_stream_is_sse_whatever_the_accept_header(server) -> None:
    """The openai SDK sends Accept: application/json even when it streams."""
    r = requests.post(f"{server[0].url}/v1/chat/completions", timeout=30,
                      headers={"Accept": "application/json"},
                      json={"messages": CHAT, "max_tokens": 3, "stream": True})
    assert r.headers["Content-Type"].startswith("text/event-stream")
    assert r.text.rstrip().endswith("data: [DONE]")


def test_errors_come_in_openais_shape_naming_the_field(server) -> None:
    api = client(server)
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=server[1], prompt="hi", max_tokens=10_000)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["code"] == "BadRequest"
    assert "max_tokens" in body["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        api.completions.create(model=server[1], prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        api.chat.completions.create(model=server[1], messages=CHAT, temperature=-1)


def test_n_choices_seeded_apart_and_counted_once_per_prompt(server) -> None:
    """n sampled choices of one prompt: choice i draws with seed + i, so they differ from each
    other and repeat exactly; the prompt's tokens count once in usage."""
    api = client(server)
    asked = {"model": server[1], "max_tokens": 24, "temperature": 0.8, "seed": 11, "n": 3,
             "extra_body": {"ignore_eos": True}}  # a stream that outlasts its first write
    first = api.chat.completions.create(messages=CHAT, **asked)
    again = api.chat.completions.create(messages=CHAT, **asked)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [c.message.content for c in again.choices]
    single = api.chat.completions.create(messages=CHAT, **{**asked, "n": 1})
    assert first.usage.prompt_tokens == single.usage.prompt_tokens
    assert first.usage.completion_tokens == 3 * 24
    batch = api.completions.create(prompt=["Once upon a time", "The capital of"], **asked)
    assert [c.index for c in batch.choices] == list(range(6))
    assert batch.usage.completion_tokens == 6 * 24
    top_seed = api.chat.completions.create(messages=CHAT, **{**asked, "seed": 2**63 - 1})
    assert len(top_seed.choices) == 3  # seed + i wraps around within the seeds' range
    by_output_thread = 'batchyard_streamed_requests_total{writer="output_thread"}'
    before = server[0].metric(by_output_thread)
    streamed = list(api.chat.completions.create(messages=CHAT, stream=True,
                                                stream_options={"include_usage": True}, **asked))
    server[0].wait_metric(by_output_thread, before + 1)  # n choices, one stream, no thread each
    pieces: dict[int, str] = {}
    for chunk in streamed[:-1]:
        [choice] = chunk.choices
        pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
    assert [pieces[i] for i in range(3)] == texts  # interleaved, each equal to its whole answer
    assert streamed[-1].usage == first.usage
    chunks = list(api.completions.create(prompt="Once upon a time", stream=True, **asked))
    whole = api.completions.create(prompt="Once upon a time", **asked)
    for c in whole.choices:
        assert "".join(k.choices[0].text for k in chunks if k.choices[0].index == c.index) \
            == c.text
    assert {k.choices[0].finish_reason for k in chunks} == {None, "length"}


def test_frequency_and_presence_penalties_change_a_repetitive_answer(server) -> None:
    api = client(server)
    plain = api.completions.create(model=server[1], prompt="la la la", **GREEDY).choices[0]
    penalised = api.completions.create(model=server[1], prompt="la la la", frequency_penalty=2,
                                       presence_penalty=1, **GREEDY).choices[0]
    assert penalised.text != plain.text
    with pytest.raises(openai.BadRequestError, match="presence_penalty must be between -2"):
        api.chat.completions.create(model=server[1], messages=CHAT, presence_penalty=3)


def test_a_completions_body_works_on_invocations(server) -> None:
    """SageMaker forwards only /invocations: OpenAI's bodies must work there too."""
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    whole = requests.post(f"{server[0].url}/invocations", json=body, timeout=30)
    assert whole.status_code == 200 and whole.json()["object"] == "text_completion"
    v1 = client(server).completions.create(model=server[1], **body)
    assert whole.json()["choices"][0]["text"] == v1.choices[0].text
    bad = requests.post(f"{server[0].url}/invocations", json={**body, "max_tokens": 0},
                        timeout=30)
    assert bad.status_code == 400 and "max_tokens" in bad.json()["message"]
