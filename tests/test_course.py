"""The course tests itself.

- Every task is marked consistently, names a section of its chapter, and has tests.
- The stubs are valid code: every generated Python module parses; the extension with every
  kernel task stubbed builds, and its ops raise the task's error; the Metal kernels with a
  task stubbed stop the emulator with the task's message.
- ``start`` writes a day's stubs and never overwrites a learner's work.
- For every task, stubbing that task alone (the rest reference) makes at least one of its
  tests fail, with the task's message: a task no test catches would be a defect. (The
  reference passing every task's tests is the rest of the suite.)
- Tasks pass in order: with a task and those before it done and the rest of its day still
  stubs, the task's tests pass (Python and C++ tasks; a Metal task is its day's last).
- A learner's likely mistake in each task (``MUTANTS``, ``KERNEL_MUTANTS``), planted in the
  reference, fails that task's tests.

C++ tasks are checked with one build of the extension whose task regions can be stubbed, and
their mistakes switched on, one at a time at run time (``TINY_LLM_STUB_TASK``,
``TINY_LLM_MUTANT``), not one build per task.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tiny_llm.course import learner
from tiny_llm.course import workspace as course

import pytest
from ahead import Ahead, selected_params

TASKS = course.tasks()
PYTHON_TASKS = [t for t in TASKS.values() if t.kind == "python"]
CPP_TASKS = [t for t in TASKS.values() if {r.path.suffix for r in t.regions} == {".cpp"}]
METAL_TASKS = [t for t in TASKS.values() if {r.path.suffix for r in t.regions} == {".metal"}]
HAVE_COMPILER = shutil.which(os.environ.get("CXX", "g++")) is not None
needs_linux_compiler = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not HAVE_COMPILER,
    reason="kernel tasks are checked with the Linux build and the Metal emulator")
# The course machinery (marks, stubs, the workspace) decides nothing by device: a Python
# task's code runs on any device, and the kernel tasks are checked on Linux's build and
# emulator. The GPU rehearsal leaves this module to the main pass.
pytestmark = pytest.mark.device_independent


# ---------------------------------------------------------------------------------------
# The marks


def test_every_day_has_consecutive_tasks():
    by_day: dict[int, list[int]] = {}
    for task in TASKS.values():
        by_day.setdefault(task.day, []).append(task.number)
    assert {1, 2, 3, 4, 5} <= set(by_day)
    for day, numbers in by_day.items():
        assert numbers == list(range(1, len(numbers) + 1)), f"day {day}: {numbers}"


def test_every_task_names_a_section_of_its_chapter():
    for task in TASKS.values():
        chapter = (course.BOOK / task.chapter).read_text()
        headings = {h.strip() for h in re.findall(r"(?m)^#+ (.+)$", chapter)}
        assert task.heading in headings, f"{task.id}: no heading '{task.heading}' in {task.chapter}"


def test_every_task_has_tests():
    marked: set[str] = set()  # ids quoted on lines that speak of tasks (markers, tables)
    for path in course.TESTS.glob("test_*.py"):
        for line in path.read_text().splitlines():
            if "task" in line.lower() and path.name != "test_course.py":
                marked |= set(re.findall(r'"(\d+\.\d+)"', line))
    assert set(TASKS) <= marked, f"tasks without tests: {sorted(set(TASKS) - marked)}"


# ---------------------------------------------------------------------------------------
# The stubs


def test_python_stubs_parse_and_raise_the_task_error():
    for path in {r.path for t in PYTHON_TASKS for r in t.regions}:
        text = (course.SRC.parent / path).read_text()
        ids = {t.id for t in PYTHON_TASKS if any(r.path == path for r in t.regions)}
        stub = course.stubbed(text, path, ids)
        ast.parse(stub)
        for task_id in ids:
            assert f"raise NotImplementedError({TASKS[task_id].message!r})" in stub
        assert stub.count("# TASK ") == text.count("# TASK ")  # the marks stay


def test_start_writes_stubs_and_never_overwrites_work(tmp_path, monkeypatch):
    monkeypatch.setenv(learner.ENV, str(tmp_path))
    report = course.start(3)
    mine = tmp_path / "tiny_llm" / "day3_paged_kv.py"
    assert report[0] == f"wrote {mine}" and "NotImplementedError" in mine.read_text()
    mine.write_text(mine.read_text() + "\n# my work\n")
    assert course.start(3)[0].startswith("kept") and mine.read_text().endswith("# my work\n")
    assert course.started_days() == [3]
    assert learner.learner_file("day3_paged_kv") == mine
    assert learner.learner_file("day1_batching") is None  # not started: the reference


def test_course_test_runs_a_started_days_tasks_with_the_switch_unset(tmp_path, monkeypatch,
                                                                    capsys):
    """``tiny-llm course test 3.1`` as the book shows it: no TINY_LLM_LEARNER in the
    environment, the workspace the repository's ``workspace/``."""
    from tiny_llm import cli

    monkeypatch.setenv(learner.ENV, "0")  # restored (unset) after the test
    monkeypatch.setattr(learner, "REPO_DIR", tmp_path)
    assert cli.main(["course", "start", "3"]) == 0
    assert "open book/book/week3-day3.html" in capsys.readouterr().out  # the built book
    monkeypatch.delenv(learner.ENV)
    commands: list[list[str]] = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, cwd: commands.append(cmd) or 0)
    assert cli.main(["course", "test", "3.1", "-k", "pages"]) == 0
    assert commands[0][-5:] == ["--learner", "--task", "3.1", "-k", "pages"]
    assert cli.main(["course", "test", "1.1"]) == 2  # Day 1 not started: refused
    assert cli.main(["course", "test", "3.9"]) == 2 and len(commands) == 1


