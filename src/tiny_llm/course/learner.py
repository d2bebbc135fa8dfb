"""The learner switch: a day's module comes from the learner's workspace when one is there.

With ``TINY_LLM_LEARNER`` set (``1`` for the repository's ``workspace/`` folder, or a path),
importing ``tiny_llm.day3_paged_kv`` loads ``<workspace>/tiny_llm/day3_paged_kv.py`` if the
learner has started Day 3, and the reference module otherwise. Nothing else changes: the
engine, the tests, the benchmarks and the chat import the days as always, so they all run
on the learner's code, mixed with the reference for the days not started. The kernel
extension follows the same rule (``kernels/extension.py``: ``<workspace>/extensions``).

The switch is read when a course module is first imported, so it must be set before:
``pytest --learner`` and ``tiny-llm ... --learner`` set it early; ``import tiny_llm`` alone
imports no day module.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ENV = "TINY_LLM_LEARNER"
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/tiny_llm
# The repository holding this package (an editable install: src/tiny_llm), if any.
REPO_DIR = PACKAGE_DIR.parents[1] if (PACKAGE_DIR.parents[1] / "pyproject.toml").exists() else None


def workspace() -> Path | None:
    """The learner's workspace when the switch is on, else None."""
    value = os.environ.get(ENV, "")
    if value in ("", "0"):
        return None
    if value != "1":
        return Path(value).expanduser().resolve()
    return (REPO_DIR if REPO_DIR is not None else Path.cwd()) / "workspace"


def course_modules() -> set[str]:
    """Modules a learner may replace: those of the reference holding course tasks."""
    mark = re.compile(r"^[ \t]*# TASK \d+\.\d+: ", re.M)
    return {p.stem for p in PACKAGE_DIR.glob("*.py") if mark.search(p.read_text())}


def learner_file(module: str) -> Path | None:
    """The workspace file that replaces ``tiny_llm.<module>``, if the learner has one."""
    ws = workspace()
    if ws is None:
        return None
    path = ws / "tiny_llm" / f"{module}.py"
    return path if path.exists() and module in course_modules() else None


class LearnerFinder(importlib.abc.MetaPathFinder):
    """Finds ``tiny_llm.<module>`` in the workspace before the reference does."""

    def find_spec(self, fullname, path, target=None):
        package, _, module = fullname.rpartition(".")
        if package != "tiny_llm":
            return None
        found = learner_file(module)
        if found is None:
            return None
        return importlib.util.spec_from_file_location(fullname, found)


def install() -> None:
    if not any(isinstance(f, LearnerFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, LearnerFinder())


def learner_modules() -> list[str]:
    """The modules that come from the workspace (for reports such as pytest's header)."""
    return sorted(m for m in course_modules() if learner_file(m) is not None)


def describe() -> str | None:
    """Whose code runs, in one line, when the switch is on (None when it is off): the test
    header, the CLI and the benchmarks print it, so that a run on the learner's code says so."""
    ws = workspace()
    if ws is None:
        return None
    mine = learner_modules()
    kernels = " and your extension" if (ws / "extensions").is_dir() else ""
    return (f"learner workspace {ws}: your {', '.join(mine) or 'no modules'}{kernels}; "
            "the reference elsewhere")


# ANCHOR: learner_extension
# Workspaces whose failed build this process has reported (its compiler errors shown once).
_reported_failures: set[Path] = set()


def build_learner_extension(ws: Path) -> Path:
    """Build the workspace's copy of the extension as module ``_ext_learner`` (again only
    when a source is newer than the build), with the course's readable kernels
    (``TINY_LLM_COURSE_KERNEL``); returns the module's file. A build that fails raises
    ImportError with the compiler's errors, and is not tried again until a source changes
    (``build/failed`` records the sources it failed on, for every process): each process
    shows the errors once, then a one-line reminder."""
    build = ws / "build"
    built = sorted(build.glob("_ext_learner*.so"))
    sources = [p for p in (ws / "extensions").rglob("*") if p.is_file()]
    newest = max(p.stat().st_mtime for p in sources)
    if built and built[0].stat().st_mtime >= newest:
        return built[0]
    log, failed = build / "build.log", build / "failed"
    if not (failed.exists() and failed.read_text() == repr(newest)):
        print(f"tiny_llm: building your extension ({ws / 'extensions'}) ...", file=sys.stderr,
              flush=True)
        if _cmake_build(ws, build, log):
            failed.unlink(missing_ok=True)
            _reported_failures.discard(ws)
            return sorted(build.glob("_ext_learner*.so"))[0]
        failed.write_text(repr(newest))
        _reported_failures.discard(ws)
    if ws in _reported_failures:
        raise ImportError(f"your extension does not build (its errors were shown once, "
                          f"above; the whole log: {log})")
    _reported_failures.add(ws)
    raise ImportError(f"your extension does not build:\n{compiler_errors(log.read_text())}\n"
                      f"(the whole log: {log})")


def _cmake_build(ws: Path, build: Path, log: Path) -> bool:
    """Configure and build the workspace's extension, printing each file as it compiles;
    False (the output in ``log``) if it fails."""
    venv_cmake = Path(sys.executable).with_name("cmake")  # make setup installs it there
    cmake = str(venv_cmake) if venv_cmake.exists() else "cmake"
    output: list[str] = []
    for args in (["-S", str(ws / "extensions"), "-B", str(build),
                  f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release",
                  "-DTINY_LLM_EXT_NAME=_ext_learner", "-DTINY_LLM_COURSE_KERNEL=ON"],
                 ["--build", str(build), "-j2"]):
        with subprocess.Popen([cmake, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) as run:
            for line in run.stdout:
                output.append(line)
                if step := _build_step(line):
                    print(f"tiny_llm:   {step}", file=sys.stderr, flush=True)
        if run.returncode:
            build.mkdir(parents=True, exist_ok=True)
            log.write_text("".join(output))
            return False
    return True


def _build_step(line: str) -> str | None:
    """CMake's progress line, shortened: "[ 40%] compiling cpu_attention.cpp" / "linking"."""
    m = re.match(r"\[\s*(\d+)%\] (Building CXX object \S*?([\w.]+)\.o|Linking)", line)
    if m is None:
        return None
    return f"[{m[1]:>3}%] " + (f"compiling {m[3]}" if m[3] else "linking")


def compiler_errors(output: str, limit: int = 40) -> str:
    """The lines of a failed build that say what is wrong: each error and the lines after
    it that point at the code, at most ``limit``."""
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines) if "error:" in line]
    keep = sorted({j for i in starts for j in range(i, min(i + 4, len(lines)))})
    picked = [lines[j] for j in keep][:limit] or lines[-limit:]
    return "\n".join(picked)


def learner_extension(ws: Path) -> ModuleType:
    """The workspace's copy of the extension, built if needed, imported from its build."""
    spec = importlib.util.spec_from_file_location("_ext_learner", build_learner_extension(ws))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
# ANCHOR_END: learner_extension
