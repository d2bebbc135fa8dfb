"""The course's commands: a learner's workspace, its stubs, its tests and its status.

The tasks and their stubs are ``course_tasks``'s. ``start(day)`` writes the day's stubbed
modules into the workspace (``learner.workspace``), never over work already there; the
learner switch then loads them in place of the reference. Kernel tasks live in a copy of
``src/extensions`` in the workspace, built as a second module (``_ext_learner``) by
``learner_extension``. ``status()`` runs each started task's tests against the workspace.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tiny_llm.course import learner
from tiny_llm.course.tasks import (
    BOOK,
    CHAPTERS,
    EXTENSIONS,
    SRC,
    TESTS,
    Region,
    Task,
    regions_in,
    source_files,
    stub_line,
    stubbed,
    tasks,
)

__all__ = ["BOOK", "CHAPTERS", "EXTENSIONS", "SRC", "TESTS", "Region", "Task",
           "regions_in", "source_files", "stub_line", "stubbed", "tasks"]

# ---------------------------------------------------------------------- workspace


def require_workspace() -> Path:
    ws = learner.workspace()
    if ws is None:
        os.environ[learner.ENV] = "1"
        ws = learner.workspace()
    assert ws is not None
    return ws


def workspace_file(ws: Path, path: Path) -> Path:
    """Where the learner's copy of ``path`` (relative to src/) lives in the workspace: a
    module in ``tiny_llm/``, a kernel file in the workspace's copy of the extension."""
    return ws / "tiny_llm" / path.name if path.suffix == ".py" else ws / path


def start(day: int) -> list[str]:
    """Give the learner ``day``'s tasks as stubs; returns what was done, line by line.

    A task is handed out once: its regions become stubs the first time its day starts (in a
    file written from the reference, or in place in the learner's copy), and never again,
    whatever they hold, so starting a day again (or the next day, whose tasks share a file)
    keeps every edit. ``reset`` gives a task's stub back on request."""
    ws = require_workspace()
    day_ids = {t.id for t in tasks().values() if t.day == day}
    if not day_ids:
        raise ValueError(f"the course has no tasks for day {day}")
    state = _state(ws)
    given = _given(state)
    new = day_ids - given
    report: list[str] = []
    for path in sorted({r.path for t in tasks().values() if t.id in day_ids for r in t.regions}):
        report += _hand_out(ws, path, new, given | new)
    state["started"] = sorted(set(state.get("started", [])) | {day})
    state["given"] = sorted(given | new)
    _save_state(ws, state)
    return report


def _given(state: dict) -> set[str]:
    """Tasks already handed out (a workspace from before this record: its started days')."""
    if "given" in state:
        return set(state["given"])
    return {t.id for t in tasks().values() if t.day in state.get("started", [])}


def _hand_out(ws: Path, path: Path, new: set[str], given: set[str]) -> list[str]:
    """Stub the regions of ``new`` tasks in the learner's copy of ``path``; a missing copy is
    written from the reference with every ``given`` task of the file stubbed."""
    report = []
    if path.suffix != ".py" and not (ws / "extensions").exists():
        shutil.copytree(EXTENSIONS, ws / "extensions", ignore=shutil.ignore_patterns("blas_shim"))
        report.append(f"copied src/extensions to {ws / 'extensions'}")
    target = workspace_file(ws, path)
    in_file = {i for _, i, _, _ in regions_in((SRC.parent / path).read_text(), path)}
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(stubbed((SRC.parent / path).read_text(), path, in_file & given))
        return [*report, f"wrote {target}"]
    text = target.read_text()
    present = {i for _, i, _, _ in regions_in(text, path)}
    fresh, missing = in_file & new & present, in_file & new - present
    if fresh:
        text = stubbed(text, path, fresh)
        target.write_text(text)
        report.append(f"stubbed {', '.join(sorted(fresh))} in {target}; the rest is kept")
    added: dict[str, str] = {}  # task -> the definition added for it
    for task_id in sorted(missing) if path.suffix == ".py" else ():
        if (grown := with_definition_of(text, path, task_id)) is not None:
            text, added[task_id] = grown
    if added:
        backup = _backup(ws, target)
        target.write_text(text)
        report += [f"added {name} (Task {task_id}, a stub) to {target}, with the imports it "
                   f"needs; the rest is kept (the file as it was: {backup})"
                   for task_id, name in added.items()]
    missing -= set(added)
    if not fresh and not added and not missing:
        report.append(f"kept {target} (your work is there)")
    report += [f"Task {i} has no region in {target}: copy its marked region from "
               f"src/{path} (TASK {i} ... END TASK) into your file, or delete the file and "
               f"start again (your other work in it would go)" for i in sorted(missing)]
    return report


