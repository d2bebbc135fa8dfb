"""The measurement scripts in ``benches/`` run as a reader runs them.

Every ``benches/bench_*.py`` runs in a fresh interpreter with ``--help``: that imports the
script and everything it imports (``tiny_llm`` before ``mlx.core``, as in a real run) and
builds its parser. Every chapter's script, and the others a reader runs, also runs whole on a
tiny model (``--quick``, one round) into a temporary folder, and must write its result: a
script broken by an API change fails here rather than when a reader next runs it. (Their
runs on a learner's workspace: ``test_learner_workspace.py``.)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ahead import Ahead, selected_params

ROOT = Path(__file__).resolve().parent.parent
BENCHES = sorted((ROOT / "benches").glob("bench_*.py"))
COMMON_OPTIONS = ("--quick", "--rounds", "--learner", "--results-dir")  # common.bench_parser
# Scripts that run whole here: every chapter's (the model's, the days', speculation, MoE,
# serving, tensor parallelism) and the performance appendix's, bench_vs_llama_cpp in its own
# test below, and bench_before_after (the working tree against HEAD, in a git worktree). Not
# bench_blas_threads, which spins a neighbour on a core for minutes to measure OpenBLAS
# beside it (it runs under --help above).
QUICK_RUNS = ["bench_model", "bench_week3_day1", "bench_week3_day2", "bench_week3_day3",
              "bench_week3_day4", "bench_week3_day5", "bench_week3_speculative",
              "bench_week3_moe", "bench_structured", "bench_serve", "bench_serve_soak",
              "bench_tensor_parallel", "bench_cpu_speed", "bench_cpu_decode",
              "bench_roofline", "bench_before_after"]


def run_quick(name: str, results: Path, env: dict[str, str] | None = None,
              *extra: str) -> subprocess.CompletedProcess:
    """``python benches/<name>.py --quick --rounds 1`` writing into ``results``."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benches" / f"{name}.py"), "--quick", "--rounds", "1",
         "--results-dir", str(results), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def check_result(name: str, results: Path, proc: subprocess.CompletedProcess) -> dict:
    """The run succeeded and wrote ``<name>_quick.json`` with tables of rows, and the ``.md``
    rendered from it; returns the JSON. A script of the Linux CPU path stops at once on a
    Mac's GPU (its own exit status): that is a skip there, and a failure anywhere else."""
    common = common_module()
    if proc.returncode == common.NOT_THIS_MACHINE and sys.platform == "darwin":
        pytest.skip(f"benches/{name}.py measures the Linux CPU path: {proc.stderr.strip()}")
    assert proc.returncode == 0, (f"`python benches/{name}.py --quick` failed (exit "
                                  f"{proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    result = json.loads((results / f"{name}_quick.json").read_text())
    assert result["tables"] and all(t["rows"] for t in result["tables"]), result["tables"]
    assert (results / f"{name}_quick.md").read_text() == common.render_markdown(result)
    return result


def test_there_are_benchmarks():
    assert BENCHES, "no benches/bench_*.py found"


NOT_RUN_WHOLE = [p for p in BENCHES if p.stem not in (*QUICK_RUNS, "bench_vs_llama_cpp")]


def test_every_script_takes_the_common_options():
    missing = [p.name for p in BENCHES if "bench_parser(" not in p.read_text()]
    assert not missing, f"{missing} do not build their options with common.bench_parser"


@pytest.mark.parametrize("script", NOT_RUN_WHOLE, ids=[p.stem for p in NOT_RUN_WHOLE])
def test_a_script_not_run_here_imports_and_parses_its_options(script: Path):
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


@pytest.fixture(scope="module")
def quick(request, tmp_path_factory):
    """The selected scripts' quick runs, started together, each into its own folder; with the
    modification time of the book's copy of its quick result before it ran."""
    ahead = Ahead()
    names = [p["name"] for p in selected_params(request, test_the_benchmark_runs_quick)]
    if selected_params(request, test_without_llama_bench_its_columns_are_skipped_with_the_reason):
        names.append("bench_vs_llama_cpp")
    if selected_params(request, test_the_roofline_accounts_for_every_millisecond):
        names = list(dict.fromkeys([*names, "bench_roofline"]))
    for name in names:
        book_copy = ROOT / "benchmark_results" / f"{name}_quick.json"
        before = book_copy.stat().st_mtime_ns if book_copy.exists() else None
        folder = tmp_path_factory.mktemp(name)
        ahead.start(name, lambda n=name, f=folder, b=before: (f, b, run_quick(n, f)))
    yield ahead
    ahead.close()


@pytest.mark.device_independent  # the script chooses its configurations by the device itself
@pytest.mark.parametrize("name", QUICK_RUNS)
def test_the_benchmark_runs_quick(name: str, quick: Ahead):
    folder, before, proc = quick.result(name)
    result = check_result(name, folder, proc)
    assert result["environment"]["learner"] is None  # the reference's code
    book_copy = ROOT / "benchmark_results" / f"{name}_quick.json"
    after = book_copy.stat().st_mtime_ns if book_copy.exists() else None
    assert before == after, "--results-dir was not where the script wrote"


@pytest.mark.device_independent
def test_without_llama_bench_its_columns_are_skipped_with_the_reason(quick: Ahead):
    folder, _, proc = quick.result("bench_vs_llama_cpp")
    assert "llama.cpp is not measured: no --llama-bench PATH was given" in proc.stdout
    one, batched = check_result("bench_vs_llama_cpp", folder, proc)["tables"]
    assert all(row[0].startswith("engine") and row[-2:] == [None, None] for row in one["rows"])
    assert all(row[0].startswith("engine") and row[-1] is None for row in batched["rows"])
    assert [row[1] for row in batched["rows"]] == [4, 4, 4]  # float32, as stored, int8


@pytest.mark.device_independent  # the CPU's account; the GPU's is the rehearsal's test below
def test_the_roofline_accounts_for_every_millisecond(quick: Ahead):
    """Each step's phases add up to its wall time, every configuration and batch is there,
    and llama.cpp, not built here, is left out with the reason."""
    folder, _, proc = quick.result("bench_roofline")
    result = check_result("bench_roofline", folder, proc)
    assert "llama.cpp is not measured: no --llama-bench PATH was given" in proc.stdout
    data = result["data"]
    assert len(data["configs"]) == 5 and data["batches"] == [1, 4]
    phases = ("scheduler", "sampler", "python_other", "graph", "projections", "attention",
              "kv_write", "vector_ops", "thread_wait", "mlx")
    for key, r in data["results"].items():
        assert sum(r[p] for p in phases) == pytest.approx(r["wall"], rel=1e-6), key
        assert r["projections"] > 0 and r["attention"] > 0, key  # the kernel clocks ran
    assert set(data["results"]) == {f"{c}|{b}" for c in data["configs"]
                                    for b in ("1", "4", "prefill")}
    assert (folder / "bench_roofline_quick.png").is_file()


@pytest.mark.device_independent
def test_the_roofline_refuses_a_metal_capture_off_a_gpu(tmp_path):
    proc = run_quick("bench_roofline", tmp_path, None, "--metal-capture",
                     str(tmp_path / "step.gputrace"))
    assert proc.returncode != 0 and "--metal-capture records a GPU's work" in proc.stderr


@pytest.mark.device_independent  # it sets the rehearsal itself
def test_the_roofline_runs_the_gpus_account_in_the_rehearsal(tmp_path):
    """On a GPU the account has one configuration and no kernel clocks: the rehearsal runs
    that path (a smoke run: its times are the CPU's)."""
    proc = run_quick("bench_roofline", tmp_path, {"TINY_LLM_GPU_REHEARSAL": "1"})
    result = check_result("bench_roofline", tmp_path, proc)
    data = result["data"]
    assert data["configs"] == ["the default engine"] and data["device"] == "gpu rehearsal"
    for r in data["results"].values():
        assert r["projections"] == 0 and r["mlx"] == pytest.approx(r["eval"])
    assert "GPU rehearsal" in result["tables"][0]["note"]


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


def test_the_edition_runs_a_script_again_when_the_machine_was_busy(monkeypatch):
    """A script that ran beside other work runs once more, and the table keeps the run it
    reports; a script's own processes are not other work."""
    sys.path.insert(0, str(ROOT / "benches"))
    import edition as script

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    own = script.run_watching_the_machine([sys.executable, "-c", spin])
    assert own.returncode == 0 and own.load >= 0
    # Other work is whatever else runs now (a test cannot make the machine quiet): here
    # only that it was measured on Linux, as a share of cores.
    assert (own.other_cores is not None) == Path("/proc/stat").exists()
    assert own.other_cores is None or 0 <= own.other_cores <= (os.cpu_count() or 1)
    # Other work is the machine's busy time less the script's own, over the wall time:
    # (14 - 2 - 8) / 5 s = 0.8 cores, whatever the script itself used.
    clock = iter([100.0, 105.0])
    monkeypatch.setattr(script, "busy_cpu_seconds", iter([2.0, 14.0]).__next__)
    monkeypatch.setattr(script, "children_cpu_seconds", iter([1.0, 9.0]).__next__)
    monkeypatch.setattr(script.time, "perf_counter", lambda: next(clock))
    scripted = script.run_watching_the_machine([sys.executable, "-c", "pass"])
    assert scripted.other_cores == pytest.approx(0.8) and scripted.busy
    monkeypatch.undo()
    busy, quiet = script.WatchedRun(0, 1.0, 1.5), script.WatchedRun(0, 2.0, 0.1)
    runs = iter([busy, quiet])
    monkeypatch.setattr(script, "run_watching_the_machine", lambda command: next(runs))
    name, _, outcome, load, other = script.run_script("bench_week3_day1", 3, None)
    assert (name, outcome, load, other) == ("bench_week3_day1", "measured, second run", 2.0, 0.1)
    runs = iter([busy, busy])
    assert "still beside other work" in script.run_script("bench_week3_day1", 3, None)[2]
    runs = iter([quiet])
    assert script.run_script("bench_week3_day1", 3, None)[2] == "measured"
    assert script.WatchedRun(0, script.LOAD_LIMIT + 1, None).busy  # off Linux: the load


def test_a_tables_footer_shows_the_command_as_typed_in_the_repository(tmp_path):
    tool = tmp_path / "llama-bench"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    recorded = f"python3.11 {ROOT / 'benches' / 'edition.py'} --llama-bench {tool} --rounds 3"
    assert common_module().reproducing_command(recorded) == (
        "python benches/edition.py --llama-bench llama-bench --rounds 3")


def test_the_edition_describes_the_machines_cpu():
    sys.path.insert(0, str(ROOT / "benches"))
    import edition as script

    model, isa = script.cpu_words()
    assert model and isa
