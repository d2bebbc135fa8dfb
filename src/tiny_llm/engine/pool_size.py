"""The size of the engine's KV pool, decided once at its build: how many pages the memory
holds (``pool_pages``), by the rule every rank applies to its own machine (at most
``MAX_POOL_FRACTION`` of the memory available once the model is loaded).
"""

from __future__ import annotations

import logging
import os
import sys

from tiny_llm.day3_paged_kv import blocks_needed

import mlx.core as mx

log = logging.getLogger("tiny_llm")


# ANCHOR: pool_size
MAX_POOL_FRACTION = 0.9  # of the memory available when the engine starts


def kv_bytes_per_token(config, dtype: mx.Dtype) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.size


def available_memory() -> int:
    """Bytes the pool may come from: on Apple silicon the GPU's recommended working set less
    what MLX already holds (the model's weights), else the memory the OS reports available
    once the model is loaded (physical memory where it reports none)."""
    if mx.default_device() == mx.gpu:
        working_set = int(mx.device_info()["max_recommended_working_set_size"])
        return max(0, working_set - mx.get_active_memory())
    if sys.platform.startswith("linux"):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pool_pages(config, dtype: mx.Dtype, page_size: int, max_model_len: int, max_num_seqs: int,
               kv_memory_bytes: int | None = None, kv_memory_fraction: float | None = None,
               num_pages: int | None = None, available: int | None = None) -> int:
    """Pages in the pool: ``num_pages``, or as many as ``kv_memory_bytes`` (bytes) or
    ``kv_memory_fraction`` (of available memory) hold; by default enough for every slot at
    ``max_model_len``, capped at a tenth of available memory. An explicit size beyond
    ``MAX_POOL_FRACTION`` of available memory is refused before anything is allocated."""
    page_bytes = kv_bytes_per_token(config, dtype) * page_size
    available = available_memory() if available is None else available
    limit = int(available * MAX_POOL_FRACTION)
    if num_pages is None and kv_memory_bytes is None and kv_memory_fraction is None:
        wanted = blocks_needed(max_model_len, page_size) * max_num_seqs
        return max(1, min(wanted, available // 10 // page_bytes))
    if num_pages is not None:
        asked, what = num_pages * page_bytes, f"num_pages={num_pages}"
    elif kv_memory_bytes is not None:
        asked, what = kv_memory_bytes, f"kv_memory_bytes={kv_memory_bytes}"
    else:
        asked = int(kv_memory_fraction * available)
        what = f"kv_memory_fraction={kv_memory_fraction}"
    pages = num_pages if num_pages is not None else asked // page_bytes
    if pages < 1:
        raise ValueError(f"{what} holds no page of {page_bytes} bytes ({page_size} tokens)")
    if pages * page_bytes > limit:
        raise ValueError(
            f"{what} asks for a KV pool of {pages * page_bytes / 2**30:.2f} GiB "
            f"({pages} pages of {page_bytes} bytes), but this machine has "
            f"{available / 2**30:.2f} GiB available and the pool may take at most "
            f"{MAX_POOL_FRACTION:.0%} of it"
        )
    return pages
# ANCHOR_END: pool_size


def log_pool(num_pages: int, page_size: int, page_bytes: int, max_model_len: int) -> None:
    tokens = num_pages * page_size
    log.info(
        "KV pool: %d pages x %d tokens = %d tokens (%.1f MiB); maximum concurrency at "
        "max_model_len=%d: %.2fx",
        num_pages, page_size, tokens, num_pages * page_bytes / 2**20, max_model_len,
        tokens / max_model_len,
    )


def check_worker_pool(num_pages: int, page_bytes: int) -> None:
    """On a worker, before its page pool is allocated: refuse rank 0's page count where this
    machine's memory cannot hold it, by the rule rank 0 sized its own pool by
    (``pool_pages``: at most ``MAX_POOL_FRACTION`` of the memory available)."""
    need, available = num_pages * page_bytes, available_memory()
    if need > int(available * MAX_POOL_FRACTION):
        raise ValueError(
            f"rank 0's KV pool of {num_pages} pages of {page_bytes} bytes "
            f"({need / 2**30:.2f} GiB) does not fit in this rank's memory: its machine has "
            f"{available / 2**30:.2f} GiB available and the pool may take at most "
            f"{MAX_POOL_FRACTION:.0%} of it; give rank 0 a smaller pool (--num-pages, "
            f"--kv-memory-bytes or --kv-memory-fraction)")
