"""The README is the user's manual and docs/ holds the rest: the README stays short, and every
link, script, `batchyard` command and code path the pages name exists. No network, no GPU."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, ROOT / "docs" / "architecture.md", ROOT / "docs" / "deploy.md",
         ROOT / "docs" / "benchmark" / "README.md", ROOT / "docs" / "migrating.md",
         ROOT / "docs" / "openai.md", ROOT / "docs" / "reliability.md"]
MAX_README_LINES = 400

# Repository folders whose paths the pages name in code; benchmark/results/ is written by runs.
CODE_PATH = re.compile(r"(?<![\w./$<>~-])((?:engine|handler|benchmark|deploy|scripts|tests"
                       r"|notebooks|serving\.properties\.d)/[\w./-]*)")
GENERATED = ("benchmark/results/",)
SCRIPT = re.compile(r"(?<![\w/.-])(?:\./)?(scripts/[\w.-]+)")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?", re.M)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# `batchyard SUB [SUBSUB] ...`, also as .venv/bin/batchyard; `bench X` / `deploy X` spans too.
COMMAND = re.compile(r"(?<![^\s(])(?:[\w.~-]+/)*batchyard[ \t]+([a-z][\w-]*)"
                     r"(?:[ \t]+([a-z][\w-]*))?([^\n;|&#`]*)")
SHORT_COMMAND = re.compile(r"^(bench|deploy)[ \t]+([a-z][\w-]*)([^\n;|&#`]*)")
OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def split_fences(text: str) -> tuple[str, list[str]]:
    """(the text outside fenced code blocks, the blocks' contents)."""
    prose, blocks, block, fence = [], [], [], None
    for line in text.splitlines():
        marker = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if fence is None and marker:
            fence, block = marker.group(1), []
        elif fence is not None and line.strip().startswith(fence) and not line.strip(fence[0]):
            blocks.append("\n".join(block))
            fence = None
        elif fence is not None:
            block.append(line)
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def code_fragments(path: Path) -> list[str]:
    """Inline code spans and fenced blocks (backslash-continued lines joined)."""
    prose, blocks = split_fences(path.read_text())
    spans = [m.group(2).strip() for m in CODE_SPAN.finditer(prose)]
    return spans + [re.sub(r"\\\n\s*", " ", block) for block in blocks]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    prose, _ = split_fences(path.read_text())
    seen: dict[str, int] = {}
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", prose, re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        seen.setdefault(f"{base}-{n}" if n else base, 1)
    return frozenset(seen)


def broken_links(path: Path) -> list[str]:
    prose, _ = split_fences(path.read_text())
    prose = CODE_SPAN.sub(lambda m: "CODE" if "](" not in m.group(0) else m.group(0), prose)
    targets = INLINE_LINK.findall(prose) + REFERENCE_LINK.findall(prose)
    broken = []
    for target in targets:
        if re.match(r"[A-Za-z][\w+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            shown = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved
            broken.append(f"{target} (no {shown})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.name})")
    return broken


def commands(path: Path) -> list[tuple[tuple[str, ...], list[str]]]:
    """((subcommand[, subsubcommand]), options) for each `batchyard ...` the page names."""
    found = []
    for fragment in code_fragments(path):
        matches = [(m.group(1), m.group(2), m.group(3)) for m in COMMAND.finditer(fragment)]
        short = SHORT_COMMAND.match(fragment)
        if short:
            matches.append(short.groups())
        for sub, subsub, rest in matches:
            words = (sub, subsub) if subsub and sub in ("bench", "deploy") else (sub,)
            if subsub and sub not in ("bench", "deploy"):
                rest = f"{subsub} {rest}"
            options = OPTION.findall(rest.replace("[", " ").replace("]", " "))
            found.append((words, options))
    return found


@functools.cache
def cli_help(words: tuple[str, ...]) -> tuple[int, str]:
    """(exit status, help text) of `batchyard WORDS --help`, run as a separate process."""
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "handler.cli", *words, "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)
    return done.returncode, done.stdout + done.stderr


def test_readme_is_at_most_400_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (limit {MAX_README_LINES}): move history and internals "
        "to docs/")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert page.is_file()
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_paths_exist(page):
    missing = set()
    for fragment in code_fragments(page):
        for path in CODE_PATH.findall(fragment):
            path = path.rstrip(".")
            if not path.startswith(GENERATED) and not (ROOT / path).exists():
                missing.add(path)
    assert sorted(missing) == []


def test_scripts_named_in_readme_exist():
    scripts = set(SCRIPT.findall(README.read_text()))
    assert {"scripts/serve.sh", "scripts/test.sh"} <= scripts
    for script in sorted(scripts):
        assert (ROOT / script).is_file(), script
        assert os.access(ROOT / script, os.X_OK), f"{script} is not executable"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_batchyard_commands_exist(page):
    problems = []
    for words, options in commands(page):
        status, text = cli_help(words)
        if status != 0:
            problems.append(f"batchyard {' '.join(words)}: not a command ({text.strip()[-200:]})")
            continue
        for option in options:
            if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text):
                problems.append(f"batchyard {' '.join(words)}: no option {option}")
    assert problems == []


def test_readme_names_the_serve_bench_and_deploy_commands():
    named = {words for words, _ in commands(README)}
    assert {("serve",), ("bench", "sweep"), ("deploy", "create")} <= named


def test_every_configuration_key_and_env_alias_is_documented():
    from handler.config.properties import ENGINE_KEYS, ENV_ALIASES, SERVER_KEYS

    code = "\n".join(code_fragments(README))

    def documented(name: str) -> bool:  # `option.paged_attention=false` names the key too
        return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w.])", code) is not None

    keys = SERVER_KEYS | {f"option.{k}" for k in ENGINE_KEYS}
    assert sorted(k for k in keys if not documented(k)) == []
    assert sorted(v for v in ENV_ALIASES if not documented(v)) == []


def test_every_lmi_key_batchyard_does_not_act_on_is_in_the_migration_table():
    from handler.config.key_policy import NO_OP_KEYS, REFUSED_KEYS

    text = (ROOT / "docs" / "migrating.md").read_text()
    assert sorted(k for k in (*NO_OP_KEYS, *REFUSED_KEYS) if f"`{k}`" not in text) == []
