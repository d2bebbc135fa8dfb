"""Tests by device: what holds only on a CPU, and the GPU's decisions rehearsed on Linux.

A test of a CPU-only path (the CPU kernels, a course task's C++) runs with the CPU as MLX's
device (the ``cpu_device`` fixture), so on a Mac it still runs, on the Mac's CPU, and in the
GPU rehearsal (``tiny_llm.kernels.device``) it runs as in the main pass. A test of the GPU's
decisions takes ``gpu_decisions``: the GPU's own on a Mac, rehearsed on the CPU elsewhere.
"""

from collections.abc import Iterator

from tiny_llm.kernels.device import planning_for_cpu, rehearsing_gpu, set_gpu_rehearsal

import mlx.core as mx
import pytest


@pytest.fixture
def cpu_device() -> Iterator[None]:
    """Plan for and compute on the CPU for one test
    (``tiny_llm.kernels.device.planning_for_cpu``)."""
    with planning_for_cpu():
        yield


@pytest.fixture
def gpu_decisions() -> Iterator[None]:
    """The GPU's decisions for one test: a Mac's GPU as it is, elsewhere the rehearsal."""
    if mx.default_device().type == mx.DeviceType.gpu:
        yield
        return
    was = rehearsing_gpu()
    set_gpu_rehearsal(True)
    try:
        yield
    finally:
        set_gpu_rehearsal(was)
