"""The layering holds: handler/ reaches the engine only through its public face, engine/ knows
nothing of the HTTP edge, engine/'s packages import only the layers below them, and no import
cycle exists, function-level imports included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "handler", "benchmark", "deploy")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(path: Path) -> list[str]:
    """Every module an import statement names, at any depth; `if TYPE_CHECKING:` blocks are
    skipped because they never run. `from a import b` names a.b (if b is a module) and a."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return names


def import_graph() -> dict[str, set[str]]:
    """Our module -> the modules of ours it imports (names that are not modules are dropped)."""
    modules = our_modules()
    return {name: {n for n in imported_names(path) if n in modules and n != name}
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_handler_imports_only_the_engines_public_face() -> None:
    modules = our_modules()
    reaching_in = [(name, imported) for name, path in modules.items()
                   if name.startswith("handler")
                   for imported in imported_names(path)
                   if imported.startswith("engine.")
                   and not _is_public_name(imported, modules)]
    assert reaching_in == [], "handler/ must import from `engine` only"


def _is_public_name(imported: str, modules: dict[str, Path]) -> bool:
    """`from engine import X` is recorded as engine and engine.X; X must not be a module."""
    return imported.count(".") == 1 and imported not in modules


def test_engine_knows_nothing_of_the_edge() -> None:
    forbidden = ("handler", "benchmark", "deploy", "flask", "gunicorn", "werkzeug")
    leaks = [(name, imported) for name, path in our_modules().items()
             if name.startswith("engine")
             for imported in imported_names(path)
             if imported.split(".")[0] in forbidden]
    assert leaks == []


def test_engine_internals_do_not_import_the_public_face() -> None:
    """engine/__init__ imports the internals; an internal importing it back is a cycle."""
    graph = import_graph()
    back = [name for name, imports in graph.items()
            if name.startswith("engine.") and "engine" in imports]
    assert back == []


# engine/'s rooms, bottom to top, and what each may import besides itself. "base" is the modules
# directly in engine/ that every layer uses (config, the request's records); "face" is
# engine/__init__.py. A new package, or a new edge between two, is a decision: make it here.
ENGINE_BASE = ("config", "sequence", "sampling_params", "guided", "grammar_ends", "inputs",
               "outputs", "heap", "model_files")
ENGINE_LAYERS: dict[str, set[str]] = {
    "base": set(),
    "kernels": {"base"},
    "kv": {"base"},
    "text": {"base"},
    "observe": {"base"},
    "parallel": {"base"},
    "attention": {"base", "kernels"},
    "quant": {"base", "kernels"},
    "models": {"base", "kernels", "parallel", "attention", "quant"},
    "lora": {"base", "kernels", "models"},
    "scheduler": {"base", "kv", "models"},
    "runner": {"base", "kernels", "kv", "observe", "parallel", "attention", "models", "lora",
               "scheduler"},
    "spec": {"base", "kv", "parallel", "runner", "scheduler"},
    "llm_engine": {"base", "kv", "text", "observe", "parallel", "models", "lora", "scheduler",
                   "runner", "spec"},
    "core": {"base", "text", "observe", "parallel", "lora", "runner", "llm_engine"},
    "disagg": {"base", "text", "runner", "llm_engine", "core"},
    "serving": {"base", "text", "lora", "core", "llm_engine", "disagg"},
    "face": {"base", "models", "lora", "llm_engine", "core", "disagg", "serving"},
}


def engine_room(module: str) -> str:
    """The room of ENGINE_LAYERS an engine module lives in."""
    parts = module.split(".")
    if len(parts) == 1:
        return "face"
    if parts[1] in ENGINE_BASE:
        return "base"
    return parts[1]


def test_engine_packages_import_only_the_layers_below() -> None:
    modules = our_modules()
    rooms = {engine_room(name) for name in modules if name.startswith("engine")}
    assert rooms == set(ENGINE_LAYERS), "a module of engine/ outside every listed room"
    upward = sorted((name, imported) for name, imports in import_graph().items()
                    if name.startswith("engine") for imported in imports
                    if imported.startswith("engine")
                    and engine_room(imported) != engine_room(name)
                    and engine_room(imported) not in ENGINE_LAYERS[engine_room(name)])
    assert upward == []


def test_engine_root_holds_at_most_twelve_modules() -> None:
    assert len(list((ROOT / "engine").glob("*.py"))) <= 12


def test_graphs_never_import_the_runner_they_are_handed_to() -> None:
    """engine/runner/graphs/ builds step objects; runner/graphs/setup.py hands them to the
    ModelRunner (typed under TYPE_CHECKING only), which imports them."""
    above = {"engine.runner.model_runner", "engine.runner.setup",
             "engine.runner.attention_check"}
    reaching_up = [(name, imported) for name, imports in import_graph().items()
                   if name.startswith("engine.runner.graphs")
                   for imported in imports if imported in above]
    assert reaching_up == []


def runner_field_writes(path: Path) -> list[str]:
    """`runner.x = ...` / `self.runner.x = ...` (any depth ending in `.runner.x`) in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                   else [])
        for target in targets:
            owner = target.value if isinstance(target, ast.Attribute) else None
            name = (owner.id if isinstance(owner, ast.Name)
                    else owner.attr if isinstance(owner, ast.Attribute) else None)
            if name == "runner":
                found.append(f"{path}:{node.lineno}")
    return found


def test_nothing_outside_the_runner_assigns_its_fields(tmp_path) -> None:
    """The runner's paths (graphs, attention backend, peers, phase clock) change through its
    use_* methods, so that what it holds is decided in one file."""
    writes = [w for path in (ROOT / "engine").rglob("*.py")
              if path != ROOT / "engine/runner/model_runner.py"
              for w in runner_field_writes(path)]
    assert writes == []
    probe = tmp_path / "probe.py"
    probe.write_text("runner.padded_decode = None\nself.runner.peers = p\nrunner.x += 1\n"
                     "runner.use_peers(None)\nrunners = 1\n")
    assert len(runner_field_writes(probe)) == 3


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_the_checker_sees_function_level_imports_and_finds_cycles(tmp_path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n"
                      "def f():\n    from engine.models import llama\n")
    assert imported_names(module) == ["typing", "typing.TYPE_CHECKING", "engine.models",
                                      "engine.models.llama"]
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_importing_the_engine_and_the_config_does_not_import_torch() -> None:
    """The handler picks a strategy and the CLI answers --help before torch loads."""
    code = ("import sys, engine, handler.config.serving_config, handler.model_source.store; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_mypy_is_strict_on_every_module_of_the_public_face() -> None:
    """pyproject.toml's strict override lists the modules engine/__init__.py re-exports from."""
    import tomllib

    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    strict = next(set(o["module"]) for o in overrides if o.get("disallow_untyped_defs"))
    face = {name for name in imported_names(ROOT / "engine" / "__init__.py")
            if name in our_modules()} | {"engine"}
    assert face <= strict
