"""OpenAI tool calling: `tools` + `tool_choice` → what the prompt shows and which grammar guides
the answer; the answer's text → `tool_calls`.

A call is generated as the JSON object {"name": ..., "arguments": {...}}, its arguments held to
the function's `parameters` schema by a grammar (engine/guided.py). `required` and a named
function make the whole answer one call; `auto` lets the model answer text or one call wrapped in
<tool_call>...</tool_call> (Hermes' and Qwen's convention), text never starting with "<"."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from engine import GuidedSpec, RequestError, check_spec

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 64
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")
# JSON as engine/guided.py writes it, also inside a Lark grammar's %json
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Tools:
    functions: tuple[dict, ...]  # {"name", "description"?, "parameters"?} each
    choice: str  # none, auto, required, or the one function's name

    @property
    def calls(self) -> bool:
        """The answer may (auto) or must be a call."""
        return self.choice != "none"

    def spec(self) -> GuidedSpec | None:
        """The grammar of the answer (None: free text)."""
        if self.choice == "none":
            return None
        named = [f for f in self.functions if f["name"] == self.choice] or list(self.functions)
        call = {"anyOf": [_call_schema(f) for f in named], "x-guidance": _COMPACT}
        if self.choice != "auto":
            return GuidedSpec.json_schema(call, "tools")
        grammar = (f'start: TEXT | call\nTEXT: /[^<](.|\\n)*/\n'
                   f'call: {json.dumps(CALL_OPEN)} body {json.dumps(CALL_CLOSE)}\n'
                   f'body: %json {json.dumps(call)}')
        return GuidedSpec("grammar", grammar, "tools")

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of an answer, as a stream shows it: a call once its name is
        complete, with its arguments as generated (cut short with the answer when max_tokens
        cut it: finish_reason length says so); text otherwise."""
        if self.choice == "none" or (self.choice == "auto" and not text.startswith(CALL_OPEN)):
            return text, []
        stream = CallStream(wrapped=self.choice == "auto")
        stream.feed(text)
        if stream.name is None:  # cut before the name was complete
            return text, []
        return None, [tool_call(stream.name, stream.arguments(finished=True))]