def test_the_learners_build_shows_each_file_it_compiles():
    step = learner._build_step
    assert step("[ 40%] Building CXX object CMakeFiles/_ext_learner.dir/cpu_attention.cpp.o") \
        == "[ 40%] compiling cpu_attention.cpp"
    assert step("[100%] Linking CXX shared module _ext_learner.cpython-311.so") == "[100%] linking"
    assert step("-- Configuring done") is None


def test_a_days_file_without_a_tasks_tests_says_where_they_are():
    run = subprocess.run([sys.executable, "-m", "pytest", "tests/test_week3_day5.py", "-k",
                          "task_4", "-p", "no:cacheprovider"], capture_output=True, text=True,
                         cwd=course.TESTS.parent)
    assert run.returncode == 5  # no test ran, and the reason is said
    assert ("Task 5.4's tests are in tests/test_week3_day5.py and tests/test_metal_kernels.py: "
            "`tiny-llm course test 5.4` runs them all") in run.stdout


@needs_linux_compiler
def test_kernel_stubs_are_added_day_by_day_around_a_learners_work(tmp_path, monkeypatch):
    monkeypatch.setenv(learner.ENV, str(tmp_path))
    course.start(4)
    cpu = tmp_path / "extensions" / "cpu_attention.cpp"
    text = cpu.read_text()
    assert TASKS["4.2"].message in text and TASKS["5.3"].message not in text
    edited = text.replace(f'throw std::runtime_error("{TASKS["4.2"].message}");',
                          "/* my page walk */")
    cpu.write_text(edited)
    course.start(5)
    text = cpu.read_text()
    assert "/* my page walk */" in text and TASKS["5.3"].message in text


def edit_region(ws: Path, task_id: str, body: str) -> Path:
    """Write ``body`` as the learner's code of ``task_id``'s first region; returns the file."""
    region = TASKS[task_id].regions[0]
    target = course.workspace_file(ws, region.path)
    text = target.read_text()
    (mine, *_) = [r for r, i, _, _ in course.regions_in(text, region.path) if i == task_id]
    lines = text.splitlines()
    lines[mine.start + 1 : mine.end] = [body]
    target.write_text("\n".join(lines) + "\n")
    return target


def reference_body(task_id: str) -> str:
    region = TASKS[task_id].regions[0]
    lines = (course.SRC.parent / region.path).read_text().splitlines()
    return "\n".join(lines[region.start + 1 : region.end])


# A learner's edit of each kind of file: Python, C++ and Metal; and one that reads exactly as
# the reference does (copied from the book's folded solution, say), which is work too.
EDITS = {"3.2": "        return 0  # my fragmentation", "4.2": "  /* my page walk */",
         "4.4": "  // my Metal page walk", "3.4": None, "4.3": None}


def test_starting_a_day_again_keeps_every_edited_region(tmp_path, monkeypatch):
    monkeypatch.setenv(learner.ENV, str(tmp_path))
    course.start(3)
    course.start(4)
    files = {i: edit_region(tmp_path, i, body if body is not None else reference_body(i))
             for i, body in EDITS.items()}
    before = {f: f.read_text() for f in files.values()}
    for day in (3, 4, 5, 4, 3):  # again, the next day (sharing the kernel files), again
        course.start(day)
    for task_id, target in files.items():
        text = target.read_text()
        assert (EDITS[task_id] or reference_body(task_id)) in text, task_id
    assert files["3.2"].read_text() == before[files["3.2"]]
    assert TASKS["5.3"].message in files["4.2"].read_text()  # Day 5's task came as a stub


