"""Shared test setup, and the course's switches.

tiny_llm must be imported before mlx.core: it interposes OpenBLAS for MLX's CPU GEMM.
Engine tests use tiny random models (``tiny_llm.testing.models``, built in-process, never
downloaded) together with the real SmolLM2 tokenizer read from the installed GGUF file, so
stop strings and streaming text behave as they do with a real model.

Course options (the book's setup chapter):

- ``--learner`` runs the tests on the learner's workspace (``workspace/``) where it has a
  day's module, and on the reference elsewhere; ``--learner-workspace DIR`` names another
  workspace. Same as ``TINY_LLM_LEARNER=1``.
- ``--task 3.2`` keeps the tests of one course task (a test says which tasks it checks
  with ``@pytest.mark.task("3.2")``); ``-k task_2`` does the same within a day's file.

``--gpu-rehearsal`` (or ``TINY_LLM_GPU_REHEARSAL=1``) runs the tests as a Mac's GPU would
decide them, computing on the CPU (``tiny_llm.kernels.device``); ``make test`` runs the suite once
more that way. A test of a CPU-only path runs on the CPU on every machine (the ``cpu_device``
fixture, ``tiny_llm.testing.devices``); a test no device decision reaches (compilers, the
book, the emulator's own machinery) is marked ``device_independent`` and left to the main
pass.
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import tiny_llm  # noqa: F401  (side effect: loads the OpenBLAS shim first)
from tiny_llm.course import learner
from tiny_llm.course import workspace as course
from tiny_llm.kernels import device
from tiny_llm.models.tokenizer import Tokenizer
from tiny_llm.testing.devices import cpu_device, gpu_decisions  # noqa: F401  (fixtures)

import mlx.core as mx
import pytest


def pytest_addoption(parser):
    group = parser.getgroup("course")
    group.addoption("--learner", action="store_true",
                    help="run on the learner's workspace (workspace/) where it has a module")
    group.addoption("--learner-workspace", default=None, metavar="DIR",
                    help="run on this workspace instead of workspace/")
    group.addoption("--task", action="append", default=[], metavar="ID",
                    help="only the tests of course task ID (e.g. 3.2); repeatable")
    parser.addoption("--gpu-rehearsal", action="store_true",
                     help="take the GPU's decisions while computing on the CPU "
                          "(tiny_llm.kernels.device; same as TINY_LLM_GPU_REHEARSAL=1)")


def set_learner_switch(config) -> None:
    """Before any test module imports a day's module: the switch decides where it comes from."""
    if config.getoption("learner_workspace"):
        os.environ[learner.ENV] = config.getoption("learner_workspace")
    elif config.getoption("--learner") and os.environ.get(learner.ENV, "0") == "0":
        os.environ[learner.ENV] = "1"


def pytest_configure(config):
    set_learner_switch(config)
    config.addinivalue_line("markers", "task(*ids): the course tasks this test checks")
    config.addinivalue_line("markers", "device_independent: no device decision reaches this "
                            "test; the GPU rehearsal leaves it to the main pass")
    if config.getoption("--gpu-rehearsal"):
        device.set_gpu_rehearsal(True)


def pytest_cmdline_main(config):
    """With a learner's extension in play, the tests run in a child process: a crash in the
    learner's native code then ends with a message naming the test and its task (the crash's
    own output names neither), instead of killing pytest. The extension is built first, here,
    where its progress shows (pytest captures what the tests print)."""
    set_learner_switch(config)  # pytest_configure comes later
    ws = learner.workspace()
    if ws is None or not (ws / "extensions").is_dir() or os.environ.get(course.TEST_LOG_ENV) \
            or config.option.help or config.option.version:
        return None
    try:
        learner.build_learner_extension(ws)
    except ImportError as e:  # the tests report it too, each where it stops them
        print(f"tiny_llm: {e}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="tiny_llm_tests_") as tmp:
        log = Path(tmp) / "running"
        run = subprocess.run([sys.executable, "-m", "pytest", *config.invocation_params.args],
                             cwd=config.invocation_params.dir,
                             env={**os.environ, course.TEST_LOG_ENV: str(log)})
        message = course.crash_message(run.returncode, log)
    if message is None:
        return run.returncode
    print(message, file=sys.stderr)
    return pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if os.environ.get(course.TEST_LOG_ENV):  # before the test's fixtures run any kernel
        course.record_test(item.nodeid, [i for m in item.iter_markers("task") for i in m.args])


def pytest_sessionstart(session):
    # Written here, not in the report header, which -q (the project's addopts) hides: whose
    # code the tests run on must always be said.
    lines = []
    if device.rehearsing_gpu():
        lines.append("GPU rehearsal: the GPU's decisions, computed on the CPU")
    if (whose := learner.describe()) is not None:
        lines.append(whose)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter is not None else print
    for line in lines:
        write(line)


def pytest_collection_modifyitems(config, items):
    wanted = set(config.getoption("--task"))
    rehearsal = device.rehearsing_gpu()
    kept, dropped = [], []
    for item in items:
        ids = {i for m in item.iter_markers("task") for i in m.args}
        for task_id in ids:
            day, number = task_id.split(".")
            item.extra_keyword_matches.update({f"task_{number}", f"task_{day}_{number}"})
        keep = (not wanted or ids & wanted) and not (
            rehearsal and item.get_closest_marker("device_independent"))
        (kept if keep else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_collection_finish(session):
    """``-k task_4`` on a day's file that holds none of Task 4's tests (a Metal task's live in
    test_metal_kernels.py): say where they are, instead of a bare "no tests ran"."""
    keyword = session.config.option.keyword
    if session.items or not keyword:
        return
    chapter_days = {test_file: day for day, (_, _, test_file) in course.CHAPTERS.items()}
    days = {chapter_days[Path(a.split("::")[0]).name] for a in session.config.args
            if Path(a.split("::")[0]).name in chapter_days}
    wanted = {f"{day}.{m[2]}" for m in re.finditer(r"task_(\d+_)?(\d+)", keyword)
              for day in ({int(m[1][:-1])} if m[1] else days)}
    write = session.config.pluginmanager.get_plugin("terminalreporter").write_line
    for task in (course.tasks()[i] for i in sorted(wanted) if i in course.tasks()):
        files = " and ".join(str(f.relative_to(course.TESTS.parent))
                             for f in course.test_files(task))
        write(f"Task {task.id}'s tests are in {files}: `tiny-llm course test {task.id}` runs "
              "them all")


@pytest.fixture(scope="session")
def smollm_tokenizer() -> Tokenizer:
    from tiny_llm.models.loader import default_model_path

    _, meta = mx.load(str(default_model_path()), return_metadata=True)
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="session")
def tiny_model():
    # Imported here, not above: the model imports moe.py, a course module, which must not be
    # loaded before pytest_configure has set the learner switch.
    from tiny_llm.testing.models import make_tiny_model

    return make_tiny_model()


@pytest.fixture(scope="session")
def other_tiny_model():
    """The target's weights with a little noise: a draft that is right about half the time."""
    from tiny_llm.testing.models import make_tiny_model

    from mlx.utils import tree_map

    draft = make_tiny_model()
    mx.random.seed(3)
    draft.update(tree_map(lambda p: p + 0.003 * mx.random.normal(p.shape), draft.parameters()))
    mx.eval(draft.parameters())
    return draft
