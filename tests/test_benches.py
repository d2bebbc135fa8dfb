"""The measurement scripts in ``benches/`` still import and take the common options.

Every ``benches/bench_*.py`` runs in a fresh interpreter with ``--help``: that imports the
script and everything it imports (``tiny_llm`` before ``mlx.core``, as in a real run) and
builds its parser, so a script broken by an API change fails here rather than when someone
next runs it. Nothing is measured (``--quick`` runs are too slow for the test suite).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHES = sorted((ROOT / "benches").glob("bench_*.py"))
COMMON_OPTIONS = ("--quick", "--rounds", "--learner")  # common.bench_parser


def test_there_are_benchmarks():
    assert BENCHES, "no benches/bench_*.py found"


@pytest.mark.parametrize("script", BENCHES, ids=[p.stem for p in BENCHES])
def test_bench_imports_and_parses_its_options(script: Path):
    proc = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ),
    )
    assert proc.returncode == 0, (
        f"`python benches/{script.name} --help` failed (exit {proc.returncode}):\n"
        f"{proc.stderr[-3000:]}"
    )
    missing = [o for o in COMMON_OPTIONS if o not in proc.stdout]
    assert not missing, f"{script.name} lacks the common options {missing} (use bench_parser)"


def test_quick_outputs_are_git_ignored():
    """``--quick`` writes ``benchmark_results/<name>_quick.*``: never committed."""
    paths = [f"benchmark_results/bench_x_quick.{ext}" for ext in ("json", "md", "png")]
    try:
        proc = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("git is not available")
    if proc.returncode == 128:
        pytest.skip(f"git check-ignore failed: {proc.stderr.strip()}")
    ignored = set(proc.stdout.split())
    assert ignored == set(paths), ".gitignore must ignore benchmark_results/*_quick.*"


def common_module():
    sys.path.insert(0, str(ROOT / "benches"))
    import common

    return common


def test_on_the_cpu_benchmarks_compare_thread_counts(cpu_device):
    common = common_module()
    assert common.bench_device() == "cpu"
    assert common.kernel_thread_counts() == sorted({1, os.cpu_count() or 1})
    assert [common.threads_label(n) for n in (1, 2)] == ["1 thread", "2 threads"]
    env = common.environment()
    assert env["device"] == "cpu"
    assert "on the CPU, OpenBLAS interposed" in common._device_words(env)


def test_where_the_gpu_decides_benchmarks_run_once_and_say_what_ran(gpu_decisions):
    common = common_module()
    rehearsal = common.bench_device() == "gpu rehearsal"
    assert common.bench_device() == ("gpu rehearsal" if rehearsal else "gpu")
    assert common.kernel_thread_counts() == [None]  # no thread counts on a GPU
    assert common.threads_label(None) == ("GPU rehearsal" if rehearsal else "GPU")
    words = common._device_words(common.environment())
    assert ("timed on the CPU" in words) if rehearsal else words.startswith("on the GPU (")
    # An older result, recorded before the device was: the CPU, as it was measured on.
    assert common._device_words({"openblas_interposed": True}).startswith("on the CPU")


def edition(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benches" / "edition.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_edition_has_a_script_for_every_result_the_book_cites():
    sys.path.insert(0, str(ROOT / "tools"))
    import book_results

    listed = edition("--list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == book_results.cited_results()
    assert len(listed.stdout.split()) >= 10
    for name in listed.stdout.split():
        assert (ROOT / "benches" / f"{name}.py").is_file(), name


def test_the_edition_refuses_what_the_book_would_refuse():
    assert "at least 3 rounds" in edition("--rounds", "2").stderr
    refused = edition("--only", "bench_nothing", "--list")
    assert refused.returncode != 0 and "bench_nothing" in refused.stderr


def test_the_edition_describes_the_machines_cpu():
    sys.path.insert(0, str(ROOT / "benches"))
    import edition as script

    model, isa = script.cpu_words()
    assert model and isa