def test_reset_gives_a_tasks_stub_back_and_saves_the_file(tmp_path, monkeypatch, capsys):
    from tiny_llm import cli

    monkeypatch.setenv(learner.ENV, str(tmp_path))
    course.start(4)
    target = edit_region(tmp_path, "4.2", EDITS["4.2"])
    edit_region(tmp_path, "4.3", "  /* my row copies */")
    assert cli.main(["course", "reset", "4.2"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    text = target.read_text()
    assert TASKS["4.2"].message in text and EDITS["4.2"] not in text
    assert "/* my row copies */" in (tmp_path / "extensions" / "paged_ops.cpp").read_text()
    (backup,) = (tmp_path / "backups").rglob("cpu_attention.cpp")
    assert EDITS["4.2"] in backup.read_text() and str(backup) in line
    with pytest.raises(ValueError, match="Day 5 is not started"):
        course.reset("5.3")
    assert cli.main(["course", "reset", "4.9"]) == 2  # no such task: an error, not a trace
    with pytest.raises(ValueError, match="takes a task"):
        course.reset("4")


def test_a_task_new_to_a_started_module_is_stubbed_in_place(tmp_path, monkeypatch):
    """A task added to a module after the learner started its day (a newer course): the next
    ``start`` stubs its region in the learner's file and keeps the rest."""
    monkeypatch.setenv(learner.ENV, str(tmp_path))
    course.start(3)
    target = edit_region(tmp_path, "3.2", EDITS["3.2"])
    edit_region(tmp_path, "3.4", reference_body("3.4"))  # as the course had it: no stub
    state = json.loads((tmp_path / ".course.json").read_text())
    state["given"].remove("3.4")  # what a workspace started before Task 3.4 existed records
    (tmp_path / ".course.json").write_text(json.dumps(state))
    assert any("stubbed 3.4" in line for line in course.start(3))
    text = target.read_text()
    assert TASKS["3.4"].message in text and EDITS["3.2"] in text


def test_tasks_new_to_a_module_started_before_them_are_added_as_stubs(tmp_path, monkeypatch):
    """A learner who started Day 6 before its tree tasks existed has a speculative.py without
    ``tree_attention`` (nor the import it needs) and with ``tree_accept`` as the reference had
    it, unmarked. The next ``start`` adds both as stubs (``tree_attention`` after the function
    the reference puts before it, ``tree_accept`` in place of the old copy, the file saved
    first) and keeps the learner's work: the module imports, and each new task raises its
    error."""
    import importlib.util

    monkeypatch.setenv(learner.ENV, str(tmp_path))
    course.start(6)
    target = edit_region(tmp_path, "6.1", "    return 0, 0  # my acceptance rule")
    text = target.read_text()
    (accept, *_) = [r for r, i, _, _ in course.regions_in(text, Path(SPEC)) if i == "6.5"]
    lines = text.splitlines()
    lines[accept.start : accept.end + 1] = reference_body("6.5").splitlines()
    text = "\n".join(lines) + "\n"
    start = text.index("# ANCHOR: tree_attention")
    end = text.index("# ANCHOR: tree_accept")
    old = text[:start] + text[end:]
    old = old.replace("from tiny_llm.step.dense_kv import causal_attention\n", "")
    target.write_text(old)
    state = json.loads((tmp_path / ".course.json").read_text())
    state["given"] = [i for i in state["given"] if i not in ("6.4", "6.5")]
    (tmp_path / ".course.json").write_text(json.dumps(state))
    report = course.start(6)
    assert any("added tree_accept (Task 6.5" in line for line in report), report
    assert any("added tree_attention (Task 6.4" in line for line in report), report
    assert not any("has no region" in line for line in report), report
    saved = next((tmp_path / "backups").rglob("speculative.py"))
    assert saved.read_text() == old
    new = target.read_text()
    assert "    return 0, 0  # my acceptance rule" in new
    assert {i for _, i, _, _ in course.regions_in(new, Path(SPEC))} >= {"6.1", "6.4", "6.5"}
    assert new.index("def speculative_accept") < new.index("def tree_attention")
    spec = importlib.util.spec_from_file_location("learners_speculative", target)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    for task_id, call in (("6.4", lambda: module.tree_attention(None, None, None, 1.0, None)),
                          ("6.5", lambda: module.tree_accept(None, None, None, None))):
        with pytest.raises(NotImplementedError, match=re.escape(TASKS[task_id].message)):
            call()
    assert module.causal_attention is not None  # the import tree_attention needs
    assert "kept" in course.start(6)[-1]  # and again: nothing more to add


# ---------------------------------------------------------------------------------------
# Stubbing one task alone fails its tests


# The runs of a task's tests on a workspace are child processes: each module fixture below
# starts the runs its selected tests need, together (tests/ahead.py), and each test reads its
# own. A run's workspace is written in the run's thread, so that a mistake there fails the
# test that reads it.


def failing(task: course.Task, run: subprocess.CompletedProcess) -> str:
    output = run.stdout + run.stderr
    assert run.returncode == 1, f"task {task.id} stubbed, its tests still pass:\n{output[-3000:]}"
    return output


def stubbed_alone_run(task: course.Task, ws: Path) -> subprocess.CompletedProcess:
    for path in {r.path for r in task.regions}:
        target = ws / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(course.stubbed((course.SRC.parent / path).read_text(), path, {task.id}))
    return course.run_task_tests(task, ws, extra=["-x"])


@pytest.fixture(scope="module")
def python_runs(request, tmp_path_factory):
    """The Python tasks' runs of the tests below that are selected, started together."""
    ahead = Ahead()
    for p in selected_params(request, test_stubbing_a_python_task_alone_fails_its_tests):
        ahead.start(("stubbed", p["task"].id), stubbed_alone_run, p["task"],
                    tmp_path_factory.mktemp("stubbed"))
    for p in selected_params(request, test_a_python_task_passes_with_the_tasks_after_it_stubbed):
        ahead.start(("in order", p["task"].id), in_order_run, p["task"],
                    tmp_path_factory.mktemp("in_order"), {})
    for p in selected_params(request, test_a_learners_mistake_fails_the_tasks_tests):
        ahead.start(("mistake", p["task_id"], p["right"]), mistake_run, TASKS[p["task_id"]],
                    p["file"], p["right"], p["wrong"], tmp_path_factory.mktemp("mistake"))
    yield ahead
    ahead.close()


@pytest.mark.parametrize("task", PYTHON_TASKS, ids=lambda t: t.id)
def test_stubbing_a_python_task_alone_fails_its_tests(task, python_runs):
    assert task.message in failing(task, python_runs.result(("stubbed", task.id)))


def switch_on(variable: str, task_id: str) -> str:
    """C++: whether ``task_id`` is in the comma-separated list ``$variable`` (read once)."""
    on = f'course_switch("{variable}", "{task_id}")'
    return f"([] {{ static const bool on = {on}; return on; }}())"


@pytest.fixture(scope="module")
def switchable_extension(tmp_path_factory) -> Path:
    """A workspace whose extension can stub any C++ task, plant its mistake, or crash in it
    (``TINY_LLM_CRASH_TASK``), at run time, built once."""
    ws = tmp_path_factory.mktemp("switchable")
    shutil.copytree(course.EXTENSIONS, ws / "extensions",
                    ignore=shutil.ignore_patterns("blas_shim"))
    switch = ('#include <cstdlib>\n#include <cstring>\n#include <stdexcept>\n'
              'static bool course_switch(const char* var, const char* id) {\n'
              '  const char* s = std::getenv(var);\n'
              '  const size_t n = std::strlen(id);\n'
              '  for (const char* p = s; p != nullptr && (p = std::strstr(p, id)); p += n)\n'
              '    if ((p == s || p[-1] == \',\') && (p[n] == \',\' || p[n] == \'\\0\'))\n'
              '      return true;\n'
              '  return false;\n}\n')
    for path in {r.path for t in CPP_TASKS for r in t.regions}:
        text = (ws / path).read_text()
        for task_id, (file, right, wrong) in KERNEL_MUTANTS.items():
            if Path(file) == path:  # an expression for an expression: the lines stay
                text = text.replace(right, f"({switch_on('TINY_LLM_MUTANT', task_id)} ? "
                                           f"({wrong}) : ({right}))")
        lines = text.splitlines()
        for region, task_id, _, _ in reversed(course.regions_in(text, path)):
            guard = (f'{region.indent}if ({switch_on("TINY_LLM_STUB_TASK", task_id)}) '
                     f'throw std::runtime_error("{TASKS[task_id].message}");')
            crash = f'{region.indent}if ({switch_on("TINY_LLM_CRASH_TASK", task_id)}) std::abort();'
            lines[region.start + 1 : region.start + 1] = [guard, crash]
        (ws / path).write_text(switch + "\n".join(lines) + "\n")
    learner.build_learner_extension(ws)  # once, for every C++ task
    return ws


@needs_linux_compiler
def test_a_crash_in_a_learners_kernel_names_the_test_and_its_task(switchable_extension):
    """Native code that kills the process (here an abort in Task 4.3's region) ends the runs
    a learner starts, `course test` and pytest itself, with the test and the task named."""
    env = {"TINY_LLM_CRASH_TASK": "4.3"}
    run = course.run_task_tests(TASKS["4.3"], switchable_extension, env=env)
    named = re.compile(r"tiny_llm: the test process died \(SIGABRT\) in or after "
                       r"tests/test_week3_day4.py::test_\S+ \(Task 4.3: PagedKVWrite")
    assert run.returncode < 0 and named.search(run.stderr), run.stderr[-2000:]
    direct = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_week3_day4.py", "-k", "kv_write",
         "--learner-workspace", str(switchable_extension), "-p", "no:cacheprovider"],
        capture_output=True, text=True, cwd=course.TESTS.parent, env={**os.environ, **env})
    assert direct.returncode == 1 and named.search(direct.stderr), direct.stderr[-2000:]


