"""Conventions shared by every measurement script in ``benches/``.

- Import this module (or ``tiny_llm``) before anything that imports ``mlx.core``: importing
  ``tiny_llm`` is what interposes OpenBLAS, and that only works before MLX is loaded.
- Every number a script reports is measured in the same run as what it is compared with,
  with warmup, repeats and medians (``measure``); ratios are reported, not absolute claims.
- ``save_results(name, data, tables, figure)`` writes ``benchmark_results/<name>.json`` (the
  data, the tables and the environment), ``<name>.md`` (the tables rendered from that JSON,
  which the book includes, so no number in the book is typed by hand) and ``<name>.png``.
- ``--quick`` (a short smoke run) and ``--repeats N`` are per-script options.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

# tiny_llm interposes OpenBLAS on import; mlx.core is imported after it, inside functions,
# so that no import sorting can ever put MLX first.
from tiny_llm.blas import openblas_loaded

REPO_ROOT = Path(__file__).resolve().parent.parent


def results_dir() -> Path:
    path = REPO_ROOT / "benchmark_results"
    path.mkdir(exist_ok=True)
    return path


# ANCHOR: measure
@dataclass
class Timing:
    median: float  # seconds
    min: float
    times: list[float]


def measure(fn: Callable[[], Any], warmup: int = 1, repeats: int = 5) -> Timing:
    """Time ``fn()`` ``repeats`` times after ``warmup`` calls; MLX results are evaluated
    inside the timed region (``mx.eval``), since MLX is lazy and would otherwise time
    only the graph construction."""
    import mlx.core as mx

    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return Timing(statistics.median(times), min(times), times)
# ANCHOR_END: measure


@dataclass
class Table:
    """A result table. ``formats[i]`` formats column ``i`` (e.g. ``".1f"``); ``""`` uses
    ``str``. Cells hold values, not text, so the JSON keeps the numbers."""

    title: str
    headers: list[str]
    rows: list[list[Any]]
    formats: list[str] = field(default_factory=list)
    note: str = ""


def environment() -> dict[str, Any]:
    import mlx.core as mx

    def git(*args: str) -> str:
        try:
            out = subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
            )
            return out.stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    try:
        mlx_version = version("mlx")
    except PackageNotFoundError:
        mlx_version = "unknown"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),  # other work on the machine skews numbers
        "python": platform.python_version(),
        "mlx_version": mlx_version,
        "mlx_device": str(mx.default_device()),
        "openblas_interposed": openblas_loaded(),
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "git_dirty": git("status", "--porcelain", "--untracked-files=no") != "",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    if fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, fmt)
    return str(value)


def render_markdown(result: dict[str, Any]) -> str:
    """The ``.md`` of a saved result, built only from its JSON (``save_results`` output)."""
    parts = []
    for t in result["tables"]:
        formats = t["formats"] or [""] * len(t["headers"])
        lines = [f"**{t['title']}**", ""] if t["title"] else []
        lines.append("| " + " | ".join(t["headers"]) + " |")
        lines.append("|" + "|".join("---" for _ in t["headers"]) + "|")
        for row in t["rows"]:
            cells = (_cell(v, f) for v, f in zip(row, formats, strict=True))
            lines.append("| " + " | ".join(cells) + " |")
        if t["note"]:
            lines += ["", t["note"]]
        parts.append("\n".join(lines))
    env = result["environment"]
    parts.append(
        f"<small>Measured {env['date']} on {env['platform']}, {env['cpu_count']} CPUs "
        f"(load average {env['load_avg_1m']}), "
        f"mlx {env['mlx_version']} ({env['mlx_device']}), "
        f"OpenBLAS interposed: {'yes' if env['openblas_interposed'] else 'no'}, "
        f"commit {env['git_commit']}{' (modified)' if env['git_dirty'] else ''}; "
        f"`{env['command']}`.</small>"
    )
    return "\n\n".join(parts) + "\n"


def save_results(name: str, data: dict[str, Any], tables: list[Table], figure: Any = None) -> Path:
    """Write ``<name>.json``, ``<name>.md`` (from the JSON) and ``<name>.png`` (if a
    matplotlib ``figure`` is given) under ``benchmark_results/``; print the tables."""
    out = results_dir()
    result = {
        "name": name,
        "environment": environment(),
        "data": data,
        "tables": [asdict(t) for t in tables],
    }
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    markdown = render_markdown(json.loads(json_path.read_text()))
    (out / f"{name}.md").write_text(markdown)
    if figure is not None:
        figure.savefig(out / f"{name}.png", dpi=120, bbox_inches="tight")
    print(markdown)
    print(f"wrote {json_path.relative_to(REPO_ROOT)} (+ .md{', .png' if figure else ''})")
    return json_path
