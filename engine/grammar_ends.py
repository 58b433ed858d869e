"""Which rules of a Lark grammar (llguidance's dialect) can never end: the rules that no finite
string satisfies, such as `start: "a" start`. llguidance compiles such a grammar without a word
and its parser blows up once generation reaches the recursion; this finds it from the text,
before a request is queued. Conservative: anything it does not understand gives None (no
verdict), and every terminal, token and %json / %regex block counts as able to end (the
dry run in engine/guided.py sees the rest)."""

from __future__ import annotations

import re

_TOKEN = re.compile(r"""
    (?P<nl>\r?\n) | (?P<ws>[ \t\f]+) | (?P<comment>//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?) | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<token><[^<>\n]+>) | (?P<directive>%[A-Za-z_]+)
  | (?P<name>[A-Za-z_][A-Za-z_0-9]*) | (?P<number>[0-9]+)
  | (?P<punct>\.\.|->|[:|()\[\]?*+~.,=!{}])
""", re.VERBOSE)
# A definition's head: [?!]name[.priority][[attributes]]:
_HEAD = re.compile(r"[?!]?([A-Za-z_][A-Za-z_0-9]*)(\.-?[0-9]+)?(\[[^\]\n]*\])?\s*:")
_BLOCK_DIRECTIVES = ("%json", "%regex", "%lark")

Node = tuple  # ("alt", [seq...]) | ("seq", [item...]) | ("ref", name) | ("end",) | ("opt",)


class _Unknown(Exception):
    """Syntax this check does not model: no verdict."""


def endless_rules(lark: str) -> list[str] | None:
    """The rules that can never end, when `start` is one of them (else []); None when the
    text is beyond this check."""
    try:
        rules = _parse(lark)
        if "start" not in rules:
            return None
        ends = _ending(rules)
    except (_Unknown, IndexError, RecursionError):
        return None
    if ends["start"]:
        return []
    return sorted(name for name, done in ends.items() if not done)


def _ending(rules: dict[str, Node]) -> dict[str, bool]:
    """Rule → whether some finite string satisfies it: a least fixpoint, each rule looked at
    again only when a rule it names is found to end."""
    users: dict[str, set[str]] = {name: set() for name in rules}
    for name, body in rules.items():
        for used in _refs(body):
            if used in users:
                users[used].add(name)
    ends = dict.fromkeys(rules, False)
    todo = list(rules)
    while todo:
        name = todo.pop()
        if not ends[name] and _ends(rules[name], ends):
            ends[name] = True
            todo.extend(u for u in users[name] if not ends[u])
    return ends


def _refs(node: Node) -> set[str]:
    if node[0] == "ref":
        return {node[1]}
    if node[0] in ("alt", "seq"):
        return set().union(*(_refs(n) for n in node[1]))
    return set()


def _ends(node: Node, ends: dict[str, bool]) -> bool:
    kind = node[0]
    if kind == "alt":
        return any(_ends(n, ends) for n in node[1])
    if kind == "seq":
        return all(_ends(n, ends) for n in node[1])
    if kind == "ref":
        return ends.get(node[1], True)  # terminals, imports: able to end
    return True  # "end" (a terminal) or "opt" (may be left out)


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    at = 0
    while at < len(text):
        match = _TOKEN.match(text, at)
        if match is None:
            raise _Unknown(text[at:at + 20])
        kind, value = match.lastgroup or "", match.group()
        at = match.end()
        if kind == "directive" and value in _BLOCK_DIRECTIVES:
            at = _skip_block(text, at)
            out.append(("block", value))
        elif kind not in ("ws", "comment"):
            out.append((kind, value))
    return out


def _skip_block(text: str, at: int) -> int:
    """Past a {...} block (JSON: braces inside strings do not count)."""
    while at < len(text) and text[at] in " \t":
        at += 1
    if at >= len(text) or text[at] != "{":
        raise _Unknown("a directive without a block")
    depth, in_string = 0, False
    while at < len(text):
        ch = text[at]
        if in_string:
            if ch == "\\":
                at += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return at + 1
        at += 1
    raise _Unknown("an unclosed block")


