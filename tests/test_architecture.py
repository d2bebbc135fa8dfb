"""The chapters build forward: the import graph of ``src/tiny_llm``.

A day's module imports only the core and earlier days, so a reader can replace one day's
module with their own and run the engine on it; the engine (and the CLI, the test support)
compose the days on top. Imports inside functions count too: a lazy import is still an
arrow. No import circle may exist anywhere in the package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "tiny_llm"
CORE = {"model", "moe", "loader", "tokenizer", "sampling", "request", "kv_cache", "step",
        "extension", "cpu_kernels", "cpu_fused", "generate", "blas", "learner",
        "device", "structured", "tool_calls"}  # fmt: skip
# The optional chapters: the core and any day, never the engine.
OPTIONAL = {"speculative", "tensor_parallel"}
TOP = {"engine", "cli", "course", "course_tasks", "server", "__init__"}
DAY = re.compile(r"day(\d+)_")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    return ".".join(rel.parts)


def imports() -> dict[str, set[str]]:
    """Module -> the tiny_llm modules it imports (anywhere in its body)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("tiny_llm."):
                    found.add(target.removeprefix("tiny_llm."))
        graph[name] = found
    return graph


def day_of(module: str) -> int | None:
    m = DAY.match(module)
    return int(m.group(1)) if m else None


def test_every_module_is_classified():
    for name in imports():
        top = name.split(".")[0]
        assert top in CORE | TOP | OPTIONAL | {"testing", "_native"} or day_of(top) is not None, (
            name)


def test_days_import_only_the_core_and_earlier_days():
    graph = imports()
    days = {m for m in graph if day_of(m) is not None}
    assert {day_of(m) for m in days} == {1, 2, 3, 4, 5}
    for module in days:
        for target in graph[module]:
            top = target.split(".")[0]
            if day_of(top) is not None:
                assert day_of(top) < day_of(module), f"{module} imports a later day: {target}"
            else:
                assert top in CORE, f"{module} imports {target}, which is not the core"


def test_the_core_imports_no_chapter():
    graph = imports()
    for module in CORE:
        for target in graph[module]:
            assert target.split(".")[0] in CORE, f"core module {module} imports {target}"


def test_no_import_circle():
    graph = imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue  # a submodule of the compiled extension
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if state.get(nxt) is None:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in graph:
        if state.get(module) is None:
            visit(module, [module])


def test_optional_chapters_build_on_the_days_not_on_the_engine():
    graph = imports()
    for module in OPTIONAL:
        for target in graph[module]:
            top = target.split(".")[0]
            assert top in CORE or day_of(top) is not None or top == "loader", (module, target)