def over_the_build_of(built: Path, ws: Path) -> Path:
    """A workspace of its own (its Python modules) over ``built``'s extension and build."""
    for name in ("extensions", "build"):
        (ws / name).symlink_to(built / name, target_is_directory=True)
    return ws


@pytest.fixture(scope="module")
def kernel_runs(request, switchable_extension, tmp_path_factory):
    """The runs on the switchable build of the tests below that are selected, started
    together once it is built."""
    ahead = Ahead()
    sw = switchable_extension
    for p in selected_params(request, test_stubbing_a_cpp_task_alone_fails_its_tests):
        ahead.start(("stubbed", p["task"].id), course.run_task_tests, p["task"], sw, ["-x"],
                    {"TINY_LLM_STUB_TASK": p["task"].id})
    in_order = test_a_kernel_days_task_passes_with_the_tasks_after_it_stubbed
    for p in selected_params(request, in_order):
        task = p["task"]
        ahead.start(("in order", task.id), in_order_run, task,
                    over_the_build_of(sw, tmp_path_factory.mktemp("in_order")),
                    {"TINY_LLM_STUB_TASK": ",".join(sorted(later_tasks(task)))})
    for p in selected_params(request, test_a_learners_kernel_mistake_fails_the_tasks_tests):
        if p["task"] in CPP_TASKS:
            ahead.start(("mistake", p["task"].id), course.run_task_tests, p["task"], sw, ["-x"],
                        {"TINY_LLM_MUTANT": p["task"].id})
    yield ahead
    ahead.close()