def with_definition_of(text: str, path: Path, task_id: str) -> tuple[str, str] | None:
    """A learner's module written before Task ``task_id`` existed (``text``), given the
    reference's definition that holds the task (a function or a method), stubbed: in place
    of the learner's definition of that name, or after the one the reference puts before
    it; and the reference's imports that the module lacks. Returns the new text and the
    definition's name; None where that cannot be done safely (the module does not parse,
    its definition of that name holds a task's work, or there is no place for it)."""
    reference = (SRC.parent / path).read_text()
    region = next(r for r, i, _, _ in regions_in(reference, path) if i == task_id)
    try:
        mine = ast.parse(text)
    except SyntaxError:
        return None
    ref_tree = ast.parse(reference)
    ref_class, ref_body, ref_node = _holding(ref_tree.body, region.start + 1)
    if ref_node is None:
        return None
    my_body = mine.body
    if ref_class is not None:  # a method: in the learner's class
        owner = next((n for n in mine.body
                      if isinstance(n, ast.ClassDef) and n.name == ref_class), None)
        if owner is None:
            return None
        my_body = owner.body
    lines, ref_lines = text.splitlines(), reference.splitlines()
    # To the region's END TASK mark, a comment after the definition's last statement.
    snippet = ref_lines[_first_line(ref_node) - 1 : max(ref_node.end_lineno, region.end + 1)]
    snippet = stubbed("\n".join(snippet), path, {task_id}).splitlines()
    names = {n.name: n for n in my_body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    if (old := names.get(ref_node.name)) is not None:
        if any(line.lstrip().startswith("# TASK ")
               for line in lines[_first_line(old) - 1 : old.end_lineno]):
            return None  # the learner's definition holds a task's work
        lines[_first_line(old) - 1 : old.end_lineno] = snippet
    else:
        earlier = [n.name for n in ref_body[: ref_body.index(ref_node)]
                   if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        before = next((names[n] for n in reversed(earlier) if n in names), None)
        if before is None:
            return None
        gap = [""] * (2 if my_body is mine.body else 1)
        lines[before.end_lineno : before.end_lineno] = [*gap, *snippet]
    imports = [n for n in mine.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    have = {ast.unparse(n) for n in imports}
    lacking = [ast.unparse(n) for n in ref_tree.body
               if isinstance(n, (ast.Import, ast.ImportFrom)) and ast.unparse(n) not in have]
    if lacking:
        at = imports[-1].end_lineno if imports else 0
        lines[at:at] = lacking
    return "\n".join(lines) + "\n", ref_node.name


def _holding(body: list[ast.stmt], line: int, cls: str | None = None
             ) -> tuple[str | None, list[ast.stmt], ast.FunctionDef | None]:
    """The function (or a method of a top-level class: its name) of ``body`` whose lines
    hold ``line`` (1-based), with the body it is a statement of."""
    for node in body:
        if not node.lineno <= line <= (node.end_lineno or node.lineno):
            continue
        if isinstance(node, ast.ClassDef) and cls is None:
            return _holding(node.body, line, node.name)
        if isinstance(node, ast.FunctionDef):
            return cls, body, node
    return cls, body, None


def _first_line(node: ast.AST) -> int:
    """A definition's first line, its decorators' included."""
    return min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])


def reset(task_id: str) -> list[str]:
    """Replace a task's regions in the workspace by a fresh stub, saving the file first
    (``<workspace>/backups/<time>/...``); returns what was done."""
    ws = require_workspace()
    day, which = resolve(task_id)
    if which is None:
        raise ValueError(f"reset takes a task, such as {day}.1, not a day")
    if day not in started_days():
        raise ValueError(f"Day {day} is not started: `tiny-llm course start {day}` writes its "
                         "stubs")
    report = []
    for path in sorted({r.path for r in tasks()[which].regions}):
        target = workspace_file(ws, path)
        if not target.exists():
            report += _hand_out(ws, path, set(), _given(_state(ws)))
            continue
        text = target.read_text()
        if which not in {i for _, i, _, _ in regions_in(text, path)}:
            raise ValueError(f"{target} has no region of Task {which} (its TASK / END TASK "
                             f"marks are gone): copy the marked region from src/{path}")
        backup = _backup(ws, target)
        target.write_text(stubbed(text, path, {which}))
        report.append(f"stubbed {which} in {target} (the file as it was: {backup})")
    return report


def _backup(ws: Path, target: Path) -> Path:
    """A copy of the workspace file ``target`` under ``<workspace>/backups/<time>/``."""
    backup = ws / "backups" / time.strftime("%Y%m%d-%H%M%S") / target.relative_to(ws)
    backup.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(target, backup)
    return backup


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
    (the tests use none, and loading them takes longer than a task's tests run). A run that
    native code crashed has the crash's report (``crash_message``) at the end of stderr."""
    ws = ws or require_workspace()
    cmd = [sys.executable, "-m", "pytest", *map(str, test_files(task)), "--learner-workspace",
           str(ws), "--task", task.id, "-p", "no:cacheprovider", *(extra or [])]
    with tempfile.TemporaryDirectory(prefix="tiny_llm_tests_") as tmp:
        log = Path(tmp) / "running"
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=TESTS.parent,
                             env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                                  TEST_LOG_ENV: str(log), **(env or {})})
        if message := crash_message(run.returncode, log):
            run.stderr += "\n" + message + "\n"
    return run


# ------------------------------------------------------------ a crash in native code

# A test run on a learner's extension records, in the file this variable names, the test it
# is running: a crash of the process in native code (a kernel reading or writing memory it
# does not own) then names the test and its tasks, which the crash's own output cannot.
TEST_LOG_ENV = "TINY_LLM_TEST_LOG"


def record_test(nodeid: str, task_ids: list[str]) -> None:
    """Note the test about to run (the log is rewritten: only the last one matters)."""
    path = os.environ.get(TEST_LOG_ENV)
    if path:
        Path(path).write_text(f"{nodeid}\t{','.join(sorted(task_ids))}\n")


def crash_message(returncode: int, log: Path) -> str | None:
    """What to tell a learner whose test process died by a signal (None if it did not)."""
    if returncode >= 0:
        return None
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if not log.exists():
        return (f"tiny_llm: the test process died ({name}) before any test ran: your "
                "extension crashed as it loaded")
    nodeid, _, ids = log.read_text().strip().partition("\t")
    tasks_ = [tasks()[i] for i in ids.split(",") if i in tasks()]
    named = "; ".join(f"Task {t.id}: {t.title}" for t in tasks_) or "no course task"
    return (f"tiny_llm: the test process died ({name}) in or after {nodeid} ({named}). A "
            "crash in native code: a kernel of your extension read or wrote memory it does "
            f"not own. Run that test alone to see it again: pytest '{nodeid}' --learner")


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
