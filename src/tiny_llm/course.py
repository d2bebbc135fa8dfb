"""The course: tasks marked in the reference, stubs generated from them, a learner's workspace.

A *task* is a marked region of the reference source, in Python, C++ or Metal::

    # TASK <day>.<n>: <what to build> — <book section>
    ... the reference code ...
    # END TASK

(``//`` instead of ``#`` in C++ and Metal). The id names the day and the task, the title
says what to build, and the text after the dash is the heading of the book section that
explains it. A task may span several regions (same id). The stub of a region keeps its
marks and replaces what lies between them by an error naming the task and the section,
so a learner's module imports, type-checks and fails exactly where work is missing.
Stubs are generated, never written by hand: they cannot drift from the solution.

``start(day)`` writes the day's stubbed modules into the workspace (``learner.workspace``),
never over work already there; the learner switch then loads them in place of the
reference. Kernel tasks live in a copy of ``src/extensions`` in the workspace, built as a
second module (``_ext_learner``) by ``learner_extension``. ``status()`` runs each started
task's tests against the workspace.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tiny_llm import learner

SRC = learner.PACKAGE_DIR  # src/tiny_llm
EXTENSIONS = SRC.parent / "extensions"
BOOK = SRC.parents[1] / "book" / "src"
TESTS = SRC.parents[1] / "tests"

# Day -> (book chapter file, chapter title, test file).
CHAPTERS = {
    1: ("week3-day1.md", "Day 1 — continuous batching", "test_week3_day1.py"),
    2: ("week3-day2.md", "Day 2 — chunked prefill", "test_week3_day2.py"),
    3: ("week3-day3.md", "Day 3 — paged KV cache", "test_week3_day3.py"),
    4: ("week3-day4.md", "Day 4 — paged attention, read in place", "test_week3_day4.py"),
    5: ("week3-day5.md", "Day 5 — paged FlashAttention", "test_week3_day5.py"),
    6: ("speculative.md", "Speculative decoding", "test_speculative.py"),
    7: ("moe.md", "Mixture of Experts", "test_moe.py"),
}

_COMMENT = {".py": "#", ".cpp": "//", ".h": "//", ".metal": "//"}
_MARK = r"^(?P<indent>[ \t]*){c} TASK (?P<id>\d+\.\d+): (?P<title>.+?) — (?P<section>.+?)\s*$"
_END = r"^[ \t]*{c} END TASK\s*$"


@dataclass(frozen=True)
class Region:
    path: Path  # relative to the repository's src/
    start: int  # line index of the TASK mark
    end: int  # line index of the END TASK mark
    indent: str


@dataclass
class Task:
    id: str
    title: str
    section: str
    regions: list[Region]

    @property
    def day(self) -> int:
        return int(self.id.split(".")[0])

    @property
    def number(self) -> int:
        return int(self.id.split(".")[1])

    @property
    def chapter(self) -> str:
        return CHAPTERS[self.day][0]

    @property
    def message(self) -> str:
        return (f"Day {self.day} · Task {self.number}: {self.title} — see "
                f"'{self.section}' in {self.chapter.removesuffix('.md')}")

    @property
    def kind(self) -> str:
        suffixes = {r.path.suffix for r in self.regions}
        return "python" if suffixes == {".py"} else "kernel"


# ANCHOR: find_tasks
def source_files() -> list[Path]:
    """Every reference file that may hold tasks, relative to src/ (not the course's own)."""
    files = [*SRC.glob("*.py"), *EXTENSIONS.glob("*.cpp"), *EXTENSIONS.glob("metal/*.metal")]
    files = [p for p in files if p.name not in ("course.py", "learner.py")]
    return sorted(p.relative_to(SRC.parent) for p in files)


def regions_in(text: str, path: Path) -> list[tuple[Region, str, str, str]]:
    """(region, id, title, section) of each task region of a file's text."""
    c = re.escape(_COMMENT[path.suffix])
    mark, end = re.compile(_MARK.format(c=c)), re.compile(_END.format(c=c))
    found, open_mark = [], None
    for i, line in enumerate(text.splitlines()):
        if m := mark.match(line):
            if open_mark is not None:
                raise ValueError(f"{path}:{i + 1}: TASK inside TASK {open_mark[1]['id']}")
            open_mark = (i, m)
        elif end.match(line):
            if open_mark is None:
                raise ValueError(f"{path}:{i + 1}: END TASK without TASK")
            start, m = open_mark
            found.append((Region(path, start, i, m["indent"]), m["id"], m["title"], m["section"]))
            open_mark = None
    if open_mark is not None:
        raise ValueError(f"{path}:{open_mark[0] + 1}: TASK {open_mark[1]['id']} never ends")
    return found


def tasks() -> dict[str, Task]:
    """Every task of the course, by id, in day and task order."""
    found: dict[str, Task] = {}
    for path in source_files():
        for region, task_id, title, section in regions_in((SRC.parent / path).read_text(), path):
            task = found.setdefault(task_id, Task(task_id, title, section, []))
            if (task.title, task.section) != (title, section):
                raise ValueError(f"{path}: task {task_id} is marked with two titles")
            task.regions.append(region)
    return dict(sorted(found.items(), key=lambda kv: (kv[1].day, kv[1].number)))
# ANCHOR_END: find_tasks


# ANCHOR: stub
def stub_line(task: Task, suffix: str, indent: str) -> str:
    message = task.message
    if suffix == ".py":
        return f"{indent}raise NotImplementedError({message!r})"
    if suffix == ".metal":
        return f'{indent}TINY_LLM_TASK_STUB("{message}");'
    return f'{indent}throw std::runtime_error("{message}");'


def stubbed(text: str, path: Path, task_ids: set[str]) -> str:
    """``text`` with the regions of ``task_ids`` replaced by their stubs (marks kept)."""
    lines = text.splitlines()
    all_tasks = tasks()
    for region, task_id, _, _ in reversed(regions_in(text, path)):
        if task_id in task_ids:
            body = lines[region.start + 1 : region.end]
            indent = next((ln[: len(ln) - len(ln.lstrip())] for ln in body if ln.strip()),
                          region.indent)
            stub = stub_line(all_tasks[task_id], path.suffix, indent)
            lines[region.start + 1 : region.end] = [stub]
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")
# ANCHOR_END: stub


def region_body(text: str, path: Path, task_id: str) -> list[str]:
    lines = text.splitlines()
    return [ln for r, i, _, _ in regions_in(text, path) if i == task_id
            for ln in lines[r.start + 1 : r.end]]


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
    ws = learner.workspace()
    return [] if ws is None else _state(ws).get("started", [])


def _state(ws: Path) -> dict:
    path = ws / ".course.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _save_state(ws: Path, state: dict) -> None:
    ws.mkdir(parents=True, exist_ok=True)
    (ws / ".course.json").write_text(json.dumps(state, indent=1) + "\n")


# -------------------------------------------------------------------- status


def _fingerprint(task: Task, ws: Path) -> str:
    h = hashlib.sha256()
    files = [TESTS / CHAPTERS[task.day][2]]
    for region in task.regions:  # the workspace mirrors src/: tiny_llm/..., extensions/...
        files += [ws / region.path, SRC.parent / region.path]
    for f in files:
        h.update(f.read_bytes() if f.exists() else b"-")
    return h.hexdigest()


def test_files(task: Task) -> list[Path]:
    """Where a task's tests are: its day's file; the Metal kernel tests for Metal code."""
    files = [TESTS / CHAPTERS[task.day][2]]
    if any(r.path.suffix == ".metal" for r in task.regions):
        files.append(TESTS / "test_metal_kernels.py")
    return files


def run_task_tests(task: Task, ws: Path | None = None, extra: list[str] | None = None
                   ) -> subprocess.CompletedProcess:
    """The task's tests against the workspace (a separate process: a fresh import)."""
    ws = ws or require_workspace()
    cmd = [sys.executable, "-m", "pytest", *map(str, test_files(task)), "--learner-workspace",
           str(ws), "--task", task.id, "-p", "no:cacheprovider", *(extra or [])]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=TESTS.parent)


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
