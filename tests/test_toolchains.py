"""Every compiler a reader has: the extension built with clang, and compiled for a Mac.

A Mac reader's ``make setup`` builds the extension with Apple clang against the macOS MLX
headers; this machine builds it with GCC. ``tools/clang_check.py`` builds it with clang here
and compiles every translation unit for ``arm64-apple-macos14`` (the NEON branches, Apple's
libc++). Oracles: the compilers themselves (no error, no warning in the project's sources),
and the GCC build's outputs for the clang build's.

The CI workflow (``.github/workflows/test.yml``) cannot run here: it is parsed, and the shell
of its macOS ``make metal-check`` step runs against a stand-in ``xcrun`` and ``make``.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tiny_llm.kernels.extension import extension
from tiny_llm.testing.paged import make_paged_case

import mlx.core as mx
import numpy as np
import pytest
import yaml
from ahead import Ahead, selected_params

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import clang_check  # noqa: E402

pytestmark = pytest.mark.device_independent  # compilers, whatever MLX's device

ON_A_MAC = sys.platform == "darwin"


@pytest.fixture(scope="module")
def compiles(request, tmp_path_factory):
    """The clang build and the macOS compile of the selected tests below, started together."""
    ahead = Ahead()
    wanted = {name for name, tests in (
        ("clang", (test_clang_builds_the_extension_without_warnings,
                   test_the_clang_build_computes_what_the_gcc_build_computes)),
        ("macos", (test_every_translation_unit_compiles_for_macos_arm64,)))
        if any(selected_params(request, t) for t in tests)}
    if "clang" in wanted and not ON_A_MAC and clang_check.clang() is not None:
        out = tmp_path_factory.mktemp("clang-build")
        ahead.start("clang", lambda: (out, clang_check.build(out)))
    if "macos" in wanted and not ON_A_MAC:
        ahead.start("macos", clang_check.macos)
    yield ahead
    ahead.close()


@pytest.fixture(scope="module")
def clang_build(compiles):
    if ON_A_MAC:
        pytest.skip("on a Mac make setup builds the extension in use with Apple clang "
                    "(test_the_build_in_use_has_no_warnings reads its log)")
    if clang_check.clang() is None:
        pytest.skip("no clang here: neither clang++ on PATH nor the ziglang wheel")
    return compiles.result("clang")


def test_the_build_in_use_has_no_warnings():
    log = REPO / "build-ext.log"
    assert log.exists(), "make setup writes build-ext.log when it builds the extension"
    assert clang_check.own_warnings(log.read_text()) == []


def test_clang_builds_the_extension_without_warnings(clang_build):
    _, run = clang_build
    assert run.returncode == 0, run.stdout[-4000:]
    assert clang_check.own_warnings(run.stdout) == []


def test_the_clang_build_computes_what_the_gcc_build_computes(clang_build):
    out, run = clang_build
    assert run.returncode == 0, run.stdout[-4000:]
    spec = importlib.util.spec_from_file_location("_ext_clang",
                                                  next(out.glob("_ext_clang*.so")))
    clang_ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(clang_ext)
    case = make_paged_case([(1, 37), (5, 20), (16, 16)], group=3, garbage="huge")
    for tiled in (False, True):
        theirs = clang_ext.paged_attention(*case.args(), tiled=tiled)
        ours = extension().paged_attention(*case.args(), tiled=tiled)
        np.testing.assert_allclose(np.array(theirs), np.array(ours), rtol=1e-5, atol=1e-6)
    x = mx.random.normal((5, 64), key=mx.random.key(1))
    w = mx.random.normal((64,), key=mx.random.key(2))
    np.testing.assert_allclose(np.array(clang_ext.rms_norm(x, w, 1e-6)),
                               np.array(extension().rms_norm(x, w, 1e-6)), rtol=1e-6)


@pytest.mark.skipif(ON_A_MAC, reason="on a Mac make setup compiles every file for macOS")
def test_every_translation_unit_compiles_for_macos_arm64(compiles):
    results = compiles.result("macos")
    files = {f.removesuffix(" (course build)") for f, _ in results}
    assert files == {str(p) for p in (REPO / "src" / "extensions").glob("*.cpp")}
    assert any(f.endswith("(course build)") for f, _ in results)  # the learner's kernels too
    failed = {Path(f).name: r.stderr[-2000:] for f, r in results if r.returncode}
    assert failed == {}


# ------------------------------------------------------------------ the CI workflow

WORKFLOW = REPO / ".github" / "workflows" / "test.yml"


def workflow_steps() -> list[dict]:
    job = yaml.safe_load(WORKFLOW.read_text())["jobs"]["make-test"]
    return job["steps"]


def test_the_workflow_runs_make_test_on_a_mac_and_on_linux():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    assert set(workflow[True]) == {"push", "pull_request"}  # YAML 1.1 reads `on` as true
    job = workflow["jobs"]["make-test"]
    systems = job["strategy"]["matrix"]["os"]
    assert any(s.startswith("macos-") for s in systems)
    assert any(s.startswith("ubuntu-") for s in systems)
    (test,) = [step for step in job["steps"] if step.get("run") == "make test"]
    assert "-rs" in test["env"]["PYTEST_ADDOPTS"].split()  # every skip says why


def metal_check_step() -> dict:
    (step,) = [step for step in workflow_steps() if "make metal-check" in step.get("run", "")]
    return step


def run_step(script: str, tmp_path: Path, xcrun: str) -> tuple[str, list[str]]:
    """``script`` run as GitHub runs a step's shell, with a stand-in ``xcrun`` (this shell
    text) and a ``make`` that records its arguments; returns its output and the makes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "make.log"
    for name, text in (("xcrun", xcrun), ("make", f'echo "$*" >> {log}\n')):
        (bin_dir / name).write_text("#!/bin/sh\n" + text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    return run.stdout, log.read_text().splitlines() if log.exists() else []


@pytest.mark.skipif(shutil.which("bash") is None, reason="runs the step's bash script")
def test_the_mac_leg_runs_metal_check_where_the_toolchain_is(tmp_path):
    step = metal_check_step()
    assert step["if"] == "${{ !cancelled() && runner.os == 'macOS' }}"
    toolchain = 'test "$*" = "-sdk macosx metal -v" && echo "Apple metal version 32023.1" >&2\n'
    out, makes = run_step(step["run"], tmp_path, toolchain)
    assert makes == ["metal-check"] and "::notice" not in out


@pytest.mark.skipif(shutil.which("bash") is None, reason="runs the step's bash script")
def test_the_mac_leg_says_why_metal_check_did_not_run(tmp_path):
    missing = ("echo \"error: cannot execute tool 'metal' due to missing Metal Toolchain; use: "
               "xcodebuild -downloadComponent MetalToolchain\" >&2\nexit 72\n")
    out, makes = run_step(metal_check_step()["run"], tmp_path, missing)
    assert makes == []
    assert out.startswith("::notice title=make metal-check did not run::")
    assert "missing Metal Toolchain" in out
