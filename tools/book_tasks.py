"""The book's preprocessor for the course's tasks: a chapter shows each task's stub, and its
solution folded away.

mdBook runs it after expanding ``{{#include}}`` (``book/book.toml``). In every code block of
every chapter, each task region (``# TASK 3.2: ... — ...`` to ``# END TASK``, ``//`` in C++
and Metal) keeps its marks, and its body becomes the line a learner's stub has there (the
error naming the task); after the block, one collapsed ``<details>`` per task holds the
reference body. A block that holds part of a region only (an anchor that starts or ends
inside a task) fails the build: the anchor must be narrowed or widened to the whole task.

Standard library only: it loads ``src/tiny_llm/course/tasks.py`` by path, so any Python 3
runs it, with or without the project's environment.

    python3 tools/book_tasks.py supports html     # mdBook's question: exit 0
    mdbook build book                             # runs it as configured in book.toml
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

COURSE_TASKS = Path(__file__).resolve().parents[1] / "src" / "tiny_llm" / "course" / "tasks.py"
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)")
MARK = re.compile(r"^(?P<indent>[ \t]*)(?P<c>#|//) TASK (?P<id>\d+\.\d+): ")
END = re.compile(r"^[ \t]*(#|//) END TASK\s*$")
SUFFIX = {"#": ".py", "//": ".cpp"}


def load_course_tasks() -> Any:
    spec = importlib.util.spec_from_file_location("course_tasks", COURSE_TASKS)
    module = importlib.util.module_from_spec(spec)
    sys.modules["course_tasks"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


class PartialTask(ValueError):
    """A code block that holds part of a task region."""


def fold_tasks(content: str, course: Any, where: str) -> str:
    """``content`` (a chapter's Markdown) with every task region of its code blocks stubbed,
    and each region's reference body in a collapsed block after its code block."""
    tasks = course.tasks()
    out: list[str] = []
    block: list[str] | None = None  # the open code block's lines
    fence = lang = indent = ""
    stubbed = 0
    for line in content.split("\n"):
        if block is None:
            if m := FENCE.match(line):
                block, fence, lang, indent = [], m["fence"], m["lang"], m["indent"]
            out.append(line)
            continue
        closing = line.strip()
        if closing.startswith(fence) and not closing.strip(fence[0]):  # as long or longer
            code, solutions = stub_block(block, tasks, course, lang, where)
            stubbed += sum(1 for c in code if MARK.match(c))
            out += [*code, line, *(indent + s if s else s for s in solutions)]
            block = None
            continue
        block.append(line)
    if block is not None:
        out += block
    # Fail closed: a mark the loop did not stub (in a block never closed, in a quote) would
    # show its solution.
    marks = sum(1 for line in content.split("\n") if MARK.match(line.lstrip("> ")))
    if marks != stubbed:
        raise PartialTask(f"{where}: {marks - stubbed} task region(s) outside a code block "
                          "this preprocessor reads (an unclosed fence, a quote): not stubbed")
    return "\n".join(out)


def stub_block(lines: list[str], tasks: dict[str, Any], course: Any, lang: str,
               where: str) -> tuple[list[str], list[str]]:
    """The block's lines with its task regions stubbed, and the solution blocks to follow."""
    code: list[str] = []
    bodies: dict[str, list[str]] = {}
    region: tuple[str, str, list[str]] | None = None  # (id, comment, body)
    for line in lines:
        if region is None:
            if m := MARK.match(line):
                if m["id"] not in tasks:
                    raise PartialTask(f"{where}: a TASK mark with an unknown id {m['id']}")
                region = (m["id"], m["c"], [])
            elif END.match(line):
                raise PartialTask(f"{where}: a code block holds the end of a task region but "
                                  "not its start; include the whole task")
            code.append(line)
            continue
        task_id, comment, body = region
        if not END.match(line):
            body.append(line)
            continue
        indent = next((b[: len(b) - len(b.lstrip())] for b in body if b.strip()), "")
        code += [course.stub_line(tasks[task_id], suffix_of(tasks[task_id], comment), indent),
                 line]
        if task_id in bodies:  # a second region of the task in this block
            bodies[task_id].append("")
        bodies.setdefault(task_id, []).extend(body)
        region = None
    if region is not None:
        raise PartialTask(f"{where}: a code block holds the start of task {region[0]} but not "
                          "its end; include the whole task")
    solutions: list[str] = []
    for task_id, body in bodies.items():
        task = tasks[task_id]
        solutions += ["", "<details>", f"<summary>Solution: Task {task.id}, {task.title}"
                      "</summary>", "", f"```{lang}",
                      *textwrap.dedent("\n".join(body)).strip("\n").split("\n"), "```", "",
                      "</details>", ""]
    return code, solutions


def suffix_of(task: Any, comment: str) -> str:
    """The suffix of the task's files written with this comment (stubs differ by language)."""
    suffixes = [r.path.suffix for r in task.regions]
    return next((s for s in suffixes if (s == ".py") == (comment == "#")), SUFFIX[comment])


def chapters(items: list[Any]) -> list[dict[str, Any]]:
    """Every chapter of mdBook's book JSON, nested ones included."""
    found = []
    for item in items:
        if isinstance(item, dict) and "Chapter" in item:
            chapter = item["Chapter"]
            found += [chapter, *chapters(chapter.get("sub_items", []))]
    return found


def run_preprocessor(name: str, transform: Callable[[str, str], str],
                     errors: type[Exception]) -> int:
    """mdBook's preprocessor protocol: the book's JSON on stdin, each chapter's content
    replaced by ``transform(content, where)``, the book on stdout; ``errors`` fail the
    build with their message."""
    if len(sys.argv) > 1 and sys.argv[1] == "supports":
        return 0  # plain Markdown: every renderer
    _, book = json.load(sys.stdin)
    items = book.get("items", book.get("sections", []))  # mdBook 0.5 and 0.4
    for chapter in chapters(items):
        where = chapter.get("path") or chapter["name"]
        try:
            chapter["content"] = transform(chapter["content"], where)
        except errors as e:
            print(f"{name}: {e}", file=sys.stderr)
            return 1
    json.dump(book, sys.stdout)
    return 0


def main() -> int:
    course = None

    def fold(content: str, where: str) -> str:
        nonlocal course
        course = course or load_course_tasks()
        return fold_tasks(content, course, where)

    return run_preprocessor("book_tasks", fold, PartialTask)


if __name__ == "__main__":
    sys.exit(main())
