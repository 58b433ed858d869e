"""Tool calling's pieces without a server: the grammar each tool_choice makes, parsing an answer
into tool_calls, the prompt for templates without tools, and how a call streams."""

from __future__ import annotations

import json

import pytest

from engine import RequestError, TokenEvent
from engine.guided import check_spec
from handler.http.chat import parse_chat
from handler.http.chat_route import ChoiceStream
from handler.http.tools import history, parse_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


def tools(choice=None):
    body = {"tools": [WEATHER]}
    if choice is not None:
        body["tool_choice"] = choice
    return parse_tools(body)


def test_each_tool_choice_makes_its_grammar() -> None:
    assert tools("none").spec() is None
    assert tools("required").spec().kind == "json"
    assert tools({"type": "function", "function": {"name": "get_weather"}}).choice == \
        "get_weather"
    auto = tools()
    assert auto.choice == "auto" and auto.spec().kind == "grammar"
    for t in (tools("required"), auto):
        check_spec(t.spec())


def test_answers_parse_into_calls_or_stay_text() -> None:
    content, [call] = tools("required").parse(CALL)
    assert content is None and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert tools("required").parse('{"name": "get_wea') == ('{"name": "get_wea', [])
    _, [cut] = tools("required").parse(CALL[:-6])  # max_tokens cut the arguments
    assert cut["function"]["arguments"] == '{"city": "O'
    assert tools().parse(f"<tool_call>{CALL}</tool_call>")[1]
    assert tools().parse("Sunny, I think.") == ("Sunny, I think.", [])


def test_templates_without_tools_get_a_system_message_and_calls_as_text() -> None:
    chat = parse_chat({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "5 C"}], "tools": [WEATHER]},
        wants_stream=False)
    shown = history(chat.messages, chat.tools, template_takes_tools=False)
    assert shown[0]["role"] == "system" and "get_weather" in shown[0]["content"]
    assert shown[2]["content"] == f"<tool_call>{CALL}</tool_call>"
    native = history(chat.messages, chat.tools, template_takes_tools=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


def test_the_tools_message_joins_a_system_message_and_says_none_means_text() -> None:
    chat = parse_chat({"messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi"}],
                       "tools": [WEATHER], "tool_choice": "none"}, wants_stream=False)
    [system, user] = history(chat.messages, chat.tools, template_takes_tools=False)
    assert system["content"].startswith("Be brief.\n\nYou can call these tools")
    assert "Do not call a tool now" in system["content"] and user["content"] == "Hi"


def test_bad_tool_calls_in_history_are_refused() -> None:
    with pytest.raises(Exception, match="tool_calls must be"):
        parse_chat({"messages": [{"role": "assistant", "tool_calls": [{"function": {
            "name": "x", "arguments": "{not json"}}]}]}, wants_stream=False)
    with pytest.raises(RequestError, match="tool_choice needs tools"):
        parse_tools({"tool_choice": "auto"})


def events(*texts: str, end: str = "eos_token") -> list[TokenEvent]:
    return [TokenEvent("r", i, text, None, 3, i + 1, end if i == len(texts) - 1 else None)
            for i, text in enumerate(texts)]


def streamed(choice, texts, end: str = "eos_token") -> list[dict]:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "tools": [WEATHER]}
    if choice is not None:
        body["tool_choice"] = choice
    chat = parse_chat(body, wants_stream=True)
    stream = ChoiceStream(chat, "m", lambda ids: "")
    return [chunk for event in events(*texts, end=end) for chunk in stream.feed(event)]


def assembled(chunks: list[dict]) -> tuple[str, str, list[str]]:
    """(name, arguments, argument pieces) from a stream's tool_calls deltas."""
    entries = [e for c in chunks for e in c["choices"][0]["delta"].get("tool_calls") or []]
    assert entries and all(e["index"] == 0 for e in entries)
    assert entries[0]["id"].startswith("call_") and entries[0]["type"] == "function"
    pieces = [e["function"].get("arguments", "") for e in entries]
    return entries[0]["function"]["name"], "".join(pieces), pieces


def test_auto_streams_text_at_once_and_a_call_as_argument_deltas() -> None:
    text = streamed(None, ["", "Sun", "ny"])  # "" : the first bytes of a character
    assert [c["choices"][0]["delta"].get("content") for c in text] == ["", "Sun", "ny"]
    assert text[-1]["choices"][0]["finish_reason"] == "stop"
    pieces = ["<tool", "_call>", CALL[:12], CALL[12:33], CALL[33:40], CALL[40:], "</tool_call>"]
    chunks = streamed(None, pieces)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    name, arguments, sent = assembled(chunks)
    assert name == "get_weather" and json.loads(arguments) == {"city": "Oslo"}
    assert len([p for p in sent if p]) >= 2  # the arguments came in pieces
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(c["choices"][0]["delta"].get("content") is None for c in chunks)


def test_a_forced_call_streams_its_arguments_and_holds_its_closing_brace() -> None:
    chunks = streamed("required", [CALL[:9], CALL[9:31], CALL[31:-2], CALL[-2:]])
    name, arguments, _ = assembled(chunks)
    assert (name, json.loads(arguments)) == ("get_weather", {"city": "Oslo"})
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("choice", ["required", None])
def test_a_call_cut_by_max_tokens_streams_what_the_whole_answer_returns(choice) -> None:
    text = ("<tool_call>" if choice is None else "") + CALL[:-6]
    pieces = [text[:15], text[15:30], text[30:]]
    chunks = streamed(choice, pieces, end="length")
    name, arguments, _ = assembled(chunks)
    _, [whole] = tools(choice).parse(text)
    assert (name, arguments) == ("get_weather", whole["function"]["arguments"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    early = streamed(None, ["<tool", "_call>{\"na"], end="length")  # cut before the name
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in early) == \
        '<tool_call>{"na'
