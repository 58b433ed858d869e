"""LoRA adapters through the serving layer (EngineClient): registered, listed and removed with
the engine on the loop's thread, in a core process, and in a core shared by two fronts (each sees
the other's registrations); the engine's refusals come back as the same exception with the same
message; a request naming an unknown adapter is refused at submit; a registered one is served
(its greedy tokens differ from the base model's); removal lets a running request finish."""

from __future__ import annotations

import pickle
import threading
from dataclasses import replace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from engine import (
    AdapterError,
    AdapterNotFound,
    EngineClient,
    EngineConfig,
    EngineDeadError,
    GenerationRequest,
    UnknownAdapter,
)
from engine.core.adapters import AdapterReply
from engine.core.engine_core import CoreUpdate
from engine.core.server import CoreServer
from engine.inputs import RemoveAdapter
from engine.outputs import Gauges
from engine.serving.adapters import AdapterMirror
from tests.engine_harness import MAX_MODEL_LEN, greedy, make_engine, wait_until
from tests.models_fixtures import build_tiny_model

PROMPT = (5, 6, 7, 8, 9)
LONG = MAX_MODEL_LEN - 8


def make_adapter(base, folder, seed: int) -> str:
    """A PEFT adapter with B not zero (PEFT's start: no update to see), saved to `folder`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                  target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    peft_model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """The base model, adapter "a" (registered at start) and "b" (registered by the tests)."""
    root = tmp_path_factory.mktemp("lora-serving")
    base = build_tiny_model(root / "base", arch="llama")
    (root / "empty").mkdir()
    return (base, make_adapter(base, root / "a", 1), make_adapter(base, root / "b", 2),
            str(root / "empty"))


def config(lora) -> EngineConfig:
    base, a, _, _ = lora
    return EngineConfig(model=str(base), batching="paged", max_num_seqs=4, dtype="float32",
                        device="cpu", max_model_len=MAX_MODEL_LEN, enable_lora=True,
                        max_loras=2, max_lora_rank=8, lora_modules=(("a", a),))


@pytest.fixture(scope="module", params=["thread", "process"])
def client(request, lora):
    served = EngineClient.from_config(config(lora), max_queued=8,
                                      process=request.param == "process")
    served.start()
    yield served
    served.shutdown(grace_seconds=0)


def tokens(client: EngineClient, adapter: str | None, n: int = 8) -> list[int]:
    handle = client.submit(GenerationRequest(PROMPT, replace(greedy(n), adapter=adapter)))
    events = list(handle.events())
    assert events[-1].finish_reason == "length", events[-1]
    return [e.token_id for e in events if e.token_id is not None]


def test_adapters_are_added_listed_served_and_removed(client, lora) -> None:
    _, a, b, _ = lora
    assert client.lora_enabled
    assert client.adapters() == [("a", a)] and client.has_adapter("a")
    base = tokens(client, None)
    client.add_adapter("b", b)  # a request naming it is accepted at once
    try:
        with_b = tokens(client, "b")
        assert client.adapters() == [("a", a), ("b", b)] and client.has_adapter("b")
        assert with_b != base and tokens(client, "a") not in (base, with_b)
    finally:
        client.remove_adapter("b")
    assert client.adapters() == [("a", a)] and not client.has_adapter("b")
    assert tokens(client, None) == base


def test_refusals_come_back_as_the_engines_exceptions(client, lora) -> None:
    _, a, _, empty = lora
    with pytest.raises(AdapterError, match=r"adapter 'e'.*adapter_config.json is missing"):
        client.add_adapter("e", empty)
    with pytest.raises(AdapterError, match="'a' is already registered"):
        client.add_adapter("a", a)
    with pytest.raises(AdapterNotFound) as err:
        client.remove_adapter("nope")
    assert err.value.args == ("nope",)
    assert client.adapters() == [("a", a)]


def test_an_unknown_adapter_is_refused_at_submit(client) -> None:
    before = client.gauges().num_in_flight
    with pytest.raises(UnknownAdapter, match="'nope' is not registered") as err:
        client.submit_all([GenerationRequest(PROMPT, greedy(4)),
                           GenerationRequest(PROMPT, replace(greedy(4), adapter="nope"))])
    assert err.value.field == "adapter"
    assert client.gauges().num_in_flight == before  # all or none: nothing was queued


def test_a_request_running_with_a_removed_adapter_finishes_with_it(client, lora) -> None:
    _, _, b, _ = lora
    client.add_adapter("b", b)
    expected = tokens(client, "b", LONG)
    handle = client.submit(GenerationRequest(PROMPT, replace(greedy(LONG), adapter="b")))
    events = handle.events()
    first = next(events)
    client.remove_adapter("b")
    with pytest.raises(UnknownAdapter):
        client.submit(GenerationRequest(PROMPT, replace(greedy(4), adapter="b")))
    rest = list(events)
    assert rest[-1].finish_reason == "length"
    assert [first.token_id] + [e.token_id for e in rest if e.token_id is not None] == expected
    assert not client.has_adapter("b")


def test_without_lora_adding_raises_runtime_error(lora) -> None:
    client = EngineClient(make_engine(lora[0], "paged"), max_queued=4)
    client.start()
    try:
        assert not client.lora_enabled and client.adapters() == []
        with pytest.raises(RuntimeError, match="LoRA is not enabled"):
            client.add_adapter("b", lora[2])
        with pytest.raises(UnknownAdapter):
            client.submit(GenerationRequest(PROMPT, replace(greedy(4), adapter="b")))
    finally:
        client.shutdown(grace_seconds=0)
    with pytest.raises(EngineDeadError):  # stopped: nobody would answer
        client.add_adapter("b", lora[2])


def test_fronts_of_one_core_see_each_others_adapters(lora) -> None:
    _, a, b, _ = lora
    server = CoreServer(config(lora))
    server.wait_listening()
    fronts: list[EngineClient] = []
    try:
        def front(start: bool = True) -> EngineClient:
            client = EngineClient.connect(config(lora), server.address.path,
                                          server.address.authkey, max_queued=8)
            fronts.append(client)
            if start:
                client.start()
            return client

        one, two = front(), front()
        late = front(start=False)  # greeted, not reading yet (as while it loads its tokenizer)
        base = tokens(two, None)
        one.add_adapter("b", b)
        wait_until(lambda: two.has_adapter("b"))
        late.start()  # the list it missed comes first
        wait_until(lambda: late.has_adapter("b"))
        assert two.adapters() == [("a", a), ("b", b)]
        assert tokens(two, "b") != base
        assert front().adapters() == [("a", a), ("b", b)]  # a later front is greeted with it
        with pytest.raises(AdapterError, match="already registered"):
            two.add_adapter("b", b)
        two.remove_adapter("b")
        wait_until(lambda: not one.has_adapter("b"))
        with pytest.raises(AdapterNotFound):
            one.remove_adapter("b")
        server._process.kill()  # a dead core answers no call: the caller raises
        wait_until(lambda: not one.is_alive())
        with pytest.raises(EngineDeadError):
            one.add_adapter("c", b)
    finally:
        for client in fronts:
            client.shutdown(grace_seconds=0)
        server.stop()


def test_a_caller_waiting_for_a_reply_is_woken_when_the_output_thread_stops() -> None:
    sent: list = []
    mirror = AdapterMirror(sent.append, "req-", (), lambda: True)
    mirror.open()
    got: list = []
    caller = threading.Thread(target=lambda: got.append(
        mirror.call(lambda call_id: RemoveAdapter(call_id, "x"))))
    caller.start()
    wait_until(lambda: bool(sent))
    mirror.close()
    caller.join(5)
    assert got == [None] and not caller.is_alive()
    # and a reply that comes is applied after the list it carries
    mirror.open()
    caller = threading.Thread(target=lambda: got.append(
        (mirror.call(lambda call_id: RemoveAdapter(call_id, "x")), mirror.has("x"))))
    caller.start()
    wait_until(lambda: len(sent) == 2)
    gauges = make_gauges()
    mirror.apply(CoreUpdate([], gauges, replies=(AdapterReply(sent[1].call_id),),
                            adapters=(("x", "/x"),)))
    caller.join(5)
    assert got[1] == (AdapterReply(sent[1].call_id), True)


def make_gauges() -> Gauges:
    return Gauges(True, 0, 0, 0, 0, 0, 16, 1, 0.0)


def test_adapter_news_survives_the_pipe() -> None:
    update = CoreUpdate([], make_gauges(), None, (AdapterReply("c1", "AdapterNotFound", "x"),),
                        (("x", "/x"),))
    back = pickle.loads(pickle.dumps(update))
    assert back.replies == update.replies and back.adapters == update.adapters
    with pytest.raises(AdapterNotFound):
        back.replies[0].raise_error()
