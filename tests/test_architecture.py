"""The tree shows the book: the import graph of ``src/tiny_llm``.

The top level of the package holds the chapters a reader works through (the days, the
optional chapters and the Serving chapter's ``structured``), the CLI and the package's face;
everything else lives in a package named for its role. ``tiny_llm.LAYERS`` orders them,
lowest first: a module imports only its own layer and the layers below, so a reader can
replace one chapter's module with their own and run the engine on it, and a day imports
only earlier days. Chapters sit where their idea is used: Mixture of Experts below the
models that hold its layers, structured outputs below the sampler that masks with them.
Imports inside functions count too: a lazy import is still an arrow. No import circle may
exist anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tiny_llm

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "tiny_llm"
LAYERS = [name for name, _ in tiny_llm.LAYERS]  # lowest first: the package states them
CHAPTERS = set(tiny_llm.CHAPTERS)
FACE = "__init__"


def module_name(path: Path) -> str:
    """``kernels/blas.py`` -> ``kernels.blas``; a package's ``__init__.py`` -> the package
    (the package's own ``__init__.py`` -> ``__init__``, its face)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def imports() -> dict[str, set[str]]:
    """Module -> the tiny_llm modules it imports (anywhere in its body)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
                if node.module == "tiny_llm":  # `from tiny_llm import x`: x may be a module
                    targets = [a.name for a in node.names]
                elif node.module.startswith("tiny_llm."):
                    targets += [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("tiny_llm."):
                    target = target.removeprefix("tiny_llm.")
                found.add(target)
        graph[name] = {t for t in found if t in modules()}
    return graph


def modules() -> set[str]:
    return {module_name(p) for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def test_the_top_level_holds_only_chapters_the_cli_and_the_face():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == CHAPTERS | {"cli", FACE}, top ^ (CHAPTERS | {"cli", FACE})
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages <= set(LAYERS), packages - set(LAYERS)
    assert set(LAYERS) == CHAPTERS | packages | {"cli"}


def test_every_module_imports_only_its_layer_and_those_below():
    for module, targets in imports().items():
        if module == FACE or module.startswith("_native"):
            continue
        for target in targets:
            if target.startswith("_native"):
                continue
            assert layer(target) <= layer(module), f"{module} imports {target}, a higher layer"


def test_the_face_imports_the_blas_shim_and_the_learner_switch_alone():
    """``import tiny_llm`` must load OpenBLAS before ``mlx.core`` and import no chapter, so
    that the learner switch decides where each chapter comes from."""
    targets = {t.split(".")[0] for t in imports()[FACE]}
    assert targets <= {"kernels", "course"}, targets


def test_package_inits_import_nothing_early():
    """A package's ``__init__`` runs when any of its modules is imported: it may not import
    a chapter (the learner switch replaces chapters at import)."""
    graph = imports()
    for module, targets in graph.items():
        if (PACKAGE / module / "__init__.py").exists():
            assert not {t.split(".")[0] for t in targets} & CHAPTERS, (module, targets)


def test_no_import_circle():
    graph = imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue  # a package without modules of its own, or the compiled extension
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if state.get(nxt) is None:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in graph:
        if state.get(module) is None:
            visit(module, [module])


def test_nothing_tests_an_attention_backend_for_its_class():
    """The engine and the kernels ask a backend through its protocol (``fused_decode``,
    ``check``, ``storage``), never by its class: a new backend then needs no change there."""
    from tiny_llm.engine import ATTENTION_BACKENDS

    backends = {cls.__name__ for cls in ATTENTION_BACKENDS.values()}
    for path in [*PACKAGE.glob("engine/*.py"), *PACKAGE.glob("kernels/*.py"),
                 *PACKAGE.glob("models/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                assert not named & backends, f"{path.name}:{node.lineno} tests a backend's class"
