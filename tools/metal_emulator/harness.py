"""Compile a .metal file as C++ against the shim and run its kernels from Python.

Flow: ``compile_metal(path)`` pre-passes the source (``source.prepass``),
compiles it with g++ together with the emulator runtime into a shared object
cached under ``tools/metal_emulator/.cache/`` (keyed by a hash of the
translation unit, included project headers, shim, runtime, flags and compiler
version), loads it with ctypes and returns a ``MetalLibrary``.
``MetalLibrary.run`` binds numpy arrays and Params structs to buffer indices,
launches one kernel under a chosen schedule, and returns every bound array's
final contents. Emulator reports (out-of-bounds accesses, barrier misuse,
simd divergence) raise ``EmulatorError`` subclasses carrying the report.

``run_schedules`` runs one launch under several schedules and requires
bit-identical outputs; a correct kernel has no data races between its
synchronisation points, so any difference is a bug.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .source import MetalSource, Param, four_byte_dtype, local_includes, parse_source, prepass

__all__ = [
    "DEFAULT_SCHEDULES",
    "BarrierError",
    "EmulatorError",
    "MetalCompileError",
    "MetalLibrary",
    "OutOfBoundsError",
    "Outputs",
    "Out",
    "ScheduleMismatch",
    "SimdError",
    "Sparse",
    "bfloat16_to_float32",
    "compile_metal",
    "float32_to_bfloat16",
    "run_schedules",
]

ROOT = Path(__file__).resolve().parent
CACHE_DIR = ROOT / ".cache"
SHIM_DIR = ROOT / "shim"
INCLUDE_DIR = ROOT / "include"
RUNTIME_SRC = ROOT / "runtime" / "runtime.cpp"
CXX = os.environ.get("CXX", "g++")

KERNEL_FLAGS = (
    "-std=c++17",
    "-O2",
    "-g1",  # line tables only: lets reports name the faulting .metal line
    "-fPIC",
    "-fno-exceptions",
    "-fno-strict-aliasing",
    "-fwrapv",  # int arithmetic wraps, as a GPU's does: an overflowing index reads elsewhere
    "-ffp-contract=off",  # no fused multiply-add: results independent of -march
    "-fsingle-precision-constant",  # MSL literals like 0.5 are float, not double
    "-ftrivial-auto-var-init=pattern",  # uninitialised locals get a recognisable pattern
    "-fvisibility=hidden",
    "-Wall",
    "-Wno-unused-variable",
    "-Wno-unused-but-set-variable",
    "-Wno-unused-function",
    "-Wno-unknown-pragmas",
)
# Metal refuses a dispatch of more threads per threadgroup than a pipeline allows: 1024 on
# Apple GPUs at most (maxTotalThreadsPerThreadgroup; less for kernels heavy in registers).
MAX_THREADS_PER_THREADGROUP = 1024
RUNTIME_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-pthread", "-Wall")

SCHEDULE_CODES = {
    "forward": 0,
    "reverse": 1,
    "run_ahead": 2,
    "run_ahead_shuffled": 3,
    "random": 4,
}
#: Schedules every emulator test should run: round-robin both ways, run-ahead
#: (one simdgroup as far as it goes) in order and shuffled, and seeded random.
DEFAULT_SCHEDULES: tuple[str, ...] = (
    "forward",
    "reverse",
    "run_ahead",
    "run_ahead_shuffled:1",
    "random:1",
    "random:2",
)

_ERROR_KINDS = {1: "memory", 2: "barrier", 3: "simd", 4: "other"}


class EmulatorError(RuntimeError):
    """A kernel error reported by the emulator; ``str(e)`` is the full report."""


class OutOfBoundsError(EmulatorError):
    """Out-of-bounds access of a buffer or threadgroup array, stack overflow, other faults."""


class BarrierError(EmulatorError):
    """threadgroup_barrier misuse (return before a barrier, different barriers) or deadlock."""


class SimdError(EmulatorError):
    """Simd collective or simdgroup_matrix misuse (divergence, partial simdgroup)."""


class MetalCompileError(RuntimeError):
    """g++ rejected the translation unit; the message holds its diagnostics."""


class ScheduleMismatch(AssertionError):
    """Outputs differed between schedules: a race between synchronisation points."""


@dataclass(frozen=True)
class Out:
    """An output buffer: allocated with ``shape``/``dtype`` and pre-filled with NaN bytes."""

    shape: int | tuple[int, ...]
    dtype: Any = np.float32


@dataclass(frozen=True)
class Sparse:
    """An input buffer of ``nbytes`` bytes, zero but for ``data`` at byte ``offset``.

    The emulator maps it without reserving memory and copies only ``data`` in (and back), so
    a kernel can address a buffer larger than this machine's memory, as a KV pool past 2**31
    elements is, and read the few pages of it that hold the case's data."""

    nbytes: int
    offset: int
    data: np.ndarray

    # What a launch plan reads of its inputs (mlx_jit), as of an array of nbytes.
    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return self.nbytes // self.data.itemsize


