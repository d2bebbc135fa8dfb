"""The device the engine plans for, and the GPU rehearsal.

MLX computes on its default device: the GPU on a Mac, the CPU elsewhere. What depends on the
device asks ``plans_for_gpu()``: the dtype a checkpoint loads in, the Metal launcher's
geometry rules and launch plan, MLX's scatter as the KV write, and the paths that exist only
on a CPU (the extension's matmuls and fused layers, OpenBLAS, the in-place KV write, int8
activations).

The GPU rehearsal (``TINY_LLM_GPU_REHEARSAL=1`` in the environment, ``pytest --gpu-rehearsal``,
or ``set_gpu_rehearsal(True)``) makes every one of those decisions take the GPU's branch while
MLX still computes on the CPU: a Linux machine runs what a Mac decides, and a test that cannot
hold on a GPU fails here as it would there. What it cannot rehearse is the GPU's arithmetic:
the Metal kernels themselves run under the emulator (``tests/test_metal_kernels.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

REHEARSAL_ENV = "TINY_LLM_GPU_REHEARSAL"
_rehearsal = os.environ.get(REHEARSAL_ENV, "") == "1"


def rehearsing_gpu() -> bool:
    """Whether the GPU rehearsal is on (and MLX computes on the CPU)."""
    return _rehearsal and mx.default_device().type == mx.DeviceType.cpu


def plans_for_gpu() -> bool:
    """Whether the engine takes the GPU's decisions: on a GPU, or in the rehearsal."""
    return mx.default_device().type == mx.DeviceType.gpu or rehearsing_gpu()


def planned_device() -> mx.Device:
    """The device the engine plans for: the GPU in the rehearsal, else MLX's default."""
    return mx.gpu if rehearsing_gpu() else mx.default_device()


def set_gpu_rehearsal(on: bool) -> None:
    """Turn the rehearsal on or off, here and in the processes this one starts (the
    extension's ops are told call by call)."""
    global _rehearsal
    _rehearsal = on
    os.environ[REHEARSAL_ENV] = "1" if on else "0"


@contextmanager
def planning_for_cpu() -> Iterator[None]:
    """Plan for and compute on the CPU, rehearsal or not (as a Mac does with
    ``mx.set_default_device(mx.cpu)``)."""
    device, rehearsal = mx.default_device(), _rehearsal
    mx.set_default_device(mx.cpu)
    set_gpu_rehearsal(False)
    try:
        yield
    finally:
        set_gpu_rehearsal(rehearsal)
        mx.set_default_device(device)
