"""The course's tasks: regions of the reference marked as a learner's work, and their stubs.

A *task* is a marked region of the reference source, in Python, C++ or Metal::

    # TASK <day>.<n>: <what to build> — <book section>
    ... the reference code ...
    # END TASK

(``//`` instead of ``#`` in C++ and Metal). The id names the day and the task, the title
says what to build, and the text after the dash names the book section that explains it,
whose heading is ``Task <day>.<n> — <section>``. A task may span several regions (same id).
The stub of a region keeps its marks and replaces what lies between them by an error naming
the task and the section, so a learner's module imports, type-checks and fails exactly
where work is missing. Stubs are generated, never written by hand: they cannot drift from
the solution.

This module needs nothing but the standard library: the book's preprocessor
(``tools/book_tasks.py``) loads it by path to show each task's stub in the chapters, and its
solution folded away.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1]  # src/tiny_llm
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
    8: ("tensor-parallel.md", "Beyond one machine", "test_tensor_parallel.py"),
    9: ("serving.md", "Serving it: an OpenAI-compatible server", "test_structured.py"),
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
    def heading(self) -> str:
        """The heading of the task's section in its chapter."""
        return f"Task {self.id} — {self.section}"

    @property
    def message(self) -> str:
        return f"Task {self.id}: {self.title} — see '{self.heading}' in " + (
            self.chapter.removesuffix(".md"))

    @property
    def kind(self) -> str:
        suffixes = {r.path.suffix for r in self.regions}
        return "python" if suffixes == {".py"} else "kernel"


# ANCHOR: find_tasks
def source_files() -> list[Path]:
    """Every reference file that may hold tasks, relative to src/: the chapters (the top level
    of the package: every module there but the CLI and the face) and the kernels."""
    files = [*SRC.glob("*.py"), *EXTENSIONS.glob("*.cpp"), *EXTENSIONS.glob("metal/*.metal")]
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

