"""The kernel that MLX's JIT builds for ``mx.fast.metal_kernel``, rebuilt for the emulator.

``metal_kernel(name, input_names, output_names, source, header)`` compiles neither
``source`` nor ``header`` as they are. When the returned function is called it writes a
``[[kernel]]`` function around ``source`` (``write_signature`` in
mlx/backend/common/metal_kernel.cpp, MLX 0.32):

* the header, then ``template <typename T, int N, bool B>`` for the template arguments;
* ``[[kernel]] void custom_kernel_<name>_<template hash>_<dtype of each array>(``;
* one parameter per input, in order: ``const device T* name [[buffer(i)]]``, or
  ``const constant T*`` when the array has fewer than 8 elements, ``&`` for a 0-d array,
  each followed by ``name_shape`` / ``name_strides`` / ``name_ndim`` buffers when the body
  mentions them;
* ``device T* name [[buffer(i)]]`` per output (``atomic<T>`` with ``atomic_outputs``);
* every thread-position attribute whose name occurs in the body, declared with that name
  (``uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]``);
* the body; then ``template [[host_name("...")]] [[kernel]] decltype(...) ...;``.

It dispatches ``grid`` threads (``dispatchThreads``) in threadgroups of
``min(threadgroup, grid)`` per dimension, outputs uninitialised unless ``init_value``.

``kernel_source`` writes the same text from a *launch plan* (a mapping holding the
arguments of ``metal_kernel`` and of the call: see ``PLAN_KEYS``), and ``run_plan``
compiles and runs it under the emulator, so a test runs exactly what an Apple GPU would.
``mlx_printed_source`` asks the installed MLX for its own text of a plan, on any machine:
a kernel called with ``verbose=True`` while ``mx.export_function`` traces it prints the
source it would compile, without compiling it, so a test can hold ``kernel_source`` to
MLX itself and see when a new MLX writes its kernels differently.
Not reproduced: MLX prepends its own ``utils.h`` (the shim provides the types it defines,
such as ``float16_t`` and ``bfloat16_t``) and Metal's math mode.

On a Mac, ``run_on_metal`` runs a plan on the GPU through ``mx.fast.metal_kernel`` itself,
and ``pipeline_thread_limit`` reads the most threads a threadgroup of the plan's compiled
pipeline may have (Metal's ``maxTotalThreadsPerThreadgroup``, which depends on the kernel's
registers and is known only once a device has built it): MLX's Python API does not expose
it, but MLX refuses, before dispatching anything, a threadgroup larger than it and names it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .harness import DEFAULT_SCHEDULES, Out, Outputs, Sparse, compile_metal, run_schedules

__all__ = ["PLAN_KEYS", "MetalRunError", "kernel_name", "kernel_source", "mlx_printed_source",
           "pipeline_thread_limit", "run_on_metal", "run_plan", "type_string"]

#: What a launch plan holds (extra keys are ignored).
PLAN_KEYS = (
    "name", "input_names", "output_names", "source", "header", "ensure_row_contiguous",
    "atomic_outputs", "inputs", "output_shapes", "output_dtypes", "grid", "threadgroup",
    "template_args",
)  # fmt: skip

#: Inputs with fewer elements are passed in the `constant` address space.
MAX_CONSTANT_ARRAY_SIZE = 8

#: Thread-position attributes MLX declares when the body names them, in its order.
ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

# MLX's get_type_string, keyed by dtype name, with the numpy dtype the emulator uses.
_TYPES = {
    "bool": ("bool", np.bool_),
    "uint8": ("uint8_t", np.uint8),
    "uint16": ("uint16_t", np.uint16),
    "uint32": ("uint32_t", np.uint32),
    "uint64": ("uint64_t", np.uint64),
    "int8": ("int8_t", np.int8),
    "int16": ("int16_t", np.int16),
    "int32": ("int32_t", np.int32),
    "int64": ("int64_t", np.int64),
    "float16": ("float16_t", np.float16),
    "bfloat16": ("bfloat16_t", np.uint16),  # bfloat16 travels as its bits
    "float32": ("float", np.float32),
}


def _dtype_name(dtype: Any) -> str:
    """"float32" for mx.float32 ("mlx.core.float32"), np.float32 or "float32"."""
    name = str(np.dtype(dtype)) if isinstance(dtype, type) else str(dtype)
    return name.rsplit(".", 1)[-1]


def type_string(dtype: Any) -> str:
    """The MSL type MLX writes for ``dtype`` (an MLX or numpy dtype)."""
    name = _dtype_name(dtype)
    if name not in _TYPES:
        raise ValueError(f"no Metal type for dtype {dtype!r}")
    return _TYPES[name][0]


def _template_def(template_args: Sequence[tuple[str, Any]]) -> str:
    def value(arg: Any) -> str:
        if isinstance(arg, bool):
            return str(int(arg))  # written with ostream <<, without boolalpha
        if isinstance(arg, int):
            return str(arg)
        return type_string(arg)

    return "<" + ", ".join(value(arg) for _, arg in template_args) + ">"


def _template_hash(template_def: str) -> str:
    out, i = [], 0
    while i < len(template_def):
        c = template_def[i]
        if c in "<>":
            out.append("_")
        elif c == "," and template_def[i + 1 : i + 2] == " ":
            out.append("_")
            i += 1
        else:
            out.append(c)
        i += 1
    return "".join(out)[:-1]


def kernel_name(plan: Mapping[str, Any]) -> str:
    """The host name MLX gives the kernel of this launch."""
    name = "custom_kernel_" + plan["name"]
    if plan["template_args"]:
        name += "_" + _template_hash(_template_def(plan["template_args"]))
    for a in plan["inputs"]:
        name += "_" + type_string(a.dtype)
        if a.ndim == 0:
            name += "s"
        elif a.size < MAX_CONSTANT_ARRAY_SIZE:
            name += "c"
    for dtype in plan["output_dtypes"]:
        name += "_" + type_string(dtype)
    return name


def _signature(plan: Mapping[str, Any], name: str) -> str:
    source, inputs = plan["source"], plan["inputs"]
    lines = []
    if plan["template_args"]:
        kinds = []
        for arg_name, arg in plan["template_args"]:
            if isinstance(arg, bool):
                kinds.append(f"bool {arg_name}")
            else:
                kinds.append(f"{'int' if isinstance(arg, int) else 'typename'} {arg_name}")
        lines.append("template <" + ", ".join(kinds) + ">\n")
    lines.append(f"[[kernel]] void {name}(\n")
    index = 0
    for arg_name, a in zip(plan["input_names"], inputs, strict=True):
        space = "constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if a.ndim == 0 else "*"
        decl = f"const {space} {type_string(a.dtype)}{ref}"
        lines.append(f"  {decl} {arg_name} [[buffer({index})]],\n")
        index += 1
        if a.ndim > 0:
            for suffix, decl in (("_shape", "const constant int*"),
                                 ("_strides", "const constant int64_t*"),
                                 ("_ndim", "const constant int&")):  # fmt: skip
                if arg_name + suffix in source:
                    lines.append(f"  {decl} {arg_name}{suffix} [[buffer({index})]],\n")
                    index += 1
    attributes = [f"  {t} {attr} [[{attr}]]" for attr, t in ATTRIBUTES if attr in source]
    outputs = list(zip(plan["output_names"], plan["output_dtypes"], strict=True))
    for arg_name, dtype in outputs:
        t = type_string(dtype)
        t = f"atomic<{t}>" if plan["atomic_outputs"] else t
        last = not (index < len(inputs) + len(outputs) - 1 or attributes)
        lines.append(f"  device {t}* {arg_name} [[buffer({index})]]" + (") {\n" if last else ",\n"))
        index += 1
    for i, attr in enumerate(attributes):
        lines.append(attr + (") {\n" if i == len(attributes) - 1 else ",\n"))
    return "".join(lines) + source + "\n}\n"


def kernel_source(plan: Mapping[str, Any]) -> tuple[str, str]:
    """(host name, full source) of the kernel MLX compiles for this launch plan."""
    name = kernel_name(plan)
    text = plan["header"] + _signature(plan, name)
    if plan["template_args"]:
        target = name + _template_def(plan["template_args"])
        text += f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({target}) {target};\n'
    return name, text


def _host_array(a: Any) -> np.ndarray | Sparse:
    if isinstance(a, Sparse):  # a test's stand-in for an array too large to hold
        return a
    if _dtype_name(a.dtype) == "bfloat16":
        import mlx.core as mx  # only MLX can read its bfloat16 arrays

        return np.array(a.view(mx.uint16))
    return np.array(a)


def run_plan(
    plan: Mapping[str, Any],
    path: str | Path,
    *,
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
    **launch: Any,
) -> Outputs:
    """Compile the kernel of ``plan`` as MLX would and run it under every schedule.

    ``path`` is the file the header is reported as (and local includes resolve against).
    Outputs must be bit-identical across schedules; returns them by output name (bfloat16
    as uint16 bits). ``launch`` goes to ``MetalLibrary.run`` (``guard=``, ``workers=``).
    """
    name, text = kernel_source(plan)
    # A #line after the header points reports about the generated signature at it.
    header = plan["header"]
    text = header + '\n#line 1 "<mx.fast.metal_kernel signature>"\n' + text[len(header) :]
    lib = compile_metal(path, source=text)
    buffers: dict[str | int, Any] = {}
    for arg_name, a in zip(plan["input_names"], plan["inputs"], strict=True):
        host = buffers[arg_name] = _host_array(a)  # row-contiguous, as ensure_row_contiguous
        if isinstance(host, Sparse):
            if any(arg_name + suffix in plan["source"] for suffix in ("_shape", "_strides")):
                raise ValueError(f"{arg_name}: a Sparse input has no shape to pass the kernel")
        elif host.ndim:  # the shape buffers MLX adds when the body names them
            strides = np.cumprod((host.shape[1:] + (1,))[::-1])[::-1]
            extra = {"_shape": np.array(host.shape, np.int32),
                     "_strides": np.array(strides, np.int64),
                     "_ndim": np.array([host.ndim], np.int32)}  # fmt: skip
            for suffix, value in extra.items():
                if arg_name + suffix in plan["source"]:
                    buffers[arg_name + suffix] = value
    for arg_name, shape, dtype in zip(
        plan["output_names"], plan["output_shapes"], plan["output_dtypes"], strict=True
    ):
        buffers[arg_name] = Out(tuple(shape), _TYPES[_dtype_name(dtype)][1])
    grid = tuple(plan["grid"])
    threadgroup = tuple(min(t, g) for t, g in zip(plan["threadgroup"], grid, strict=True))
    out = run_schedules(
        lib, name, buffers, schedules=schedules, grid=grid, threadgroup=threadgroup, **launch
    )
    return Outputs({n: out[n] for n in plan["output_names"]}, {})


# A plan's kernel in a fresh interpreter, from its JSON spec (_spec) on stdin: MLX prints
# from C++ (std::cout), which only a child process's captured stdout sees whole, and an
# error in MLX's evaluation leaves nothing behind in the caller's MLX.
_KERNEL = """
import json, sys, tempfile
import mlx.core as mx
import numpy as np
spec = json.load(sys.stdin)
dtype = lambda name: getattr(mx, name)
kernel = mx.fast.metal_kernel(
    name=spec["name"], input_names=spec["input_names"], output_names=spec["output_names"],
    source=spec["source"], header=spec["header"],
    ensure_row_contiguous=spec["ensure_row_contiguous"], atomic_outputs=spec["atomic_outputs"])