@needs_linux_compiler
@pytest.mark.parametrize("task", CPP_TASKS, ids=lambda t: t.id)
def test_stubbing_a_cpp_task_alone_fails_its_tests(task, kernel_runs):
    assert task.message in failing(task, kernel_runs.result(("stubbed", task.id)))


@needs_linux_compiler
def test_the_fully_stubbed_extension_compiles_and_raises_the_first_tasks_error(
        tmp_path, switchable_extension):
    """The C++ files as ``start`` writes them for Days 4 and 5 (every kernel task a stub)
    compile with the extension's own flags (a stub leaves its function's parameters unused:
    warned, not an error); built, they raise the first task's message each op reaches (the
    switchable build, every task stubbed at once)."""
    import subprocess

    sys.path.insert(0, str(course.SRC.parents[1] / "tools"))
    from clang_check import GCC_BUILD, syntax_only

    if not (GCC_BUILD / "compile_commands.json").exists():
        pytest.skip(f"no configured build of the extension in {GCC_BUILD} (make setup)")
    os.environ[learner.ENV] = str(tmp_path)
    try:
        course.start(4)
        course.start(5)
    finally:
        del os.environ[learner.ENV]
    for path in sorted({r.path for t in CPP_TASKS for r in t.regions}):
        stubbed_file = tmp_path / path
        assert all(TASKS[t.id].message in stubbed_file.read_text() for t in CPP_TASKS
                   if any(r.path == path for r in t.regions))
        run = subprocess.run(syntax_only(stubbed_file, path.name), capture_output=True, text=True)
        assert run.returncode == 0, f"{path} as stubbed does not compile:\n{run.stderr[-3000:]}"
    script = ("import tiny_llm, mlx.core as mx, sys\n"
              "from tiny_llm import learner\n"
              "from tiny_llm.testing.paged import make_paged_case\n"
              "ext = learner.learner_extension(learner.workspace())\n"
              "case = make_paged_case([(20, 1), (9, 3)])\n"
              "for tiled in (False, True):\n"
              "    try:\n"
              "        mx.eval(ext.paged_attention(*case.args(), tiled=tiled))\n"
              "    except RuntimeError as e:\n"
              "        print(e)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**os.environ, learner.ENV: str(switchable_extension),
                              "TINY_LLM_STUB_TASK": ",".join(t.id for t in CPP_TASKS)})
    assert run.stdout.splitlines() == [TASKS["4.2"].message, TASKS["5.3"].message], run.stderr


