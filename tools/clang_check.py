"""Build the extension with clang, and compile it for a Mac, on any machine (`make test`).

A Mac reader builds `src/extensions` with Apple clang against the macOS MLX wheel; this
machine may build it with GCC against Linux MLX. Two checks close the gap:

- ``build``: a whole CMake build with clang, as module ``_ext_clang``. The compiler is the
  system's ``clang++`` where there is one, else the clang inside the ``ziglang`` wheel (a test
  dependency on Linux), linked by its lld. A warning in the project's sources fails it.
- ``macos``: every translation unit of the extension compiled (syntax only) for
  ``arm64-apple-macos14``, with the flags of the configured build (``build/ext``), against the
  macOS MLX wheel's headers (``make setup`` fetches them into ``build/macos-mlx``) and the
  libc++ and Darwin libc headers of the ``ziglang`` wheel, so that the branches only a Mac
  compiles (NEON, Apple's libc++) are compiled here too.

    python tools/clang_check.py fetch       # make setup: the macOS headers (Linux only)
    python tools/clang_check.py build DIR
    python tools/clang_check.py macos
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = REPO / "src" / "extensions"
GCC_BUILD = REPO / "build" / "ext"
MACOS_MLX = REPO / "build" / "macos-mlx"
MACOS_TARGET = "arm64-apple-macos14"

# Zig's libc++ takes its configuration as macros instead of a generated __config_site;
# these are the ones zig itself passes for a macOS target.
LIBCXX_CONFIG = [
    "_LIBCPP_ABI_VERSION=1", "_LIBCPP_ABI_NAMESPACE=__1", "_LIBCPP_HAS_THREADS=1",
    "_LIBCPP_HAS_MONOTONIC_CLOCK", "_LIBCPP_HAS_TERMINAL", "_LIBCPP_HAS_MUSL_LIBC=0",
    "_LIBCXXABI_DISABLE_VISIBILITY_ANNOTATIONS", "_LIBCPP_DISABLE_VISIBILITY_ANNOTATIONS",
    "_LIBCPP_HAS_VENDOR_AVAILABILITY_ANNOTATIONS=0", "_LIBCPP_HAS_FILESYSTEM=1",
    "_LIBCPP_HAS_RANDOM_DEVICE", "_LIBCPP_HAS_LOCALIZATION", "_LIBCPP_HAS_UNICODE",
    "_LIBCPP_HAS_WIDE_CHARACTERS", "_LIBCPP_HAS_NO_STD_MODULES", "_LIBCPP_PSTL_BACKEND_SERIAL",
    "_LIBCPP_HARDENING_MODE=_LIBCPP_HARDENING_MODE_NONE",
    "_LIBCPP_ASSERTION_SEMANTIC_DEFAULT=_LIBCPP_ASSERTION_SEMANTIC_IGNORE",
]


def zig_dir() -> Path | None:
    """The ``ziglang`` package's folder (its ``zig`` binary and ``lib/`` headers), if any."""
    try:
        import ziglang
    except ImportError:
        return None
    return Path(ziglang.__file__).parent


def _zig_clang(zig: Path) -> list[str]:
    # The wheel keeps clang's own headers under lib/include, so that is the resource dir.
    return [str(zig / "zig"), "clang", "--driver-mode=g++", f"-resource-dir={zig / 'lib'}"]


def clang() -> tuple[list[str], dict[str, str]] | None:
    """The clang++ command line and the environment CMake needs to build with it."""
    system = shutil.which("clang++")
    if system:
        return [system], {}
    zig = zig_dir()
    if zig is None:
        return None
    # The wheel has no LLVMgold plugin for the system linker, so the LTO build links with
    # the wheel's lld, reached through a one-line wrapper.
    wrapper = REPO / "build" / "zig-ld.lld"
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(str(zig / "zig"))} ld.lld "$@"\n')
    wrapper.chmod(0o755)
    return _zig_clang(zig), {"LDFLAGS": f"-fuse-ld=lld --ld-path={wrapper}"}


def own_warnings(log: str) -> list[str]:
    """The warnings located in the project's sources (clang also reports some located in
    the standard library's headers, such as libstdc++'s std::bind under C++20)."""
    return [line for line in log.splitlines()
            if "warning:" in line and line.startswith(str(SOURCES))]


def build(out: Path) -> subprocess.CompletedProcess:
    """Configure and build the extension with clang in ``out``; the module is ``_ext_clang``."""
    found = clang()
    if found is None:
        raise RuntimeError("no clang: neither clang++ on PATH nor the ziglang wheel")
    cxx, env = found
    cmake = Path(sys.executable).with_name("cmake")
    configure = [str(cmake if cmake.exists() else "cmake"), "-S", str(SOURCES), "-B", str(out),
                 f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release",
                 "-DTINY_LLM_EXT_NAME=_ext_clang"]
    env = {**os.environ, **env, "CXX": shlex.join(cxx)}
    log = ""
    for args in (configure, [configure[0], "--build", str(out), "-j2"]):
        run = subprocess.run(args, capture_output=True, text=True, env=env)
        log += run.stdout + run.stderr
        if run.returncode:
            return subprocess.CompletedProcess(args, run.returncode, log, "")
    return subprocess.CompletedProcess(configure, 0, log, "")