template = [(n, dtype(v) if kind == "dtype" else v) for n, kind, v in spec["template_args"]]
def call(arrays, **options):
    return kernel(inputs=list(arrays), template=template, grid=tuple(spec["grid"]),
                  threadgroup=tuple(spec["threadgroup"]),
                  output_shapes=[tuple(s) for s in spec["output_shapes"]],
                  output_dtypes=[dtype(d) for d in spec["output_dtypes"]], **options)
print("<<<")
"""

# Prints the source MLX writes: a kernel called with verbose=True while mx.export_function
# traces it prints the text without compiling it.
_PRINT_SOURCE = _KERNEL + """
inputs = [mx.zeros(shape, dtype=dtype(name)) for shape, name, *_ in spec["inputs"]]
def launch(*arrays):
    return call(arrays, verbose=True)
with tempfile.TemporaryDirectory() as d:
    mx.export_function(d + "/kernel.mlxfn", launch, *inputs)
"""

# Runs the kernel on the GPU; prints its outputs (as float32) or the error MLX raised.
_RUN = _KERNEL + """
def host(values, shape, name):
    kind = np.float32 if mx.issubdtype(dtype(name), mx.floating) else np.int64
    return mx.array(np.array(values, kind).reshape(shape)).astype(dtype(name))
inputs = [host(values, shape, name) for shape, name, values in spec["inputs"]]
try:
    outputs = call(inputs, stream=mx.gpu)
    mx.eval(outputs)