@needs_linux_compiler
@pytest.mark.parametrize("task", METAL_TASKS, ids=lambda t: t.id)
def test_stubbing_a_metal_task_alone_stops_the_emulated_kernel_with_its_message(task):
    sys.path.insert(0, str(course.SRC.parents[1] / "tools"))
    from tiny_llm.kernels.extension import extension
    from tiny_llm.testing.paged import make_paged_case

    from metal_emulator import EmulatorError, run_plan

    (path,) = {r.path for r in task.regions}
    source = course.SRC.parent / path
    stub = course.stubbed(source.read_text(), path, {task.id})
    case = make_paged_case([(20, 1), (9, 3)], group=3, n_kv_heads=1)
    plan = extension().metal_launch_plan(*case.args(), tiled=True)
    header = plan["header"]
    assert header.endswith(source.read_text())  # the reference, as the extension embeds it
    plan["header"] = header[: len(header) - len(source.read_text())] + stub
    with pytest.raises(EmulatorError, match=re.escape(task.message)):
        run_plan(plan, source, schedules=("forward",))


# ---------------------------------------------------------------------------------------
# Tasks pass in order: the tasks after k still stubs, task k's tests pass


def later_tasks(task: course.Task) -> set[str]:
    return {t.id for t in TASKS.values() if t.day == task.day and t.number > task.number}


def write_python_stubs(ws: Path, day: int, ids: set[str]) -> None:
    """The day's Python modules into the workspace, with the tasks ``ids`` stubbed."""
    for path in {r.path for t in PYTHON_TASKS if t.day == day for r in t.regions}:
        target = ws / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(course.stubbed((course.SRC.parent / path).read_text(), path, ids))


