"""Conventions and helpers shared by every measurement script in ``benches/``.

- Import this module (or ``tiny_llm``) before anything that imports ``mlx.core``: importing
  ``tiny_llm`` is what interposes OpenBLAS, and that only works before MLX is loaded.
- Every number a script reports is measured in the same run as what it is compared with,
  with warmup, repeats and medians (``measure``); ratios are reported, not absolute claims.
- ``save_results(name, data, tables, figure)`` writes ``benchmark_results/<name>.json`` (the
  data, the tables and the environment), ``<name>.md`` (the tables rendered from that JSON,
  which the book includes, so no number in the book is typed by hand) and ``<name>.png``.
- Every script takes ``--quick`` (a short smoke run on a tiny random model, written to
  ``<name>_quick.*``), ``--rounds N`` (interleaved rounds; at least 3 for the book's
  results, which record the median and the spread) and ``--learner`` (run on the course
  workspace's modules, see the book's setup chapter): ``bench_parser``.
- ``save_results`` records the commit and whether the tree was clean; the book's test
  refuses results from a modified tree or from fewer than 3 rounds (unless ``long=True``,
  for runs too slow to repeat, which the table then says).
- Shared pieces: ``load_model``, ``mlx_lm_model`` (mlx-lm's Llama on our arrays),
  ``greedy``, ``percentile``, ``Recorder`` (wall-clock token times per request), ``lap``
  (phase timings) and ``openblas_threads``.
- OpenBLAS threads: ``tiny_llm`` sets ``OPENBLAS_NUM_THREADS=1`` unless it is already set;
  ``environment()`` records the variable and the thread count OpenBLAS reports.
- The device: a script runs on MLX's default device (a Mac's GPU, elsewhere the CPU) and
  records it (``bench_device``); what exists only on one device is chosen by it and labelled
  by what ran: the extension's thread counts on the CPU, one GPU run on a GPU
  (``kernel_thread_counts``, ``threads_label``). A benchmark of the Linux CPU path itself
  (thread counts, OpenBLAS, the CPU kernels) calls ``use_cpu()``: the CPU, with OpenBLAS.
  Under the GPU rehearsal (``TINY_LLM_GPU_REHEARSAL=1``) the GPU's configurations run on the
  CPU and are labelled so: their times are not a GPU's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The learner switch must be set before any day's module is imported: scripts import this
# module before the engine, so --learner is read here, ahead of argparse.
if "--learner" in sys.argv:
    os.environ.setdefault("TINY_LLM_LEARNER", "1")

# tiny_llm interposes OpenBLAS on import; mlx.core is imported after it, inside functions,
# so that no import sorting can ever put MLX first.
from tiny_llm import (  # noqa: E402
    SamplingParams,  # noqa: E402
    learner,  # noqa: E402
    openblas_loaded,
    openblas_threads,
)

import numpy as np  # noqa: E402

if TYPE_CHECKING:
    from tiny_llm import LLMEngine, Model, RequestOutput, Tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
NOT_THIS_MACHINE = 3  # a script's exit status where it does not apply (use_cpu on a Mac)
_results_dir = REPO_ROOT / "benchmark_results"  # --results-dir changes it

if (_whose := learner.describe()) is not None:
    print(f"{Path(sys.argv[0]).name}: {_whose}", flush=True)


def results_dir() -> Path:
    _results_dir.mkdir(parents=True, exist_ok=True)
    return _results_dir


class _ResultsDir(argparse.Action):
    """``--results-dir DIR``: where ``save_results`` writes (the test suite's runs write into
    a temporary folder, never over the book's results)."""

    def __call__(self, parser, namespace, value, option_string=None):
        global _results_dir
        _results_dir = Path(value).resolve()
        setattr(namespace, self.dest, _results_dir)


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


def bench_parser(doc: str | None, rounds: int = 3) -> argparse.ArgumentParser:
    """The options every measurement script takes (see the module docstring)."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny random model, small workload")
    ap.add_argument("--rounds", type=int, default=rounds,
                    help=f"interleaved rounds, median reported (default {rounds})")
    ap.add_argument("--learner", action="store_true",
                    help="run on your course workspace's modules (TINY_LLM_LEARNER)")
    ap.add_argument("--results-dir", action=_ResultsDir, metavar="DIR",
                    help="write the results here instead of benchmark_results/")
    return ap


def bench_device() -> str:
    """What a script's times are of: "cpu", "gpu", or "gpu rehearsal" (the GPU's
    configurations run on the CPU: its decisions, not its speed)."""
    from tiny_llm import plans_for_gpu, rehearsing_gpu

    if rehearsing_gpu():
        return "gpu rehearsal"
    return "gpu" if plans_for_gpu() else "cpu"


def use_cpu() -> None:
    """Run this script on the CPU, whatever MLX's default device: for benchmarks of the
    Linux CPU path (the CPU kernels, OpenBLAS and its threads). They stop with a message
    where OpenBLAS is not interposed (a Mac: MLX's CPU matmuls go through Accelerate there),
    rather than label another BLAS's numbers as OpenBLAS's."""
    from tiny_llm import set_gpu_rehearsal

    import mlx.core as mx

    # TINY_LLM_NO_OPENBLAS=1: MLX's own BLAS on purpose (bench_model's configuration b).
    if not openblas_loaded() and os.environ.get("TINY_LLM_NO_OPENBLAS") != "1":
        print(f"{Path(sys.argv[0]).name} measures the Linux CPU path, MLX's matmuls through the "
              "OpenBLAS that make setup interposes, which this machine does not have",
              file=sys.stderr)
        raise SystemExit(NOT_THIS_MACHINE)
    mx.set_default_device(mx.cpu)
    set_gpu_rehearsal(False)


def kernel_thread_counts() -> list[int | None]:
    """The extension's thread counts a script compares: on the CPU its worker pool limited
    to 1 thread and every core; on a GPU one run (None), the GPU having no such setting."""
    if bench_device() == "cpu":
        return sorted({1, os.cpu_count() or 1})
    return [None]


def mlx_cpu_threads() -> int:
    """Threads MLX's own CPU ops use: its one stream thread, and OpenBLAS's threads in a
    matmul (where it is interposed)."""
    return (openblas_threads() or 1) if openblas_loaded() else 1


def gpu_words() -> str:
    """Where a GPU configuration ran, for a table's note."""
    if bench_device() == "gpu rehearsal":
        return ("on the CPU in the GPU rehearsal (the Metal launch plans made and checked, "
                "the CPU kernels computing: not a GPU's times)")
    return "on the GPU (the Metal kernels MLX's JIT compiles from the launch plans)"


def threads_label(threads: int | None) -> str:
    """"1 thread", "2 threads", or on a GPU what ran ("GPU", "GPU rehearsal")."""
    if threads is None:
        return "GPU rehearsal" if bench_device() == "gpu rehearsal" else "GPU"
    return f"{threads} thread{'s' if threads > 1 else ''}"


def with_threads(fn: Callable[[], Any], threads: int | None) -> Callable[[], Any]:
    """``fn`` evaluated with the kernel extension's worker pool limited to ``threads`` (the
    op reads the setting when it runs, so evaluate before restoring the default); None, on
    a GPU: ``fn`` evaluated as it is."""
    from tiny_llm import extension

    import mlx.core as mx

    def run():
        if threads is None:
            out = fn()
            mx.eval(out)
            return out
        ext = extension()
        ext.set_num_threads(threads)
        try:
            out = fn()
            mx.eval(out)
        finally:
            ext.set_num_threads(0)
        return out

    return run


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min, max and count of per-round values (what a table cell summarises)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": len(values), "values": values}


def lap(timings: dict[str, float], name: str, since: float) -> float:
    """Record (and print) the seconds since ``since`` as phase ``name``; returns now."""
    now = time.perf_counter()
    timings[name] = now - since
    print(f"[{name}: {now - since:.1f} s]", flush=True)
    return now


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


# ---------------------------------------------------------------- models


TINY_LLAMA = dict(
    model_type="llama", vocab_size=49152, hidden_size=64, num_hidden_layers=2,
    intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
    rope_theta=10000.0, max_position_embeddings=4096,
)


def load_model(quick: bool, **tiny: Any) -> tuple[Model, Tokenizer, str]:
    """The default model (SmolLM2-135M-Instruct, float32, on any device) or, with ``quick``, a
    random float32 Llama-shaped model (``TINY_LLAMA``, changed by ``tiny``, e.g.
    ``vocab_size=512``; built here, never downloaded) with the same tokenizer."""
    from tiny_llm import Model, ModelConfig, Tokenizer, default_model_path, load

    import mlx.core as mx
    from mlx.utils import tree_flatten

    if not quick:  # float32 on every device: the same weights mlx-lm's twin is given
        model, tokenizer = load(dtype="float32", dequantize=True)
        return model, tokenizer, "SmolLM2-135M-Instruct (float32)"
    _, meta = mx.load(str(default_model_path()), return_metadata=True)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    model = Model(ModelConfig.from_hf({**TINY_LLAMA, **tiny}))
    mx.random.seed(0)
    model.load_weights(
        [(k, 0.2 * mx.random.normal(v.shape)) for k, v in tree_flatten(model.parameters())]
    )
    mx.eval(model.parameters())
    return model, tokenizer, "tiny random llama (2 layers, hidden 64)"


def mlx_lm_model(model: Model) -> Any:
    """mlx-lm's ``llama.Model`` built from our config and loaded with the very arrays our
    model holds (same names and shapes, checked: ``strict``)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    c = model.config
    if c.model_type != "llama":
        raise ValueError(f"this builds mlx-lm's llama.Model, not {c.model_type!r}")
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position_embeddings,
        attention_bias=c.attention_bias,
        rope_theta=c.rope_theta,
        rope_traditional=c.rope_traditional,
        rope_scaling=c.rope_scaling,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    ref = llama.Model(args)
    ref.load_weights(list(tree_flatten(model.parameters())), strict=True)
    mx.eval(ref.parameters())
    return ref


# ---------------------------------------------------------------- machine and model bounds


def copy_bandwidth(mbytes: int = 256, repeats: int = 5) -> float:
    """Bytes read + written per second by a large numpy copy (median of repeats)."""
    src = np.ones(mbytes * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    timing = measure(lambda: np.copyto(dst, src), warmup=1, repeats=repeats)
    return 2 * src.nbytes / timing.median


class GemmProbe:
    """The model's matmuls alone: every linear layer at ``tokens`` rows and the (tied)
    vocabulary projection at ``logit_rows`` rows, on fresh random inputs, as an engine step
    runs them: by MLX's matmul, or with ``decode_rows`` (an engine with ``cpu_kernels``) the
    first ``decode_rows`` rows by the extension's decode kernel and the rest by its split
    BLAS (``tiny_llm/kernels/cpu_kernels.py``), a layer's q, k and v (and gate and up) in one
    call."""

    def __init__(self, model: Model):
        import mlx.nn as nn

        self.groups: list[list[Any]] = []  # weights multiplied in one call, as the model does
        for block in model.model.layers:
            attn, mlp = block.self_attn, block.mlp
            self.groups += [[attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                            [attn.o_proj.weight]]
            if hasattr(mlp, "gate_proj") and isinstance(mlp.gate_proj, nn.Linear):
                self.groups += [[mlp.gate_proj.weight, mlp.up_proj.weight],
                                [mlp.down_proj.weight]]
            else:  # a sparse MoE block: its linear layers one by one
                self.groups += [[m.weight] for _, m in mlp.named_modules()
                                if isinstance(m, nn.Linear)]
        self.lm_head = model.model.embed_tokens.weight if model.config.tie_word_embeddings \
            else model.lm_head.weight

    # Outputs held at once: a forward frees each layer's products as it goes, and MLX's CPU
    # allocator keeps 32 MB of freed buffers for reuse by default. Holding every layer's
    # products until one eval (130 MB at 178 rows) made each call take fresh pages from the
    # system, and fill them with zeros first: 11-12% of the products' time at 178 and 512
    # rows, enough to time them longer than the whole forward.
    HELD_BYTES = 16 << 20

    def time(self, tokens: int, logit_rows: int, decode_rows: int | None = None) -> float:
        from tiny_llm import KernelPlan, linear, linears

        import mlx.core as mx

        xs = {d: mx.random.normal((tokens, d)) for d in {g[0].shape[1] for g in self.groups}}
        x_lm = mx.random.normal((logit_rows, self.lm_head.shape[1]))
        mx.eval(xs, x_lm)
        kernels = None if decode_rows is None else KernelPlan(decode_rows)
        start = time.perf_counter()
        outs, held = [], 0
        for group in self.groups:
            outs.append(linears(xs[group[0].shape[1]], group, kernels))
            held += 4 * tokens * sum(w.shape[0] for w in group)
            if held >= self.HELD_BYTES:  # evaluate, and let the outputs go
                mx.eval(outs)
                outs, held = [], 0
        outs.append(linear(x_lm, self.lm_head, kernels))
        mx.eval(outs)
        return time.perf_counter() - start


# ---------------------------------------------------------------- requests


class TimedModel:
    """The engine's model, timing graph construction and evaluation separately. The
    logits depend on every layer's K/V writes, so evaluating them here runs the whole
    forward; the engine's own ``mx.eval`` afterwards finds nothing left to do."""

    def __init__(self, model: Model, times: dict[str, float]):
        self._model, self._times = model, times

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def hidden_states(self, *args: Any) -> Any:  # the runner's first call
        self._start = time.perf_counter()
        self._times["model_start"] = self._start
        return self._model.hidden_states(*args)

    def logits(self, *args: Any) -> Any:  # its second: the graph is then whole
        import mlx.core as mx

        logits = self._model.logits(*args)
        t1 = time.perf_counter()
        mx.eval(logits)
        t2 = time.perf_counter()
        self._times["graph"] += t1 - self._start
        self._times["eval"] += t2 - t1
        return logits


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy, exactly ``max_tokens`` new tokens (EOS ignored)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class Recorder:
    """Wall-clock arrival, token and finish times per request, taken around
    ``engine.step()``; plus, per step, which slot each token came from."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.arrival: dict[str, float] = {}
        self.token_times: dict[str, list[float]] = defaultdict(list)
        self.finish: dict[str, float] = {}
        self.slot: dict[str, int] = {}  # last known slot of each request (dense KV)
        self.step_slots: list[dict[int, str]] = []  # per step: slot -> request that got a token
        self.start: float | None = None
        self.end: float | None = None

    def add(self, prompt_ids: list[int], params: SamplingParams) -> str:
        now = time.perf_counter()
        rid = self.engine.add_request({"prompt_token_ids": prompt_ids}, params)
        self.arrival[rid] = now
        return rid

    def step(self) -> list[RequestOutput]:
        if self.start is None:
            self.start = time.perf_counter()
        outputs = self.engine.step()
        now = self.end = time.perf_counter()
        # A request admitted in this step is in slot_of now; one that finished in this step
        # left it, but its slot is known from an earlier step (every request decodes > 1 step).
        for request, slot in getattr(self.engine.kv, "slot_of", {}).items():
            self.slot[request.request_id] = slot
        slots = {}
        for out in outputs:
            if out.new_token_ids:
                self.token_times[out.request_id] += [now] * len(out.new_token_ids)
                if out.request_id in self.slot:
                    slots[self.slot[out.request_id]] = out.request_id
            if out.finished:
                self.finish[out.request_id] = now
        self.step_slots.append(slots)
        return outputs

    @property
    def wall(self) -> float:
        return self.end - self.start

    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_times.values())

    def ttft(self, rids: list[str] | None = None) -> list[float]:
        rids = self.arrival if rids is None else rids
        return [self.token_times[r][0] - self.arrival[r] for r in rids if self.token_times[r]]

    def latency(self) -> list[float]:
        return [self.finish[r] - self.arrival[r] for r in self.finish]


# ---------------------------------------------------------------- results


@dataclass
class Table:
    """A result table. ``formats[i]`` formats column ``i`` (e.g. ``".1f"``); ``""`` uses
    ``str``. Cells hold values, not text, so the JSON keeps the numbers."""

    title: str
    headers: list[str]
    rows: list[list[Any]]
    formats: list[str] = field(default_factory=list)
    note: str = ""


def goals_table(title: str, goals: list[tuple[str, str, bool]], note: str = "") -> Table:
    """A benchmark's targets as it measured them: (goal, what was measured, whether met)."""
    return Table(title=title, headers=["goal", "measured", "met"],
                 rows=[[goal, measured, "yes" if met else "no"] for goal, measured, met in goals],
                 note=note)


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
        "device": bench_device(),
        "device_name": (mx.device_info().get("device_name") if bench_device() == "gpu"
                        else platform.processor() or platform.machine()),
        "openblas_interposed": openblas_loaded(),
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "openblas_threads": openblas_threads(),  # what OpenBLAS reports now
        "git_commit": git("rev-parse", "--short", "HEAD"),
        # Results written by earlier runs are not code: they do not make a tree modified.
        "git_dirty": git("status", "--porcelain", "--untracked-files=no", "--", ".",
                         ":!benchmark_results") != "",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "learner": learner.describe(),  # None: the reference's code
    }


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    if fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, fmt)
    return str(value)


