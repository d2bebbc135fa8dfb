"""A learner's correct work passes what the book points a learner to, and runs its benchmarks.

The workspace is the whole course done by a learner who never saw the reference
(``course_alternatives.py``: every task's body written another way), started with
``tiny-llm course start`` as a learner starts it. On it, the chapters' test files and the
Metal tests run with ``--learner-workspace`` as ``pytest tests --learner`` would run them, and
every day's benchmark runs with ``--learner``. A test that only the reference's own lines pass,
a mutation keyed on the reference's text, a benchmark broken on a learner's modules: each
fails here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tiny_llm.course import learner
from tiny_llm.course import workspace as course

import course_alternatives
import pytest
from ahead import Ahead, selected_params
from test_benches import check_result, run_quick

ROOT = Path(__file__).resolve().parent.parent
HAVE_BUILD = sys.platform.startswith("linux")  # the kernel tasks: Linux's build and emulator
# The files the book sends a learner to: each chapter's tests and the Metal kernels'. The
# tensor-parallel chapter's file starts ranks for minutes: its tasks' own tests run.
LEARNER_FILES = [*(f"tests/{test_file}" for _, _, test_file in course.CHAPTERS.values()
                   if test_file != "test_tensor_parallel.py"),
                 "tests/test_metal_kernels.py", "tests/test_metal_mutations.py"]
# In three runs side by side: the days, the rest, and the tensor-parallel tasks' tests.
SUITE_RUNS = {
    "days": [f for f in LEARNER_FILES if "week3_day" in f],
    "the rest": [f for f in LEARNER_FILES if "week3_day" not in f],
    "tensor parallel": ["tests/test_tensor_parallel.py", *(
        a for t in course.tasks().values() if t.day == 8 for a in ("--task", t.id))],
}
DAY_BENCHES = [f"bench_week3_day{day}" for day in range(1, 6)]

# The course machinery decides nothing by device, and the kernel tasks are Linux's to build.
pytestmark = [pytest.mark.device_independent,
              pytest.mark.skipif(not HAVE_BUILD, reason="the kernel tasks build on Linux")]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The course done the learner's way, its extension built once."""
    ws = course_alternatives.correct_workspace(tmp_path_factory.mktemp("learner"))
    learner.build_learner_extension(ws)
    return ws


def suite_run(workspace: Path, files: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", *files, "--learner-workspace",
                           str(workspace), "-p", "no:cacheprovider", "-x", "-q"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def runs(request, workspace: Path, tmp_path_factory):
    """The selected tests' runs on the workspace, started together once it is built."""
    ahead = Ahead()
    if selected_params(request, test_the_suite_the_book_points_to_passes_on_a_correct_workspace):
        for key, files in SUITE_RUNS.items():
            ahead.start(key, suite_run, workspace, files)
    for params in selected_params(request, test_the_days_benchmark_runs_on_a_learners_code):
        name, folder = params["name"], tmp_path_factory.mktemp(params["name"])
        ahead.start(name, lambda n=name, f=folder: (
            f, run_quick(n, f, {learner.ENV: str(workspace)}, "--learner")))
    yield ahead
    ahead.close()


def significant(lines: list[str]) -> list[str]:
    """Lines that say something: not blank, a lone bracket, a comment, or a return of one name
    or constant (which any two solutions may share)."""
    return [s for s in (ln.strip() for ln in lines) if s and not re.fullmatch(
        r"[{}()\[\];,]*|(return( [\w.]+)?|break|continue);?|(//|#).*", s)]


def test_every_task_has_a_body_for_each_of_its_regions():
    tasks = course.tasks()
    assert set(course_alternatives.BODIES) == set(tasks)
    for task_id, bodies in course_alternatives.BODIES.items():
        assert len(bodies) == len(tasks[task_id].regions), task_id


def test_the_bodies_are_not_the_references_lines():
    """Written another way: most of a body's lines are not lines of the task's reference."""
    copied = []
    for task_id, task in course.tasks().items():
        reference = set()
        for region in task.regions:
            lines = (course.SRC.parent / region.path).read_text().splitlines()
            reference |= set(significant(lines[region.start + 1 : region.end]))
        mine = significant("\n".join(course_alternatives.BODIES[task_id]).splitlines())
        same = [ln for ln in mine if ln in reference]
        if len(same) > len(mine) // 3:
            copied.append(f"{task_id}: {len(same)} of {len(mine)} lines are the reference's: "
                          f"{same}")
    assert not copied, "\n".join(copied)


def test_the_suite_the_book_points_to_passes_on_a_correct_workspace(runs: Ahead):
    for key in SUITE_RUNS:
        run = runs.result(key)
        output = run.stdout + run.stderr
        assert run.returncode == 0, f"a correct workspace fails:\n{output[-4000:]}"
        whose = next(ln for ln in output.splitlines() if ln.startswith("learner workspace"))
        assert all(m in whose for m in learner.course_modules()) and "your extension" in whose


@pytest.mark.parametrize("name", DAY_BENCHES)
def test_the_days_benchmark_runs_on_a_learners_code(workspace: Path, name: str, runs: Ahead):
    folder, proc = runs.result(name)
    result = check_result(name, folder, proc)
    assert f"{name}.py: learner workspace {workspace}" in proc.stdout  # said at the start
    assert result["environment"]["learner"].startswith(f"learner workspace {workspace}")