except Exception as error:  # reported to the caller as MLX worded it
    json.dump({"error": f"{type(error).__name__}: {error}"}, sys.stdout)
else:
    json.dump({"outputs": [o.astype(mx.float32).tolist() for o in outputs]}, sys.stdout)
"""


def _template_kind(arg: Any) -> list[Any]:
    if isinstance(arg, bool):
        return ["bool", arg]
    if isinstance(arg, int):
        return ["int", arg]
    return ["dtype", _dtype_name(arg)]


def _input_values(a: Any) -> Any:
    """An input's elements as nested lists (bfloat16 through float32, exactly)."""
    if _dtype_name(a.dtype) == "bfloat16":
        import mlx.core as mx

        a = a.astype(mx.float32)
    return np.array(a).tolist()


def _spec(plan: Mapping[str, Any], *, values: bool) -> dict[str, Any]:
    """The plan as JSON for _KERNEL; ``values``: with the inputs' elements, not only their
    shapes and dtypes."""
    spec = {key: plan[key] for key in ("name", "input_names", "output_names", "source",
                                       "header", "ensure_row_contiguous", "atomic_outputs")}
    spec["inputs"] = [[list(a.shape), _dtype_name(a.dtype), *([_input_values(a)] if values else [])]
                      for a in plan["inputs"]]
    spec["output_shapes"] = [list(s) for s in plan["output_shapes"]]
    spec["output_dtypes"] = [_dtype_name(d) for d in plan["output_dtypes"]]
    spec["grid"], spec["threadgroup"] = list(plan["grid"]), list(plan["threadgroup"])
    spec["template_args"] = [[n, *_template_kind(v)] for n, v in plan["template_args"]]
    return spec