def _parse(lark: str) -> dict[str, Node]:
    """Rule name → its expansions; terminals (upper case) and directives are skipped."""
    rules: dict[str, list[Node]] = {}
    current: list[tuple[str, str]] | None = None
    bodies: list[tuple[str, list[tuple[str, str]]]] = []
    for line in _lines(lark):
        head = _HEAD.match(line.lstrip())
        if line.lstrip().startswith("//"):
            continue
        if head is not None:
            current = []
            bodies.append((head.group(1), current))
            line = line.lstrip()[head.end():]
        elif line.lstrip().startswith("%"):
            if not line.lstrip().startswith(_BLOCK_DIRECTIVES):
                current = None  # %import, %ignore, %llguidance {...}: not a rule's body
                continue
        elif current is None:
            if line.strip():
                raise _Unknown("text outside a definition")
            continue
        if current is not None:
            current.extend(_tokens(line))
    for name, tokens in bodies:
        if name[0].isupper():
            continue  # a terminal: never recursive
        node, rest = _expansions(tokens, 0)
        if rest != len(tokens):
            raise _Unknown(f"unexpected {tokens[rest][1]!r}")
        rules.setdefault(name, []).append(node)
    return {name: ("alt", nodes) for name, nodes in rules.items()}


def _lines(text: str) -> list[str]:
    """Logical lines: a %json/%regex/%lark block spanning lines stays on its definition's."""
    lines: list[str] = []
    depth = 0
    for raw in text.splitlines():
        if depth > 0:
            lines[-1] += "\n" + raw
        else:
            lines.append(raw)
        depth = max(0, depth + _brace_balance(raw))
    return lines


def _brace_balance(line: str) -> int:
    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', "", line.split("//")[0])
    return without_strings.count("{") - without_strings.count("}")


def _expansions(tokens: list[tuple[str, str]], at: int) -> tuple[Node, int]:
    alternatives = []
    while True:
        items = []
        while at < len(tokens) and tokens[at][1] not in ("|", ")", "]", "->") \
                and tokens[at][0] != "nl":
            item, at = _item(tokens, at)
            items.append(item)
        if at < len(tokens) and tokens[at][1] == "->":
            at += 2  # an alias names the tree node only
        alternatives.append(("seq", items))
        while at < len(tokens) and tokens[at][0] == "nl":
            at += 1  # a body continues on the next lines (`| ...`)
        if at < len(tokens) and tokens[at][1] == "|":
            at += 1
            continue
        return ("alt", alternatives), at


def _item(tokens: list[tuple[str, str]], at: int) -> tuple[Node, int]:
    kind, value = tokens[at]
    if kind in ("string", "regex", "token", "block"):
        atom: Node = ("end",)
        at += 1
        if at + 1 < len(tokens) and tokens[at][1] == ".." and tokens[at + 1][0] == "string":
            at += 2  # "a".."z"
    elif kind == "name":
        atom, at = ("ref", value), at + 1
    elif value in ("(", "["):
        inner, at = _expansions(tokens, at + 1)
        if at >= len(tokens) or tokens[at][1] != {"(": ")", "[": "]"}[value]:
            raise _Unknown("an unclosed group")
        atom, at = (inner if value == "(" else ("opt",)), at + 1
    else:
        raise _Unknown(f"unexpected {value!r}")
    if at < len(tokens) and tokens[at][1] in ("?", "*"):
        return ("opt",), at + 1
    if at < len(tokens) and tokens[at][1] == "+":
        return atom, at + 1
    if at < len(tokens) and tokens[at][1] == "~":
        if at + 1 >= len(tokens) or tokens[at + 1][0] != "number":
            raise _Unknown("~ without a count")
        low, at = int(tokens[at + 1][1]), at + 2
        if at + 1 < len(tokens) and tokens[at][1] == "..":
            at += 2
        return (("opt",) if low == 0 else atom), at
    return atom, at
