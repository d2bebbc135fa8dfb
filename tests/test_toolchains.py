"""Every compiler a reader has: the extension built with clang, and compiled for a Mac.

A Mac reader's ``make setup`` builds the extension with Apple clang against the macOS MLX
headers; this machine builds it with GCC. ``tools/clang_check.py`` builds it with clang here
and compiles every translation unit for ``arm64-apple-macos14`` (the NEON branches, Apple's
libc++). Oracles: the compilers themselves (no error, no warning in the project's sources),
and the GCC build's outputs for the clang build's.
"""

import importlib.util
import sys
from pathlib import Path

from tiny_llm.extension import extension
from tiny_llm.testing.paged import make_paged_case

import mlx.core as mx
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import clang_check  # noqa: E402

pytestmark = pytest.mark.device_independent  # compilers, whatever MLX's device

ON_A_MAC = sys.platform == "darwin"


@pytest.fixture(scope="module")
def clang_build(tmp_path_factory):
    if ON_A_MAC:
        pytest.skip("on a Mac make setup builds the extension in use with Apple clang "
                    "(test_the_build_in_use_has_no_warnings reads its log)")
    if clang_check.clang() is None:
        pytest.skip("no clang here: neither clang++ on PATH nor the ziglang wheel")
    out = tmp_path_factory.mktemp("clang-build")
    return out, clang_check.build(out)


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
def test_every_translation_unit_compiles_for_macos_arm64():
    results = clang_check.macos()
    files = {f.removesuffix(" (course build)") for f, _ in results}
    assert files == {str(p) for p in (REPO / "src" / "extensions").glob("*.cpp")}
    assert any(f.endswith("(course build)") for f, _ in results)  # the learner's kernels too
    failed = {Path(f).name: r.stderr[-2000:] for f, r in results if r.returncode}
    assert failed == {}
