"""Shared test setup: tiny_llm must be imported before mlx.core (it interposes OpenBLAS)."""

import tiny_llm  # noqa: F401  (side effect: loads the OpenBLAS shim first)
