"""LoRA adapters at the HTTP edge: the keys (and TGI's LORA_ADAPTERS), start-up adapters from
<model dir>/adapters, the request conventions (LMI's "adapters", TGI's adapter_id, OpenAI's
model, SageMaker's header), DJL's, SageMaker's and vLLM's registration routes with their
statuses, path confinement, /v1/models, the adapter metrics, and the official openai client
naming an adapter (its greedy text differs from the base model's and equals the engine's own)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from engine import EngineClient, SamplingParams
from handler.config.properties import ConfigError, collect_settings, parse_properties
from handler.config.serving_config import ServingConfig, build_serving_config
from handler.config.setting import Setting
from handler.http.app import create_app
from handler.http.schemas import lmi_adapters
from handler.http.state import ServerState
from handler.model_source.adapters import (
    AdapterPathError,
    BadCheckpoint,
    confined_folder,
    startup_adapters,
)
from tests.engine_harness import make_engine
from tests.models_fixtures import build_tiny_model

PROMPT = "Once upon a time"
GREEDY = {"max_new_tokens": 8, "ignore_eos": True}
HEADER = "X-Amzn-SageMaker-Adapter-Identifier"


def make_adapter(base: Path, folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                  target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a visible update on a 2-layer random model
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    peft_model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """model/adapters/a (registered at start-up), b (staged: moved into adapters/ later), an
    adapter outside the roots, and a .bin-only folder."""
    root = tmp_path_factory.mktemp("lora-http")
    model = build_tiny_model(root / "model")
    make_adapter(model, model / "adapters" / "a", 1)
    staged = make_adapter(model, root / "staged" / "b", 2)
    outside = make_adapter(model, root / "outside" / "c", 3)
    binonly = root / "staged" / "binonly"
    binonly.mkdir()
    shutil.copy(staged / "adapter_config.json", binonly)
    (binonly / "adapter_model.bin").write_bytes(b"not read")
    return model, staged, outside, binonly


@pytest.fixture(scope="module")
def served(lora):
    model = lora[0]
    engine = make_engine(model, "paged", enable_lora=True, max_loras=2, max_lora_rank=8)
    state = ServerState(ServingConfig(engine=engine.config, job_queue_size=8,
                                      engine_process=False))
    state.serve(EngineClient(engine, 8, state.metrics.on_step))
    for name in ("b", "binonly"):  # in the allowed root, not registered at start-up
        shutil.copytree(lora[1].parent / name, model / "adapters" / name)
    try:
        yield create_app(state).test_client(), state
    finally:
        state.shutdown(grace_seconds=0.0)


def offline(model: Path, adapter_folder: Path | None, prompt_ids: list[int]) -> list[int]:
    """Greedy tokens from an LLMEngine of its own (no HTTP, no loop)."""
    modules = (("x", str(adapter_folder)),) if adapter_folder else ()
    engine = make_engine(model, "paged", enable_lora=True, max_loras=2, max_lora_rank=8,
                         lora_modules=modules)
    engine.add_request("r", prompt_ids, SamplingParams(max_new_tokens=8, ignore_eos=True,
                                                       adapter="x" if modules else None))
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [e.token_id for e in engine.step() if e.token_id is not None]
    return tokens


def generate(client, body: dict, headers: dict | None = None):
    return client.post("/invocations", json=body, headers=headers or {})


def text_of(client, adapters=None, headers=None, **extra) -> str:
    body = {"inputs": PROMPT, "parameters": {**GREEDY, **extra}}
    if adapters is not None:
        body["adapters"] = adapters
    answer = generate(client, body, headers)
    assert answer.status_code == 200, answer.get_json()
    return answer.get_json()["generated_text"]


# --- keys ---

def resolve(text: str = "", env: dict | None = None, model_dir: Path = Path("/m")):
    settings: dict[str, Setting] = dict(collect_settings(None, env or {}))
    settings.update(parse_properties(text, "serving.properties"))
    return build_serving_config(settings, model_dir, ["LlamaForCausalLM"])


def test_lora_keys_reach_the_engine_config(tmp_path) -> None:
    e = resolve("option.enable_lora=true\noption.max_loras=2\noption.max_lora_rank=32\n"
                "option.max_cpu_loras=5").engine
    assert (e.enable_lora, e.max_loras, e.max_lora_rank, e.max_cpu_loras) == (True, 2, 32, 5)
    e = resolve(env={"OPTION_ENABLE_LORA": "true", "OPTION_MAX_LORAS": "3"}).engine
    assert (e.enable_lora, e.max_loras, e.max_lora_rank, e.max_cpu_loras) == (True, 3, 16, None)
    assert resolve().engine.enable_lora is False and resolve().engine.max_loras == 4
    tgi = resolve(env={"LORA_ADAPTERS": "x=/a/x, y=/a/y"}).engine
    assert tgi.enable_lora and tgi.lora_modules == (("x", "/a/x"), ("y", "/a/y"))


@pytest.mark.parametrize(("text", "env", "key"), [
    ("option.max_lora_rank=4", None, "option.max_lora_rank"),
    ("option.max_loras=0", None, "option.max_loras"),
    ("option.max_loras=4\noption.max_cpu_loras=2", None, "option.max_cpu_loras"),
    ("option.enable_lora=maybe", None, "option.enable_lora"),
    ("", {"LORA_ADAPTERS": "org/adapter"}, "option.lora_modules"),
    ("option.enable_lora=false\noption.lora_modules=x=/a", None, "option.lora_modules"),
])
def test_a_value_the_engine_cannot_honour_names_its_key(text, env, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve(text, env)


def test_model_folder_adapters_are_start_up_modules(lora, tmp_path) -> None:
    model = lora[0]
    e = resolve("option.enable_lora=true", model_dir=model).engine
    assert e.lora_modules == (("a", str((model / "adapters" / "a").resolve())),)
    assert resolve(model_dir=model).engine.lora_modules == ()  # LoRA off: not scanned
    bad = tmp_path / "m"
    (bad / "adapters" / "x").mkdir(parents=True)
    with pytest.raises(ConfigError, match="adapter_config.json"):
        resolve("option.enable_lora=true", model_dir=bad)


# --- parsing and confinement (no engine) ---

def test_lmi_adapters_field_shapes() -> None:
    assert lmi_adapters(None, 2) == (None, None)
    assert lmi_adapters("a", 2) == ("a", "a")
    assert lmi_adapters(["a", "", None], 3) == ("a", None, None)
    with pytest.raises(Exception, match=r"Number of adapters \(1\).*inputs \(2\)"):
        lmi_adapters(["a"], 2)
    with pytest.raises(Exception, match="adapters must be"):
        lmi_adapters(3, 1)


def test_confinement(lora, tmp_path) -> None:
    model, staged, outside, binonly = lora
    roots = [model / "adapters"]
    assert confined_folder(str(model / "adapters" / "a"), roots) == str(
        (model / "adapters" / "a").resolve())
    for src in (str(outside), f"{model}/adapters/../../outside/c", "s3://b/x", "",
                f"file://{outside}"):
        with pytest.raises(AdapterPathError):
            confined_folder(src, roots)
    link = model / "adapters" / "link"
    link.symlink_to(outside)
    try:
        with pytest.raises(AdapterPathError, match="outside"):
            confined_folder(str(link), roots)
    finally:
        link.unlink()
    with pytest.raises(BadCheckpoint, match=r"adapter_model\.bin is not read"):
        confined_folder(str(binonly), [binonly.parent])
    assert startup_adapters(tmp_path) == []


# --- requests ---

def test_each_convention_selects_the_adapter(served) -> None:
    client, _ = served
    base = text_of(client)
    with_a = text_of(client, adapters="a")
    assert with_a != base
    assert text_of(client, adapter_id="a") == with_a  # TGI
    assert text_of(client, headers={HEADER: "a"}) == with_a  # SageMaker
    assert text_of(client, adapters="nope", headers={HEADER: "a"}) == with_a  # header wins
    assert text_of(client, adapters="") == base
    both = generate(client, {"inputs": [PROMPT, PROMPT], "adapters": ["a", ""],
                             "parameters": GREEDY}).get_json()
    assert [r["generated_text"] for r in both] == [with_a, base]


def test_unknown_adapters_and_bad_lists_are_refused(served) -> None:
    client, _ = served
    for body, headers in (({"adapters": "nope"}, {}), ({"parameters": {"adapter_id": "nope"}},
                                                       {}), ({}, {HEADER: "nope"})):
        answer = generate(client, {"inputs": PROMPT, **body}, headers)
        assert answer.status_code == 424, answer.get_json()
        assert "nope" in answer.get_json()["message"]
    mismatch = generate(client, {"inputs": [PROMPT, PROMPT], "adapters": ["a"]})
    assert mismatch.status_code == 400 and "(1)" in mismatch.get_json()["message"]
    chat = client.post("/v1/chat/completions", json={
        "model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 404
    assert chat.get_json()["error"]["message"] == "The model `nope` does not exist."
    sm = client.post("/endpoints/e/invocations", json={"inputs": PROMPT},
                     headers={HEADER: "nope"})
    assert sm.status_code == 424 and sm.get_json()["OriginalStatusCode"] == 424


def test_models_lists_adapters_and_metrics_label_them(served, lora) -> None:
    client, state = served
    cards = client.get("/v1/models").get_json()["data"]
    base = cards[0]["id"]
    assert base == lora[0].name
    a = next(c for c in cards if c["id"] == "a")
    assert a["parent"] == base and a["root"] == str((lora[0] / "adapters" / "a").resolve())
    text_of(client, adapters="a")
    metrics = client.get("/metrics").get_data(as_text=True)
    assert 'batchyard_adapter_requests_total{adapter="a",status="200"}' in metrics
    assert 'batchyard_adapter_tokens_total{adapter="a",kind="generation"}' in metrics


# --- registration routes ---

def test_djl_routes_register_list_update_and_unregister(served, lora) -> None:
    client, _ = served
    src = str(lora[0] / "adapters" / "b")
    base = text_of(client)
    ok = client.post(f"/models/{lora[0].name}/adapters", query_string={"name": "b", "src": src})
    assert ok.status_code == 200 and ok.get_json() == {"status": "Adapter b registered"}
    try:
        assert text_of(client, adapters="b") not in (base, text_of(client, adapters="a"))
        again = client.post("/adapters", query_string={"name": "b", "src": src})
        assert again.status_code == 409
        listed = client.get(f"/models/{lora[0].name}/adapters").get_json()["adapters"]
        assert [x["name"] for x in listed] == ["a", "b"]
        assert client.get("/models/x/adapters").status_code == 404
        one = client.get(f"/models/{lora[0].name}/adapters/b").get_json()
        assert one[0]["src"] == str(Path(src).resolve())
        upd = client.post(f"/models/{lora[0].name}/adapters/b/update",
                          query_string={"pin": "true"})
        assert upd.get_json() == {"status": "Adapter b updated"}
    finally:
        gone = client.delete(f"/models/{lora[0].name}/adapters/b")
    assert gone.get_json() == {"status": "Adapter b unregistered"}
    assert client.delete("/adapters/b").status_code == 404
    assert client.get("/adapters/b").status_code == 404
    assert generate(client, {"inputs": PROMPT, "adapters": "b"}).status_code == 424


def test_registration_refusals(served, lora) -> None:
    client, _ = served
    model, _, outside, _ = lora
    cases = [({"name": "c"}, 400), ({"name": "c", "src": str(outside)}, 400),
             ({"name": "c", "src": f"{model}/adapters/../../outside/c"}, 400),
             ({"name": "../c", "src": str(model / "adapters" / "b")}, 400),
             ({"name": "c", "src": str(model / "adapters" / "binonly")}, 424)]
    for query, status in cases:
        answer = client.post("/adapters", query_string=query)
        assert answer.status_code == status, (query, answer.get_json())
    assert "adapter_model.bin is not read" in answer.get_json()["message"]
    # the engine's own reason (a rank above max_lora_rank) comes back with 424
    big = model / "adapters" / "big"
    shutil.copytree(model / "adapters" / "b", big)
    config = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
    refused = client.post("/adapters", query_string={"name": "big", "src": str(big)})
    assert refused.status_code == 424 and "big" in refused.get_json()["message"]


def test_sagemaker_component_routes_take_json_and_the_alias(served, lora) -> None:
    client, _ = served
    src = str(lora[0] / "adapters" / "b")
    ok = client.post("/adapters", json={"name": "sm-b", "src": src},
                     headers={"X-Amzn-SageMaker-Adapter-Alias": "adapter-ic"})
    assert ok.get_json() == {"status": "Adapter adapter-ic registered"}
    assert generate(client, {"inputs": PROMPT, "parameters": GREEDY},
                    {HEADER: "sm-b"}).status_code == 200
    assert client.delete("/adapters/sm-b").status_code == 200


def test_vllm_routes(served, lora) -> None:
    client, _ = served
    src = str(lora[0] / "adapters" / "b")
    load = client.post("/v1/load_lora_adapter", json={"lora_name": "vb", "lora_path": src})
    assert load.status_code == 200 and "added successfully" in load.get_data(as_text=True)
    assert client.post("/v1/load_lora_adapter",
                       json={"lora_name": "vb", "lora_path": src}).status_code == 400
    for body in ({"lora_name": "x"}, {"lora_name": "x", "lora_path": str(lora[2])},
                 {"lora_name": "x", "lora_path": str(lora[0] / "adapters" / "binonly")}):
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 400
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "vb"}).status_code == 200
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "vb"})
    assert gone.status_code == 404 and "cannot be found" in gone.get_json()["error"]["message"]


def test_lora_off_routes_answer_400(tmp_path_factory) -> None:
    model = build_tiny_model(tmp_path_factory.mktemp("lora-off"))
    engine = make_engine(model, "continuous")
    state = ServerState(ServingConfig(engine=engine.config, engine_process=False))
    state.serve(EngineClient(engine, 8, state.metrics.on_step))
    try:
        client = create_app(state).test_client()
        assert client.get("/adapters").status_code == 400
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}
                           ).status_code == 400
        assert generate(client, {"inputs": PROMPT, "adapters": "a"}).status_code == 424
        chat = client.post("/v1/completions", json={"model": "anything", "prompt": PROMPT,
                                                    "max_tokens": 2})
        assert chat.status_code == 200  # with LoRA off, `model` is not read (as before)
    finally:
        state.shutdown(grace_seconds=0.0)


# --- the official openai client ---

def test_openai_sdk_with_an_adapter_model(served, lora) -> None:
    client, state = served
    app = create_app(state)
    api = openai.OpenAI(base_url="http://lora.test/v1", api_key="unused", max_retries=0,
                        http_client=httpx2.Client(transport=httpx2.WSGITransport(app=app)))
    greedy: dict[str, Any] = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
    ids = state.engine.encode(PROMPT)
    expected = state.engine.decode(offline(lora[0], lora[0] / "adapters" / "a", list(ids)))
    base = state.engine.decode(offline(lora[0], None, list(ids)))
    assert expected != base
    whole = api.completions.create(model="a", prompt=PROMPT, **greedy)
    assert whole.model == "a" and whole.choices[0].text == expected
    chunks = list(api.completions.create(model="a", prompt=PROMPT, stream=True, **greedy))
    assert "".join(c.choices[0].text for c in chunks) == expected
    messages: Any = [{"role": "user", "content": "The capital of France is"}]
    chat_ids = state.engine.encode_chat(messages)
    chat_expected = state.engine.decode(offline(lora[0], lora[0] / "adapters" / "a",
                                                list(chat_ids)))
    chat = api.chat.completions.create(model="a", messages=messages, **greedy)
    assert chat.model == "a" and chat.choices[0].message.content == chat_expected
    streamed = list(api.chat.completions.create(model="a", messages=messages, stream=True,
                                                **greedy))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (
        chat_expected)
    assert api.chat.completions.create(model=lora[0].name, messages=messages, **greedy
                                       ).choices[0].message.content != chat_expected
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="nope", prompt=PROMPT, **greedy)


def test_an_update_the_engine_refuses_keeps_the_old_weights(served, lora) -> None:
    client, _ = served
    model = lora[0]
    before = text_of(client, adapters="a")
    dora = model / "adapters" / "dora"
    shutil.copytree(model / "adapters" / "a", dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    refused = client.post("/adapters/a/update", query_string={"src": str(dora)})
    assert refused.status_code == 424 and "DoRA" in refused.get_json()["message"]
    assert text_of(client, adapters="a") == before  # still registered, same weights


def test_an_adapter_name_past_the_limit_is_a_client_error_on_every_route(served) -> None:
    client, _ = served
    name = "x" * 300
    assert generate(client, {"inputs": PROMPT, "adapters": name}).status_code in (400, 424)
    headers = {"X-Amzn-SageMaker-Adapter-Identifier": name}
    assert generate(client, {"inputs": PROMPT}, headers).status_code in (400, 424)
    chat = client.post("/v1/chat/completions", json={
        "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    completion = client.post("/v1/completions", json={"model": name, "prompt": PROMPT,
                                                      "max_tokens": 2})
    assert chat.status_code in (400, 404) and completion.status_code in (400, 404)


def test_a_file_linked_out_of_an_allowed_folder_is_refused(lora, tmp_path) -> None:
    model, staged, outside, _ = lora
    folder = tmp_path / "adapters" / "linked"
    folder.mkdir(parents=True)
    shutil.copy(staged / "adapter_config.json", folder)
    (folder / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    with pytest.raises(AdapterPathError, match="adapter_model.safetensors links outside"):
        confined_folder(str(folder), [tmp_path / "adapters"])
