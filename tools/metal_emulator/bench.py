"""Measures the emulator's cost per GPU thread per synchronisation point.

Run: ``.venv/bin/python tools/metal_emulator/bench.py`` (add ``--ucontext`` to
compare with the portable swapcontext fallback).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from metal_emulator import Out, compile_metal  # noqa: E402


def measure(context: str, kernel: str, threads: int, iters: int, groups: int) -> float:
    """Nanoseconds per thread per sync point for one launch configuration."""
    lib = compile_metal(Path(__file__).parent / "examples" / "sync_bench.metal", context=context)
    bufs = {0: Out(groups * threads), 1: {"iters": iters}}
    lib.run(kernel, bufs, groups=groups, threadgroup=threads)  # warm up
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        lib.run(kernel, bufs, groups=groups, threadgroup=threads)
        best = min(best, time.process_time() - t0)
    return best / (groups * threads * iters) * 1e9


def main() -> None:
    """Prints a table of ns/thread/sync for several threadgroup sizes."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ucontext", action="store_true", help="also measure the swapcontext fallback")
    args = ap.parse_args()
    contexts = ["asm", "ucontext"] if args.ucontext else ["asm"]
    print(f"{'context':10} {'kernel':14} {'threads':>8} {'ns/thread/sync':>15}")
    for context in contexts:
        for kernel in ("barrier_loop", "simd_loop"):
            for threads in (32, 128, 256, 1024):
                ns = measure(context, kernel, threads, iters=200, groups=8)
                print(f"{context:10} {kernel:14} {threads:>8} {ns:>15.1f}")


if __name__ == "__main__":
    main()