def render_markdown(result: dict[str, Any]) -> str:
    """The ``.md`` of a saved result, built only from its JSON (``save_results`` output).

    Each table sits between ``ANCHOR: table<i>`` comments (from 1), so that a chapter can
    include one table (``{{#include ../../benchmark_results/<name>.md:table2}}``)."""
    parts = []
    for i, t in enumerate(result["tables"], 1):
        formats = t["formats"] or [""] * len(t["headers"])
        lines = [f"<!-- ANCHOR: table{i} -->"]
        lines += [f"**{t['title']}**", ""] if t["title"] else []
        lines.append("| " + " | ".join(t["headers"]) + " |")
        lines.append("|" + "|".join("---" for _ in t["headers"]) + "|")
        for row in t["rows"]:
            cells = (_cell(v, f) for v, f in zip(row, formats, strict=True))
            lines.append("| " + " | ".join(cells) + " |")
        if t["note"]:
            lines += ["", t["note"]]
        lines.append(f"<!-- ANCHOR_END: table{i} -->")
        parts.append("\n".join(lines))
    env = result["environment"]
    # What reproduces the table: the command, its rounds and its commit. The machine is
    # described once, in the edition's table; the JSON keeps the rest of the environment.
    parts.append(
        f"<small>`{reproducing_command(env['command'])}` at commit {env['git_commit']}"
        f"{' (modified)' if env['git_dirty'] else ''}, median of {result.get('rounds', 1)} "
        f"rounds{' (a long run)' if result.get('long') else ''}, mlx {env['mlx_version']} "
        f"{_device_words(env)}.</small>"
    )
    return "\n\n".join(parts) + "\n"