class CallStream:
    """A call's text, as it grows → OpenAI tool_calls deltas: the id and name once known, then
    the arguments' text piece by piece. The grammar writes a call exactly as
    {"name": "N", "arguments": ARGS} (inside <tool_call>...</tool_call> under auto), so the
    arguments are what lies between that head and the closing tail, which is held back."""

    HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')

    def __init__(self, wrapped: bool) -> None:
        self.id = f"call_{uuid.uuid4().hex[:24]}"
        self.name: str | None = None  # once the head is complete
        self._text = ""
        self._skip = len(CALL_OPEN) if wrapped else 0
        self._tail = "}" + (CALL_CLOSE if wrapped else "")
        self._sent = -1  # characters of the arguments sent; -1: not even the name yet

    @property
    def text(self) -> str:
        return self._text

    def arguments(self, finished: bool = False) -> str:
        """The arguments' text so far: without the closing tail once the call is complete;
        all of it when the answer ended without completing the call."""
        head = self.HEAD.match(self._text, self._skip)
        if head is None:
            return ""
        body = self._text[head.end():]
        if self._text.endswith(self._tail) and _is_json(self._text[self._skip:len(
                self._text) - len(self._tail) + 1]):
            return body[:-len(self._tail)]
        return body if finished else body[:max(0, len(body) - len(self._tail))]

    def rest(self) -> list[dict]:
        """At the end of the answer: the arguments' text not sent yet (what the tail held back
        when max_tokens cut the call)."""
        left = self.arguments(finished=True)[max(self._sent, 0):]
        self._sent = max(self._sent, 0) + len(left)
        return [{"index": 0, "function": {"arguments": left}}] if left else []

    def feed(self, piece: str) -> list[dict]:
        """The deltas (at most one entry) that `piece` completes."""
        self._text += piece
        head = self.HEAD.match(self._text, self._skip)
        if head is None:
            return []
        ready = self.arguments()
        entry: dict = {"index": 0, "function": {}}
        if self._sent < 0:
            self.name = json.loads(head.group(1))
            entry.update(id=self.id, type="function")
            entry["function"]["name"] = self.name
            self._sent = 0
        if len(ready) > self._sent:
            entry["function"]["arguments"] = ready[self._sent:]
            self._sent = len(ready)
        elif "name" in entry["function"]:
            entry["function"]["arguments"] = ""
        else:
            return []
        return [entry]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _call_schema(function: dict) -> dict:
    return {"type": "object", "properties": {
        "name": {"const": function["name"]},
        "arguments": function.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False}


def parse_tools(body: dict) -> Tools | None:
    """The body's tools and tool_choice, checked (RequestError naming the field)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise RequestError(f"tools must be a list of 1 to {MAX_TOOLS} functions", "tools")
    functions = tuple(_function(tool, i) for i, tool in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise RequestError("tools must have distinct function names", "tools")
    picked = _choice("auto" if choice is None else choice, names)
    result = Tools(functions, picked)
    spec = result.spec()  # None exactly when the answer makes no calls
    if spec is not None:
        check_spec(spec)
    return result


def _function(tool: object, i: int) -> dict:
    field = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
            tool.get("function"), dict) or set(tool) - {"type", "function"}:
        raise RequestError(f'{field} must be {{"type": "function", "function": {{...}}}}', field)
    function = tool["function"]
    if set(function) - {"name", "description", "parameters", "strict"}:
        raise RequestError(f"{field}.function takes name, description, parameters, strict",
                           field)
    if not isinstance(function.get("name"), str) or not _NAME.fullmatch(function["name"]):
        raise RequestError(f"{field}.function.name must be 1 to 64 letters, digits, _ or -",
                           field)
    if not isinstance(function.get("description", ""), str) or not isinstance(
            function.get("parameters", {}), dict):
        raise RequestError(f"{field}.function: description must be a string and parameters "
                           "a JSON schema object", field)
    return function


def _choice(choice: object, names: list[str]) -> str:
    if isinstance(choice, str):
        if choice not in _CHOICES:
            raise RequestError(f"tool_choice must be one of {', '.join(_CHOICES)} or "
                               '{"type": "function", "function": {"name": ...}}', "tool_choice")
        return choice
    if (not isinstance(choice, dict) or choice.get("type") != "function"
            or not isinstance(choice.get("function"), dict)
            or choice["function"].get("name") not in names):
        raise RequestError("tool_choice names no function of tools (expected "
                           '{"type": "function", "function": {"name": ...}})', "tool_choice")
    return choice["function"]["name"]


def tools_prompt(tools: Tools) -> str:
    """A system message for chat templates that do not render tools themselves."""
    listed = "\n".join(json.dumps(f, ensure_ascii=False) for f in tools.functions)
    how = {"auto": 'To call a tool, answer only <tool_call>{"name": <name>, "arguments": '
                   "<arguments>}</tool_call>; otherwise answer in text.",
           "none": "Do not call a tool now: answer in text."}.get(
        tools.choice, 'Answer only with {"name": <name>, "arguments": <arguments>} for one tool.')
    return f"You can call these tools:\n{listed}\n{how}"


def history(messages: list[dict], tools: Tools | None, template_takes_tools: bool) -> list[dict]:
    """Messages as the chat template will see them: the tools' system message when the template
    cannot render tools, and earlier assistant calls as text when it cannot render calls."""
    if template_takes_tools:
        return messages
    shown = [_as_text(m) for m in messages]
    if tools is None:
        return shown
    if shown[0]["role"] == "system":  # one system message: some templates allow no second
        first = shown[0]
        return [{**first, "content": f"{first['content']}\n\n{tools_prompt(tools)}"},
                *shown[1:]]
    return [{"role": "system", "content": tools_prompt(tools)}, *shown]


def _as_text(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    # arguments: a dict by now (handler/http/chat.py parsed them)
    text = "".join(CALL_OPEN + json.dumps({"name": c["function"]["name"],
                                           "arguments": c["function"]["arguments"]},
                                          ensure_ascii=False) + CALL_CLOSE for c in calls)
    return {"role": message["role"], "content": (message.get("content") or "") + text}