def in_order_run(task: course.Task, ws: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    write_python_stubs(ws, task.day, later_tasks(task))
    return course.run_task_tests(task, ws, env=env)


def passing(task: course.Task, run: subprocess.CompletedProcess) -> None:
    later = ", ".join(sorted(later_tasks(task))) or "none"
    assert course.outcome(run) == "pass", (
        f"task {task.id} done, the tasks after it ({later}) stubbed: its tests do not pass\n"
        f"{(run.stdout + run.stderr)[-3000:]}")


def day_has_cpp_tasks(day: int) -> bool:
    return any(t.day == day for t in CPP_TASKS)


# A day's last task has no task after it: with it done, the day is the reference, whose
# passing every task's tests is the rest of the suite.
@pytest.mark.parametrize("task", [t for t in PYTHON_TASKS
                                  if not day_has_cpp_tasks(t.day) and later_tasks(t)],
                         ids=lambda t: t.id)
def test_a_python_task_passes_with_the_tasks_after_it_stubbed(task, python_runs):
    passing(task, python_runs.result(("in order", task.id)))


@needs_linux_compiler
@pytest.mark.parametrize("task", [t for t in [*PYTHON_TASKS, *CPP_TASKS]
                                  if day_has_cpp_tasks(t.day) and later_tasks(t)],
                         ids=lambda t: t.id)
def test_a_kernel_days_task_passes_with_the_tasks_after_it_stubbed(task, kernel_runs):
    passing(task, kernel_runs.result(("in order", task.id)))


# ---------------------------------------------------------------------------------------
# The course's kernel and the engine's


@needs_linux_compiler
@pytest.mark.parametrize("tiled", [False, True], ids=["vector", "tiles"])
def test_the_course_kernel_computes_the_tuned_kernels_attention(tiled, switchable_extension):
    """A learner's build runs the readable fold (``fold_page_plain``, Task 4.2), the engine's
    the tuned one; the same attention within float32 rounding (their exp and the order of
    their sums differ, so the bits do too)."""
    from tiny_llm.kernels.extension import reference_extension
    from tiny_llm.testing.paged import make_paged_case

    import mlx.core as mx
    import numpy as np

    course_kernel = learner.learner_extension(switchable_extension)
    case = make_paged_case([(70, 1), (33, 9), (90, 24)], group=3, n_kv_heads=2, head_dim=72)
    with mx.stream(mx.cpu):
        got = np.asarray(course_kernel.paged_attention(*case.args(), tiled=tiled))
        tuned = np.asarray(reference_extension().paged_attention(*case.args(), tiled=tiled))
    np.testing.assert_allclose(got, tuned, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(got, tuned), "the course's build ran the tuned kernel"


# ---------------------------------------------------------------------------------------
# Wrong code a learner might write fails the task's tests

# One learner-style mistake per Python task: (file, reference text, the mistake). Planted
# in the reference alone, it must make the task's tests fail.
D1, D2 = "tiny_llm/day1_batching.py", "tiny_llm/day2_chunked_prefill.py"
D3 = "tiny_llm/day3_paged_kv.py"
D4, D5 = "tiny_llm/day4_paged_attention.py", "tiny_llm/day5_paged_flash.py"
SPEC, MOE = "tiny_llm/speculative.py", "tiny_llm/moe.py"
TP = "tiny_llm/tensor_parallel.py"
STRUCTURED = "tiny_llm/structured.py"
MUTANTS = {
    "1.1": (D1, "self.left -= 1", "pass"),  # a decode that costs the budget nothing
    "1.2": (D1, "self.caches[slot].reset()", "pass"),  # a reused slot keeps old K/V
    "1.3": (D1, "self.kv.free(req)\n", "\n"),  # a retired request keeps its storage
    "1.4": (D1, 'return self.policy == "continuous" or not self.running', "return True"),
    "1.5": (D1, "ScheduledChunk(r, r.num_computed_tokens,", "ScheduledChunk(r, 0,"),
    "1.6": (D1, "scale, chunk.start))", "scale, 0))"),  # every chunk at position 0
    "1.7": (D1, "steps = sum(max(output_lens", "steps = sum(min(output_lens"),
    "2.1": (D2, "granted = min(needed, self.left)", "granted = needed"),
    "2.2": (D2, "return decodes + prefills", "return prefills + decodes"),
    "2.3": (D2, "granted = min(granted, self.max_chunk)",
            "granted = min(granted, self.max_chunk + 1)"),
    "3.1": (D3, "return -(-num_tokens // block_size)", "return num_tokens // block_size + 1"),
    "3.2": (D3, "if max_len is None else max_len", "if max_len else 0"),
    "3.3": (D3, "blocks_needed(new_len, self.block_size) - len(table)",
            "blocks_needed(num_tokens, self.block_size) - len(table)"),
    "3.4": (D3, "for block_id in reversed(table[keep:]):", "for block_id in table[keep:]:"),
    "3.5": (D3, "range(0, len(token_ids) - 1 - bs + 1, bs)",
            "range(0, len(token_ids) - bs + 1, bs)"),
    "3.6": (D3, "table[p // page_size] * page_size + p % page_size",
            "table[p // page_size] + p % page_size"),
    "3.7": (D3, "budget.give_back(plan.pop(victim))", "plan.pop(victim)"),
    "4.1": (D4, "<= walk.last_pos  # [T,1,1,S]", "< walk.last_pos  # [T,1,1,S]"),
    "5.1": (D5, "QueryTile(b, first, min(tile_rows, hi - first))",
            "QueryTile(b, first, tile_rows)"),
    "5.2": (D5, "key_pos[None, None, None, :] <= limit", "key_pos[None, None, None, :] < limit"),
    "6.1": (SPEC, "rng.random() < min(1.0, p / q)", "rng.random() < p"),
    "6.2": (SPEC, "block_size > num_tokens:", "block_size > num_tokens + 1:"),
    "6.3": (SPEC, "range(len(tokens) - n - 1, -1, -1)", "range(len(tokens) - n)"),
    "6.4": (SPEC, "node = drafts.parent(node)", "node = -1"),  # a draft sees no ancestor
    "6.5": (SPEC, "p = residual / residual.sum()", "p = target_probs[row]"),  # no residual
    "7.1": (MOE, "if normalize:", "if not normalize:"),
    "7.2": (MOE, "x[order // experts.shape[1]]", "x[order // experts.shape[0]]"),
    "7.3": (MOE, "mx.zeros_like(outputs).at[order].add(outputs)", "outputs"),
    "8.1": (TP, "slice(rank * step, (rank + 1) * step)", "slice(0, step)"),  # all keep rank 0's
    "8.2": (TP, "for r in range(1, group.size()):", "for r in range(2, group.size()):"),
    "8.3": (TP, "arrays = [batch.token_ids, batch.positions,",  # not the order it is read in
            "arrays = [batch.positions, batch.token_ids,"),
    "9.1": (STRUCTURED, 'bitorder="little"', 'bitorder="big"'),  # each byte's bits reversed
    "9.2": (STRUCTURED, "np.where(constraint.allowed(), np.asarray(row, dtype=np.float32),",
            "np.where(~constraint.allowed(), np.asarray(row, dtype=np.float32),"),  # inverted
}


# One per kernel task. A C++ mistake is an expression for an expression (the switchable
# build switches it on at run time); a Metal one is written into the kernel file, and the
# extension, which embeds that file, is rebuilt around it.
CPU_ATTENTION, OPS = "extensions/cpu_attention.cpp", "extensions/paged_ops.cpp"
METAL = "extensions/metal/paged_attention.metal"
KERNEL_MUTANTS = {
    "4.2": (CPU_ATTENTION, "acc[d] *= correction", "acc[d] *= 1.0f"),  # l rescaled, acc not
    "4.3": (OPS, "dst + slots[t] * row_bytes", "dst + t * row_bytes"),  # rows in order, no slots
    "4.4": (METAL,  # a 32-bit pool offset: wraps past 2**31 elements
            "const long base = (long(page) * page_size + t) * slot_stride + long(kv_head) * "
            "HEAD_DIM;", "const int base = (page * page_size + t) * slot_stride + kv_head * "
            "HEAD_DIM;"),
    "5.3": (CPU_ATTENTION, "qsl[b + 1] - r", "qsl[b + 1] - r - 1"),  # each tile a row short
    "5.4": (METAL, "const long offset = (long(page) * page_size + key0 % page_size + t)",
            "const int offset = (page * page_size + key0 % page_size + t)"),
}


# More of the mistakes a learner makes, where a task has several likely ones: the chunk's
# offset, a slot taken twice, one slot too many, an exact fit refused, a waiting request left
# queued, a shared page freed under its other reader, prefix hashes not chained, the newest
# prompt first, garbage past the visible keys.
MORE_MUTANTS = [
    ("1.1", D1, "if needed > self.left:", "if needed >= self.left:"),
    ("1.2", D1, "        if request not in self.slot_of:\n            self.slot_of[request] = "
     "self.free_slots.pop()", "        self.slot_of[request] = self.free_slots.pop()"),
    ("1.3", D1, "        elif req in self.waiting:\n            self.waiting.remove(req)\n", ""),
    ("1.4", D1, "len(self.running) < self.max_num_seqs", "len(self.running) <= self.max_num_seqs"),
    ("1.6", D1, "cache.attend_at(layer, q[lo:hi], k[lo:hi], v[lo:hi], scale, chunk.start)",
     "cache.attend(layer, q[lo:hi], k[lo:hi], v[lo:hi], scale)"),
    ("2.2", D2, "return decodes + prefills  #", "return decodes + prefills[::-1]  #"),
    ("3.4", D3, "block.ref_count -= 1", "block.ref_count = 0"),
    ("3.5", D3, "parent = page_hash(parent, page_tokens)\n            block_id",
     "parent = page_hash(None, page_tokens)\n            block_id"),
    ("4.1", D4, "v = mx.where(visible.reshape(T, page_size, 1, 1), v, 0.0)", "v = v"),
    ("5.2", D5, "v = mx.where(seen, v, 0.0)", "v = v"),
]
ALL_MUTANTS = [(task_id, *m) for task_id, m in MUTANTS.items()] + MORE_MUTANTS


def test_every_task_has_a_mistake_to_catch():
    assert set(MUTANTS) == {t.id for t in PYTHON_TASKS}
    assert set(KERNEL_MUTANTS) == {t.id for t in TASKS.values() if t.kind == "kernel"}


def planted(task: course.Task, file: str, right: str, wrong: str) -> str:
    """The reference ``file`` with the mistake planted, checked to lie in the task's code."""
    path = Path(file)
    reference = (course.SRC.parent / path).read_text()
    assert reference.count(right) == 1, f"{task.id}: the mutant's text is not in {file} once"
    line = reference[: reference.index(right)].count("\n")
    assert any(r.path == path and r.start < line < r.end for r in task.regions), (
        f"{task.id}: the mutant is not in the task's code")
    return reference.replace(right, wrong)


def caught(task: course.Task, wrong: str, run: subprocess.CompletedProcess) -> None:
    assert run.returncode == 1, (f"task {task.id}: a learner's mistake ({wrong.strip()!r}) "
                                 f"passes its tests\n{(run.stdout + run.stderr)[-2000:]}")


def mistake_run(task: course.Task, file: str, right: str, wrong: str,
                ws: Path) -> subprocess.CompletedProcess:
    target = ws / file
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(planted(task, file, right, wrong))
    return course.run_task_tests(task, ws, extra=["-x"])


@pytest.mark.parametrize("task_id,file,right,wrong", ALL_MUTANTS,
                         ids=[f"{m[0]}-{n}" for n, m in enumerate(ALL_MUTANTS)])
def test_a_learners_mistake_fails_the_tasks_tests(task_id, file, right, wrong, python_runs):
    caught(TASKS[task_id], wrong, python_runs.result(("mistake", task_id, right)))


@needs_linux_compiler
@pytest.mark.parametrize("task", [*CPP_TASKS, *METAL_TASKS], ids=lambda t: t.id)
def test_a_learners_kernel_mistake_fails_the_tasks_tests(task, switchable_extension, kernel_runs):
    file, right, wrong = KERNEL_MUTANTS[task.id]
    text = planted(task, file, right, wrong)
    if task in CPP_TASKS:
        caught(task, wrong, kernel_runs.result(("mistake", task.id)))
        return
    kernel_runs.join()  # nothing else may run on the build while the kernel changes
    kernel = switchable_extension / file
    reference = kernel.read_text()
    kernel.write_text(text)  # newer than the build: the task's tests rebuild the extension
    try:
        caught(task, wrong, course.run_task_tests(task, switchable_extension, extra=["-x"]))
    finally:
        kernel.write_text(reference)