def _run_child(script: str, spec: dict[str, Any], what: str) -> str:
    """What ``script`` prints after its marker, given ``spec``."""
    run = subprocess.run([sys.executable, "-c", script], input=json.dumps(spec),
                         capture_output=True, text=True, timeout=120)
    if run.returncode:
        raise RuntimeError(f"MLX did not {what}: {run.stderr[-2000:]}")
    return run.stdout.split("<<<\n", 1)[-1]


def mlx_printed_source(plan: Mapping[str, Any]) -> str:
    """The ``[[kernel]]`` source the installed MLX writes for ``plan``, as it prints it."""
    printed = _run_child(_PRINT_SOURCE, _spec(plan, values=False), "print the kernel's source")
    start = printed.find("```\n")
    end = printed.rfind("\n```")
    if start < 0 or end <= start:
        raise RuntimeError(f"MLX printed no kernel source: {printed[:500]!r}")
    return printed[start + 4 : end]


class MetalRunError(RuntimeError):
    """What MLX raised for a plan it would not or could not run on this GPU."""


def run_on_metal(
    plan: Mapping[str, Any], *, threadgroup: tuple[int, int, int] | None = None
) -> list[np.ndarray]:
    """The plan's outputs (as float32) computed on this machine's Metal GPU by
    ``mx.fast.metal_kernel``, in a fresh interpreter; ``threadgroup`` replaces the plan's.
    Raises MetalRunError with MLX's message where MLX refuses the launch or the device
    fails it."""
    spec = _spec(plan, values=True)
    if threadgroup is not None:
        spec["threadgroup"] = list(threadgroup)
    result = json.loads(_run_child(_RUN, spec, "run the kernel"))
    if "error" in result:
        raise MetalRunError(result["error"])
    return [np.array(out, np.float32).reshape(shape)
            for out, shape in zip(result["outputs"], plan["output_shapes"], strict=True)]


#: The most threads a Metal threadgroup may have, on every device (Apple's feature set
#: tables); a pipeline may allow fewer.
METAL_MAX_THREADS = 1024

# MLX's refusal (CustomKernel::eval_gpu, mlx/backend/metal/custom_kernel.cpp, MLX 0.32).
_REFUSAL = re.compile(r"maximum allowed threads per threadgroup \((\d+)\)")


def pipeline_thread_limit(plan: Mapping[str, Any]) -> int:
    """The most threads a threadgroup of the plan's compiled pipeline may have on this GPU
    (``maxTotalThreadsPerThreadgroup``). Asked with a threadgroup one simdgroup larger than
    any Metal device takes, MLX refuses the launch, before dispatching it, naming the limit.
    Raises RuntimeError if MLX does not refuse: then a pipeline limit under a plan's
    threadgroup would not be refused either."""
    oversized = (METAL_MAX_THREADS + 32, 1, 1)
    try:
        run_on_metal(plan, threadgroup=oversized)
    except MetalRunError as error:
        limit = _REFUSAL.search(str(error))
        if limit is None:
            raise
        return int(limit.group(1))
    raise RuntimeError(f"MLX launched {oversized[0]} threads per threadgroup without refusing "
                       "them: it would not refuse a pipeline's smaller limit either")
