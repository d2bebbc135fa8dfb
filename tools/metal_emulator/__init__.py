"""CPU emulator for the project's Metal kernels (test-only; never imported by tiny_llm).

A ``.metal`` file in the project's MSL subset compiles unchanged as C++ through
a shim header and runs with one fiber per GPU thread, switching only at
barriers and simd collectives, under selectable thread schedules. See
README.md in this folder.
"""

from .harness import (
    DEFAULT_SCHEDULES,
    BarrierError,
    EmulatorError,
    MetalCompileError,
    MetalLibrary,
    Out,
    OutOfBoundsError,
    Outputs,
    ScheduleMismatch,
    SimdError,
    Sparse,
    bfloat16_to_float32,
    compile_metal,
    float32_to_bfloat16,
    run_schedules,
)
from .lint import lint_metal, lint_source
from .mlx_jit import (
    MetalRunError,
    kernel_source,
    mlx_printed_source,
    pipeline_thread_limit,
    run_on_metal,
    run_plan,
)
from .source import MetalSourceError

__all__ = [
    "DEFAULT_SCHEDULES",
    "BarrierError",
    "EmulatorError",
    "MetalCompileError",
    "MetalLibrary",
    "MetalRunError",
    "MetalSourceError",
    "OutOfBoundsError",
    "Out",
    "Outputs",
    "ScheduleMismatch",
    "SimdError",
    "Sparse",
    "bfloat16_to_float32",
    "compile_metal",
    "float32_to_bfloat16",
    "kernel_source",
    "mlx_printed_source",
    "lint_metal",
    "lint_source",
    "pipeline_thread_limit",
    "run_on_metal",
    "run_plan",
    "run_schedules",
]
