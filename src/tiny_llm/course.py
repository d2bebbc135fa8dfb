"""The course's commands: a learner's workspace, its stubs, its tests and its status.

The tasks and their stubs are ``course_tasks``'s. ``start(day)`` writes the day's stubbed
modules into the workspace (``learner.workspace``), never over work already there; the
learner switch then loads them in place of the reference. Kernel tasks live in a copy of
``src/extensions`` in the workspace, built as a second module (``_ext_learner``) by
``learner_extension``. ``status()`` runs each started task's tests against the workspace.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tiny_llm import learner
from tiny_llm.course_tasks import (
    BOOK,
    CHAPTERS,
    EXTENSIONS,
    SRC,
    TESTS,
    Region,
    Task,
    region_body,
    regions_in,
    source_files,
    stub_line,
    stubbed,
    tasks,
)

__all__ = ["BOOK", "CHAPTERS", "EXTENSIONS", "SRC", "TESTS", "Region", "Task", "region_body",
           "regions_in", "source_files", "stub_line", "stubbed", "tasks"]

# ---------------------------------------------------------------------- workspace


def require_workspace() -> Path:
    ws = learner.workspace()
    if ws is None:
        os.environ[learner.ENV] = "1"
        ws = learner.workspace()
    assert ws is not None
    return ws


def start(day: int) -> list[str]:
    """Write ``day``'s stubs into the workspace; returns what was done, line by line.
    Work already in the workspace is never overwritten."""
    ws = require_workspace()
    day_tasks = [t for t in tasks().values() if t.day == day]
    if not day_tasks:
        raise ValueError(f"the course has no tasks for day {day}")
    ids = {t.id for t in day_tasks}
    report: list[str] = []
    files = sorted({r.path for t in day_tasks for r in t.regions})
    for path in files:
        reference = (SRC.parent / path).read_text()
        if path.suffix == ".py":
            target = ws / "tiny_llm" / path.name
            if target.exists():
                report.append(f"kept {target} (your work is there)")
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(stubbed(reference, path, ids))
            report.append(f"wrote {target}")
            continue
        target = ws / path  # extensions/..., in a full copy of the extension
        if not (ws / "extensions").exists():
            shutil.copytree(EXTENSIONS, ws / "extensions",
                            ignore=shutil.ignore_patterns("blas_shim"))
            report.append(f"copied src/extensions to {ws / 'extensions'}")
        current = target.read_text()
        # Stub only the regions that still hold the reference: never a learner's edit.
        fresh = {i for i in ids if region_body(current, path, i) == region_body(
            reference, path, i) and region_body(current, path, i)}
        if fresh:
            target.write_text(stubbed(current, path, fresh))
            report.append(f"stubbed {', '.join(sorted(fresh))} in {target}")
        else:
            report.append(f"kept {target}")
    state = _state(ws)
    state["started"] = sorted(set(state.get("started", [])) | {day})
    _save_state(ws, state)
    return report


def started_days() -> list[int]:
    return _state(require_workspace()).get("started", [])


def _state(ws: Path) -> dict:
    path = ws / ".course.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _save_state(ws: Path, state: dict) -> None:
    ws.mkdir(parents=True, exist_ok=True)
    (ws / ".course.json").write_text(json.dumps(state, indent=1) + "\n")


# -------------------------------------------------------------------- status


SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".metal", ".txt"}  # .txt: CMakeLists.txt


def _fingerprint(task: Task, ws: Path) -> str:
    """What a task's result depends on: its tests, every reference file that may hold tasks,
    and every file of the workspace (the learner's modules and extension), by content."""
    h = hashlib.sha256()
    files = [*test_files(task), TESTS / "conftest.py",
             *(SRC.parent / path for path in source_files()),
             *sorted(p for sub in ("tiny_llm", "extensions") for p in (ws / sub).rglob("*")
                     if p.is_file() and p.suffix in SOURCE_SUFFIXES)]
    for f in files:
        h.update(str(f).encode() + b"\0" + (f.read_bytes() if f.exists() else b"-"))
    return h.hexdigest()


def resolve(which: str) -> tuple[int, str | None]:
    """``(day, task id or None)`` of a day ("3") or a task ("3.2"); ValueError naming the
    valid ones otherwise."""
    all_tasks = tasks()
    days = sorted({t.day for t in all_tasks.values()})
    day_text, _, number = which.partition(".")
    if not day_text.isdigit() or int(day_text) not in days:
        raise ValueError(f"no day {which!r} in the course: the days are "
                         f"{', '.join(map(str, days))} (or a task, such as 3.2)")
    day = int(day_text)
    if not number:
        return day, None
    if which not in all_tasks:
        ids = [t.id for t in all_tasks.values() if t.day == day]
        raise ValueError(f"no task {which!r}: Day {day}'s tasks are {', '.join(ids)}")
    return day, which


def test_files(task: Task) -> list[Path]:
    """Where a task's tests are: its day's file; the Metal kernel tests for Metal code."""
    files = [TESTS / CHAPTERS[task.day][2]]
    if any(r.path.suffix == ".metal" for r in task.regions):
        files.append(TESTS / "test_metal_kernels.py")
    return files


def run_task_tests(task: Task, ws: Path | None = None, extra: list[str] | None = None,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The task's tests against the workspace (a separate process: a fresh import), with
    ``env`` added to this process's environment. Installed pytest plugins stay unloaded
    (the tests use none, and loading them takes longer than a task's tests run)."""
    ws = ws or require_workspace()
    cmd = [sys.executable, "-m", "pytest", *map(str, test_files(task)), "--learner-workspace",
           str(ws), "--task", task.id, "-p", "no:cacheprovider", *(extra or [])]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=TESTS.parent,
                          env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                               **(env or {})})


def outcome(run: subprocess.CompletedProcess) -> str:
    """"pass", "fail", or "skipped" (this machine cannot run the task's tests)."""
    if run.returncode != 0:
        return "fail"
    return "pass" if " passed" in run.stdout else "skipped"


def status() -> list[tuple[Task, str]]:
    """(task, "pass" | "fail" | "not started") for every task, cached by file content."""
    ws = require_workspace()
    started = set(started_days())
    state = _state(ws)
    cache = state.setdefault("results", {})
    out = []
    for task in tasks().values():
        if task.day not in started:
            out.append((task, "not started"))
            continue
        key = _fingerprint(task, ws)
        if cache.get(task.id, {}).get("key") != key:
            result = outcome(run_task_tests(task, ws))
            cache[task.id] = {"key": key, "result": result}
        out.append((task, cache[task.id]["result"]))
    _save_state(ws, state)
    return out


def reference_edits() -> list[str]:
    """Reference files changed since the last commit (a learner's edit in the wrong place)."""
    run = subprocess.run(["git", "status", "--porcelain", "--", "src"], capture_output=True,
                         text=True, cwd=SRC.parents[1])
    return [line[3:] for line in run.stdout.splitlines()] if run.returncode == 0 else []