class Outputs(dict):
    """Final buffer contents keyed by kernel parameter name; ``[int]`` looks up by buffer index."""

    def __init__(self, by_name: dict[str, np.ndarray], index_to_name: dict[int, str]):
        super().__init__(by_name)
        self._index_to_name = index_to_name

    def __getitem__(self, key: str | int) -> np.ndarray:
        if isinstance(key, int):
            key = self._index_to_name[key]
        return super().__getitem__(key)


class _MtlEmuBuffer(ctypes.Structure):
    _fields_ = [
        ("index", ctypes.c_int32),
        ("poison", ctypes.c_int32),
        ("name", ctypes.c_char_p),
        ("host", ctypes.c_void_p),
        ("size", ctypes.c_uint64),
        ("host_offset", ctypes.c_uint64),
        ("host_size", ctypes.c_uint64),
    ]


def float32_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) of float32 values, rounding to nearest even like the shim."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def bfloat16_to_float32(b: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bits (uint16)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# ------------------------------------------------------------------ building

_compiler_id: str | None = None


def _compiler_version() -> str:
    global _compiler_id
    if _compiler_id is None:
        out = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True)
        _compiler_id = out.stdout.splitlines()[0]
    return _compiler_id


def _hash(parts: Iterable[str | bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _run_compiler(cmd: Sequence[str], what: str) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if proc.returncode != 0:
        raise MetalCompileError(f"compiling {what} failed:\n{proc.stderr}")


def _atomic_build(target: Path, build: Callable[[Path], None]) -> Path:
    """Builds into a temporary file next to ``target`` and renames it into place."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        build(Path(tmp))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _shim_files() -> list[Path]:
    return sorted(p for d in (SHIM_DIR, INCLUDE_DIR) for p in d.iterdir() if p.is_file())


def _runtime_object(context: str) -> Path:
    flags = list(RUNTIME_FLAGS) + (["-DMTL_EMU_UCONTEXT"] if context == "ucontext" else [])
    key = _hash(
        [
            RUNTIME_SRC.read_bytes(),
            (SHIM_DIR / "emu_abi.h").read_bytes(),
            *flags,
            _compiler_version(),
        ]
    )
    target = CACHE_DIR / f"runtime-{key}.o"
    return _atomic_build(
        target,
        lambda tmp: _run_compiler(
            [CXX, *flags, "-c", str(RUNTIME_SRC), "-o", str(tmp)], "the emulator runtime"
        ),
    )


_loaded: dict[str, MetalLibrary] = {}


def compile_metal(
    path: str | Path,
    *,
    source: str | None = None,
    defines: Mapping[str, str | int | float] | None = None,
    context: str = "asm",
) -> MetalLibrary:
    """Compiles a .metal file (or ``source`` text reported as that file) for the emulator.

    ``defines`` become ``-D`` flags. ``context`` is "asm" (hand-written x86-64
    context switch, the default where available) or "ucontext" (portable
    swapcontext fallback). Results are cached on disk and in the process.
    """
    path = Path(path).resolve()
    text = path.read_text() if source is None else source
    src = parse_source(text, path)
    unit = prepass(src)
    flags = list(KERNEL_FLAGS)
    for k, v in sorted((defines or {}).items()):
        flags.append(f"-D{k}={v}")
    headers = local_includes(path, text)
    runtime = _runtime_object(context)
    key = _hash(
        [
            unit,
            *flags,
            *(p.read_bytes() for p in _shim_files()),
            *(str(p) + p.read_text() for p in headers),
            runtime.name,
            _compiler_version(),
        ]
    )
    if key in _loaded:
        return _loaded[key]
    build_dir = CACHE_DIR / key
    so = build_dir / "kernel.so"

    def build(tmp: Path) -> None:
        # A per-build file name: concurrent builds of the same key (pytest-xdist)
        # must not rewrite a source another compiler is reading.
        cpp = tmp.with_name(tmp.name + ".cpp")
        cpp.write_text(unit)
        try:
            _run_compiler(
                [
                    CXX,
                    *flags,
                    f"-I{SHIM_DIR}",
                    f"-I{INCLUDE_DIR}",
                    f"-I{path.parent}",
                    "-shared",
                    str(cpp),
                    str(runtime),
                    "-pthread",
                    "-o",
                    str(tmp),
                ],
                str(path),
            )
        finally:
            os.replace(cpp, build_dir / "kernel.cpp")  # kept for reading errors

    build_dir.mkdir(parents=True, exist_ok=True)
    _atomic_build(so, build)
    lib = MetalLibrary(path, so, src)
    _loaded[key] = lib
    return lib


# ------------------------------------------------------------------- running


def _dim3(v: int | Sequence[int]) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, int) else tuple(int(x) for x in v)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"expected 1 to 3 dimensions, got {v!r}")
    return (t + (1, 1))[:3]  # type: ignore[return-value]


def parse_schedule(schedule: str, seed: int = 0) -> tuple[int, int]:
    """``"random:7"`` -> (code, 7); a bare name uses ``seed``."""
    name, _, s = schedule.partition(":")
    if name not in SCHEDULE_CODES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {sorted(SCHEDULE_CODES)}")
    return SCHEDULE_CODES[name], int(s) if s else seed


class MetalLibrary:
    """A compiled .metal file: its kernels (entry points) and a way to run them."""

    def __init__(self, path: Path, so_path: Path, source: MetalSource):
        self.path = path
        self.so_path = so_path
        self.source = source
        self._lib = ctypes.CDLL(str(so_path), mode=os.RTLD_LOCAL)
        self._lib.mtl_emu_launch.restype = ctypes.c_int
        self._lib.mtl_emu_launch.argtypes = [
            ctypes.c_char_p,
            ctypes.POINTER(_MtlEmuBuffer),
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_uint32),
            ctypes.POINTER(ctypes.c_uint32),
            ctypes.POINTER(ctypes.c_uint32),
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.c_int,
            ctypes.c_uint32,
            ctypes.c_int,
        ]
        self._lib.mtl_emu_error.restype = ctypes.c_char_p
        self._lib.mtl_emu_kernel_name.restype = ctypes.c_char_p
        self._lib.mtl_emu_context_switch.restype = ctypes.c_char_p
        n = self._lib.mtl_emu_kernel_count()
        self.kernels: tuple[str, ...] = tuple(
            self._lib.mtl_emu_kernel_name(i).decode() for i in range(n)
        )
        self.context_switch: str = self._lib.mtl_emu_context_switch().decode()

    def params(self, kernel: str) -> list[Param]:
        """The parameters of entry point ``kernel`` as parsed from the source."""
        if kernel not in self.source.entries:
            raise KeyError(f"no kernel {kernel!r} in {self.path}; have {sorted(self.kernels)}")
        return self.source.entries[kernel][0].params

    def _pack_params(self, param: Param, value: Mapping[str, float | int]) -> np.ndarray:
        sname = param.struct_name
        struct = self.source.structs.get(sname or "")
        if struct is None:
            raise ValueError(
                f"buffer {param.name!r}: a dict needs a struct of 4-byte fields, "
                f"found {param.type!r}"
            )
        names = [n for _, n in struct.fields]
        missing = set(names) - set(value)
        extra = set(value) - set(names)
        if missing or extra:
            raise ValueError(
                f"{struct.name}: missing fields {sorted(missing)}, unknown fields {sorted(extra)}"
            )
        rec = np.zeros(1, dtype=[(n, four_byte_dtype(t)) for t, n in struct.fields])
        for n in names:
            rec[n] = value[n]
        return np.frombuffer(rec.tobytes(), dtype=np.uint8).copy()

    def run(
        self,
        kernel: str,
        buffers: Mapping[int | str, Any],
        *,
        grid: int | Sequence[int] | None = None,
        groups: int | Sequence[int] | None = None,
        threadgroup: int | Sequence[int] = 32,
        schedule: str = "forward",
        seed: int = 0,
        threadgroup_memory: Mapping[int, int] | None = None,
        workers: int = 1,
        stack_kb: int = 64,
        guard: str = "end",
    ) -> Outputs:
        """Runs entry point ``kernel`` once and returns all bound arrays' final contents.

        buffers: keys are buffer indices or parameter names; values are numpy
            arrays (copied in), ``Sparse`` buffers (their data copied in, returned
            as the data's final contents), ``Out(shape, dtype)`` (NaN-filled outputs),
            dicts (packed into the parameter's Params struct), bytes, or numpy
            scalars. Every ``[[buffer(n)]]`` parameter must be bound.
        grid / groups: threads per grid (dispatchThreads; trailing threadgroups
            may be partial) or threadgroups per grid (dispatchThreadgroups).
        schedule: a name from ``SCHEDULE_CODES``, optionally ``"name:seed"``.
        threadgroup_memory: bytes for each ``[[threadgroup(n)]]`` parameter.
        workers: OS threads running threadgroups in parallel (results do not
            depend on it: threadgroups never share memory in the subset).
        stack_kb: stack of each simulated GPU thread.
        guard: "end" puts each buffer's last byte against a guard region (the
            first read past the end faults); "start" puts its first byte
            against one (the first read before the start faults). Accesses
            further out fault either way (1 MiB guards).
        """
        if guard not in ("end", "start"):
            raise ValueError(f"guard must be 'end' or 'start', not {guard!r}")
        if (grid is None) == (groups is None):
            raise ValueError("pass exactly one of grid= (threads) or groups= (threadgroups)")
        if math.prod(_dim3(threadgroup)) > MAX_THREADS_PER_THREADGROUP:
            raise ValueError(f"{kernel}: a threadgroup of {_dim3(threadgroup)} threads is more "
                             f"than the {MAX_THREADS_PER_THREADGROUP} a Metal pipeline allows")
        params = self.params(kernel)
        by_index: dict[int, Param] = {}
        by_name: dict[str, Param] = {}
        for p in params:
            if p.buffer_index is not None:
                by_index[p.buffer_index] = p
                by_name[p.name] = p
        bound: dict[int, tuple[np.ndarray, bool, tuple[int, ...] | None]] = {}
        extent: dict[int, tuple[int, int]] = {}  # (bytes, offset of the host's) when sparse
        for key, value in buffers.items():
            p = by_index.get(key) if isinstance(key, int) else by_name.get(key)
            if p is None:
                raise KeyError(
                    f"{kernel}: no [[buffer]] parameter {key!r}; have "
                    + ", ".join(f"{i}:{q.name}" for i, q in sorted(by_index.items()))
                )
            idx = p.buffer_index
            assert idx is not None
            if idx in bound:
                raise KeyError(f"{kernel}: buffer {idx} ({p.name}) bound twice")
            if isinstance(value, Out):
                shape = (value.shape,) if isinstance(value.shape, int) else tuple(value.shape)
                arr = np.empty(shape, dtype=value.dtype)
                bound[idx] = (arr, True, shape)
            elif isinstance(value, Mapping):
                bound[idx] = (self._pack_params(p, value), False, None)
            elif isinstance(value, Sparse):
                arr = np.array(value.data, copy=True, order="C")
                if value.offset < 0 or value.offset + arr.nbytes > value.nbytes:
                    raise ValueError(f"{kernel}: {p.name}: the data of a Sparse buffer of "
                                     f"{value.nbytes} bytes must lie inside it")
                bound[idx] = (arr, False, arr.shape)
                extent[idx] = (value.nbytes, value.offset)
            elif isinstance(value, (bytes, bytearray)):
                bound[idx] = (np.frombuffer(bytes(value), dtype=np.uint8).copy(), False, None)
            else:
                arr = np.array(value, copy=True, order="C")
                bound[idx] = (arr, False, arr.shape)
        missing = sorted(set(by_index) - set(bound))
        if missing:
            raise KeyError(
                f"{kernel}: unbound buffers "
                + ", ".join(f"{i} ({by_index[i].name})" for i in missing)
            )

        descs = (_MtlEmuBuffer * max(1, len(bound)))()
        names = []
        for k, (idx, (arr, poison, _)) in enumerate(sorted(bound.items())):
            name = by_index[idx].name.encode()
            names.append(name)
            descs[k].index = idx
            descs[k].poison = 1 if poison else 0
            descs[k].name = name
            descs[k].host = arr.ctypes.data if arr.nbytes else None
            descs[k].size, descs[k].host_offset = extent.get(idx, (arr.nbytes, 0))
            descs[k].host_size = arr.nbytes
        tg_mem = (ctypes.c_uint32 * 32)()
        for i, nbytes in (threadgroup_memory or {}).items():
            tg_mem[i] = int(nbytes)
        code, seed = parse_schedule(schedule, seed)
        g = (ctypes.c_uint32 * 3)(*_dim3(grid if grid is not None else groups))  # type: ignore[arg-type]
        tg = (ctypes.c_uint32 * 3)(*_dim3(threadgroup))
        rc = self._lib.mtl_emu_launch(
            kernel.encode(),
            descs,
            len(bound),
            tg_mem,
            g,
            tg,
            1 if grid is not None else 0,
            code,
            seed,
            workers,
            stack_kb,
            1 if guard == "start" else 0,
        )
        if rc != 0:
            raise self._error(rc, self._lib.mtl_emu_error().decode(errors="replace"))
        result: dict[str, np.ndarray] = {}
        index_to_name: dict[int, str] = {}
        for idx, (arr, _, shape) in bound.items():
            if shape is None:
                continue
            result[by_index[idx].name] = arr
            index_to_name[idx] = by_index[idx].name
        return Outputs(result, index_to_name)

    def _error(self, code: int, report: str) -> EmulatorError:
        report = self._resolve_pcs(report)
        kind = _ERROR_KINDS.get(code, "other")
        cls = {
            "memory": OutOfBoundsError,
            "barrier": BarrierError,
            "simd": SimdError,
        }.get(kind, EmulatorError)
        return cls(report)

    def _resolve_pcs(self, report: str) -> str:
        """Replaces ``[pc lib+0x..]`` with the .metal file:line of that instruction."""

        def resolve(m: re.Match[str]) -> str:
            lib, off = m.group(1), m.group(2)
            try:
                out = subprocess.run(
                    ["addr2line", "-i", "-e", lib, off], capture_output=True, text=True, timeout=10
                ).stdout.split("\n")
            except (OSError, subprocess.SubprocessError):
                return m.group(0)
            lines = [s.split(" (discriminator")[0] for s in out if s.strip() and "??" not in s]
            ours = [s for s in lines if s.startswith(str(self.path))]
            best = ours[0] if ours else (lines[0] if lines else None)
            return f"\n  at {best}" if best else m.group(0)

        return re.sub(r" \[pc (\S+)\+(0x[0-9a-f]+)\]", resolve, report)


def run_schedules(
    lib: MetalLibrary,
    kernel: str,
    buffers: Mapping[int | str, Any],
    *,
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
    **launch: Any,
) -> Outputs:
    """Runs ``kernel`` under each schedule and requires bit-identical outputs.

    Returns the outputs of the first schedule. Raises ``ScheduleMismatch``
    naming the buffer and the schedules that disagree.
    """
    first: Outputs | None = None
    for sched in schedules:
        out = lib.run(kernel, buffers, schedule=sched, **launch)
        if first is None:
            first = out
            continue
        for name, arr in first.items():
            other = out[name]
            if arr.tobytes() != other.tobytes():
                diff = np.flatnonzero(
                    arr.view(np.uint8).reshape(-1) != other.view(np.uint8).reshape(-1)
                )
                raise ScheduleMismatch(
                    f"{kernel}: buffer {name!r} differs between schedules {schedules[0]!r} and "
                    f"{sched!r} ({diff.size} bytes differ, first at byte {diff[0]})"
                )
    assert first is not None
    return first