def reproducing_command(command: str) -> str:
    """A recorded command as a reader types it in the repository: ``python`` and paths
    relative to it (a program outside it, such as llama.cpp's, by its file name)."""
    shown = ["python"]
    for word in command.split()[1:]:
        path = Path(word)
        if path.is_absolute() and path.is_relative_to(REPO_ROOT):
            word = str(path.relative_to(REPO_ROOT))
        elif path.is_absolute() and path.is_file() and os.access(path, os.X_OK):
            word = path.name
        shown.append(word)
    return " ".join(shown)


def _device_words(env: dict[str, Any]) -> str:
    device = env.get("device", "cpu")  # results from before the device was recorded: CPU
    if device == "gpu":
        return f"on the GPU ({env.get('device_name')})"
    words = "on the CPU, OpenBLAS interposed: " + ("yes" if env["openblas_interposed"] else "no")
    if device == "gpu rehearsal":
        words += ", in the GPU rehearsal (a GPU's configurations timed on the CPU)"
    return words


def save_results(name: str, data: dict[str, Any], tables: list[Table], figure: Any = None,
                 rounds: int = 1, long: bool = False) -> Path:
    """Write ``<name>.json``, ``<name>.md`` (from the JSON) and ``<name>.png`` (if a
    matplotlib ``figure`` is given) under ``benchmark_results/``; print the tables.
    ``rounds``: interleaved rounds behind each median; ``long``: a run too slow to repeat."""
    out = results_dir()
    result = {
        "name": name,
        "environment": environment(),
        "rounds": rounds,
        "long": long,
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
    shown = json_path.relative_to(REPO_ROOT) if json_path.is_relative_to(REPO_ROOT) else json_path
    print(f"wrote {shown} (+ .md{', .png' if figure else ''})")
    return json_path