def fetch_macos_headers() -> None:
    """Unpack ``mlx/include`` of the macOS arm64 ``mlx-metal`` wheel (the one the ``mlx``
    wheel of the installed version depends on) into ``build/macos-mlx``."""
    from importlib.metadata import version

    wheels = REPO / "build" / "macos-wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--platform", "macosx_14_0_arm64",
                    "--python-version", "3.11", "-d", str(wheels),
                    f"mlx-metal=={version('mlx')}"], check=True)
    prefix = "mlx/include/"
    with zipfile.ZipFile(next(wheels.glob(f"mlx_metal-{version('mlx')}-*.whl"))) as wheel:
        shutil.rmtree(MACOS_MLX, ignore_errors=True)
        for name in wheel.namelist():
            if name.startswith(prefix) and not name.endswith("/"):
                target = MACOS_MLX / name[len(prefix):]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(wheel.read(name))


def project_entries() -> list[dict[str, str]]:
    """The configured build's (``build/ext``) compile commands of the project's own files."""
    entries = json.loads((GCC_BUILD / "compile_commands.json").read_text())
    return [e for e in entries if e["file"].startswith(str(SOURCES))]  # not nanobind's


def compile_flags(entry: dict[str, str]) -> list[str]:
    """A compile command's flags, without the compiler, the source and the output."""
    args = iter(shlex.split(entry["command"])[1:])
    flags = []
    for arg in args:
        if arg == "-o":
            next(args)
        elif arg not in ("-c", entry["file"]):
            flags.append(arg)
    return flags


def syntax_only(source: Path, compiled_as: str) -> list[str]:
    """The configured build's command for ``src/extensions/<compiled_as>``, checking
    ``source`` instead, syntax only (a learner's copy of the file)."""
    (entry,) = [e for e in project_entries() if Path(e["file"]).name == compiled_as]
    compiler = shlex.split(entry["command"])[0]
    return [compiler, *compile_flags(entry), "-fsyntax-only", str(source)]


def macos_commands() -> list[tuple[str, list[str]]]:
    """(file, clang command) for each translation unit, for arm64-apple-macos14."""
    zig = zig_dir()
    if zig is None:
        raise RuntimeError("the macOS compile needs the ziglang wheel (pip install ziglang)")
    if not (MACOS_MLX / "mlx").is_dir():
        raise RuntimeError(f"no macOS MLX headers in {MACOS_MLX}: run make setup")
    out = []
    for entry in project_entries():
        flags = [str(MACOS_MLX) if arg.endswith("mlx/include") else arg
                 for arg in compile_flags(entry) if not arg.startswith(("-march", "-flto"))]
        headers = zig / "lib"
        command = [
            *_zig_clang(zig), "-target", MACOS_TARGET, "-fsyntax-only", "-nostdinc",
            "-nostdinc++", "-isystem", str(headers / "libcxx" / "include"),
            "-isystem", str(headers / "libcxxabi" / "include"),
            "-isystem", str(headers / "include"),
            "-isystem", str(headers / "libc" / "include" / "any-darwin-any"),
            *(f"-D{m}" for m in LIBCXX_CONFIG), *flags, "-Werror", entry["file"]]
        out.append((entry["file"], command))
        if "TINY_LLM_COURSE_KERNEL" in Path(entry["file"]).read_text():  # a learner's build
            out.append((f"{entry['file']} (course build)",
                        [*command[:-1], "-DTINY_LLM_COURSE_KERNEL=1", entry["file"]]))
    return out


def macos() -> list[tuple[str, subprocess.CompletedProcess]]:
    """Compile each translation unit for a Mac, one a core at a time; returns (file, result)
    for each."""
    commands = macos_commands()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # the compiler is one core each
        results = list(pool.map(lambda c: subprocess.run(c[1], capture_output=True, text=True),
                                commands))
    return [(file, run) for (file, _), run in zip(commands, results, strict=True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="check", required=True)
    sub.add_parser("fetch", help="fetch the macOS MLX headers into build/macos-mlx")
    sub.add_parser("build", help="a clang build into DIR").add_argument("dir", type=Path)
    sub.add_parser("macos", help="compile every file for arm64-apple-macos14")
    args = parser.parse_args()
    if args.check == "fetch":
        fetch_macos_headers()
        return 0
    if args.check == "build":
        run = build(args.dir)
        warnings = own_warnings(run.stdout)
        print(run.stdout[-4000:] if run.returncode else "\n".join(warnings) or "clang: ok")
        return run.returncode or bool(warnings)
    failed = 0
    for file, run in macos():
        print(f"{MACOS_TARGET}: {Path(file).name}: {'ok' if run.returncode == 0 else 'FAILED'}")
        if run.returncode:
            print(run.stderr[-4000:])
            failed += 1
    return bool(failed)


if __name__ == "__main__":
    sys.exit(main())
