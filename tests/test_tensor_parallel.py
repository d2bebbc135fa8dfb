"""Tensor parallelism (``tiny_llm/tensor_parallel.py``), with real processes.

In one process: the shards' partial sums add up to the whole layer (dense, biased,
quantized, MoE with a shared expert), and geometries that do not divide are refused with
the valid sizes. With real ranks over the ring backend on 127.0.0.1 (``LocalRanks``, as
``mlx.launch`` starts them): a tiny model with 4 KV heads on 2 ranks serves a mixed batch
with chunked prefill, prefix hits and preemption with the single-process engine's greedy
tokens (log-probabilities within ``LOGPROB_ATOL``: the all-reduce adds in another order
than one matmul does), alone equals batched exactly, each rank's pool is half the bytes;
the default model on 3 ranks answers the OpenAI client through ``serve``; a killed worker
ends rank 0 with an error naming it and a stopped one with the step timeout's error, within
a bounded time; a failure on rank 0 in a step the workers have fails every later step;
rank 0's end ends the workers; bad options are refused on every rank; a worker refuses
rank 0's pool where its own memory cannot hold it.

The launch: the book's command (``tiny-llm launch``, 3 ranks of the chat) exits non-zero
when a worker is killed, with rank 0's own error; the launch exits with its ranks' status
and Ctrl-C ends them; rank 0 given SIGTERM reports a lost worker (a server after its
shutdown); a busy port and an unreachable or foreign address are named within seconds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tiny_llm.engine import LLMEngine
from tiny_llm.models.model import Attention
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.tensor_parallel import check_tensor_parallel, shard_linear, shard_model, valid_sizes
from tiny_llm.testing.models import make_repeater_model, make_tiny_model
from tiny_llm.testing.ranks import LocalRanks, RankPlace, free_ports, launched_ranks
from tiny_llm.testing.runs import workload

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent
BOOK = TESTS.parent / "book" / "src" / "tensor-parallel.md"
LOGPROB_ATOL = 1e-4
TINY = dict(num_attention_heads=8, num_key_value_heads=4, seed=3)  # 4 KV heads: 1, 2 or 4 ranks
OPTIONS = dict(num_pages=14, max_num_batched_tokens=32, max_num_seqs=8)  # chunks, preemption


def shards_of(n: int, **kw) -> list:
    models = [make_tiny_model(**kw) for _ in range(n)]
    for r, m in enumerate(models):
        shard_model(m, RankPlace(r, n))
    return models


@pytest.mark.task("8.1")
@pytest.mark.parametrize("family,kw", [
    ("qwen3", {}),
    ("qwen2", {}),  # q/k/v biases: column shards keep their slice of the bias
    ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64)),
])
def test_the_shards_partial_sums_add_up_to_the_whole_layer(family, kw):
    kw = dict(TINY, model_type=family, **kw)
    whole, shards = make_tiny_model(**kw), shards_of(2, **kw)
    x = mx.random.normal((7, whole.config.hidden_size), key=mx.random.key(1))
    positions = mx.arange(7)
    for i, block in enumerate(whole.model.layers):
        parts = [s.model.layers[i] for s in shards]
        attn = block.self_attn(x, positions, _cache(block.self_attn))
        split = sum(p.self_attn.module(x, positions, _cache(p.self_attn.module)) for p in parts)
        np.testing.assert_allclose(np.array(split), np.array(attn), atol=1e-4)
        ff = block.mlp(x)
        np.testing.assert_allclose(np.array(sum(p.mlp.module(x) for p in parts)), np.array(ff),
                                   atol=1e-4)
    assert shards[0].config.num_key_value_heads == 2
    assert shards[0].config.num_attention_heads == 4


def _cache(attn: Attention):
    from tiny_llm.step.dense_kv import DenseKVCache

    return DenseKVCache(attn.layer + 1)


@pytest.mark.task("8.1")
def test_quantized_layers_are_split_as_stored():
    """Packed words, scales and biases are sliced together: the row shards' products of a
    4-bit layer add up to the whole layer's, and a slice that would cut a group is refused."""
    layer = nn.QuantizedLinear(128, 48, bias=False, group_size=32, bits=4)
    x = mx.random.normal((3, 128), key=mx.random.key(2))
    parts = []
    for r in range(2):
        shard = nn.QuantizedLinear(128, 48, bias=False, group_size=32, bits=4)
        shard.update(layer.parameters())
        shard_linear(shard, "row", r, 2)
        parts.append(mx.quantized_matmul(x[:, r * 64:(r + 1) * 64], shard.weight, shard.scales,
                                         shard.biases, group_size=32, bits=4))
    np.testing.assert_allclose(np.array(parts[0] + parts[1]), np.array(layer(x)), atol=1e-4)
    whole = {k: np.array(v) for k, v in layer.parameters().items()}
    with pytest.raises(ValueError):
        shard_linear(layer, "row", 0, 8)  # 4 groups over 8 ranks: refused, nothing cut
    assert all(np.array_equal(np.array(v), whole[k]) for k, v in layer.parameters().items())


def test_a_geometry_that_does_not_divide_is_refused_with_the_valid_sizes():
    from tiny_llm.models.model import ModelConfig

    smollm2 = ModelConfig("llama", 576, 30, 1536, 9, 3, 49152)
    assert valid_sizes(smollm2) == [1, 3]
    with pytest.raises(ValueError, match=r"9 attention heads, 3 KV heads.*valid sizes: 1, 3"):
        check_tensor_parallel(smollm2, 2)
    check_tensor_parallel(smollm2, 3)


@pytest.mark.device_independent  # processes and sockets, not device decisions
def test_tensor_parallelism_outside_mlx_launch_says_how_to_start_it(smollm_tokenizer,
                                                                   monkeypatch):
    monkeypatch.delenv("MLX_RANK", raising=False)
    with pytest.raises(ValueError, match=r"tiny-llm launch -n 2 --"):
        LLMEngine(make_tiny_model(**TINY), smollm_tokenizer, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_cache='paged'"):
        LLMEngine(make_tiny_model(**TINY), smollm_tokenizer, tensor_parallel_size=2,
                  kv_cache="dense")


def test_rank_0_trusts_only_a_worker_that_names_itself_with_the_token():
    """A new connection at start-up: the right token and a worker's rank are accepted;
    garbage, JSON of another shape, a wrong token or rank 0's own rank are turned away."""
    import socket
    import struct

    from tiny_llm.distributed.ring import Channel, _hello

    def greet(payload: bytes | dict) -> int | None:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            theirs = socket.create_connection(listener.getsockname())
            ours, _ = listener.accept()
        with ours, theirs:
            if isinstance(payload, dict):
                Channel(theirs).send(payload)
            else:
                theirs.sendall(payload)
            theirs.shutdown(socket.SHUT_WR)
            return _hello(ours, "secret", 3)

    assert greet({"rank": 2, "token": "secret"}) == 2
    assert greet({"rank": 0, "token": "secret"}) is None
    assert greet({"rank": 1, "token": "guess"}) is None
    assert greet(b"GET / HTTP/1.1\r\n\r\n") is None
    body = b'{"rank": 1, "token": "secret"}'  # valid JSON, no array list
    assert greet(struct.pack("!QI", len(body), len(body)) + body) is None
    body = b"[1, 2]"
    assert greet(struct.pack("!QI", len(body), len(body)) + body) is None


# ------------------------------------------------------------------ real ranks

RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import test_tensor_parallel as t
    result = t.mixed_run(int(sys.argv[2]), sys.argv[4])
    if result is not None:
        json.dump(result, open(sys.argv[3], "w"))
""")


def tokenizer():
    from tiny_llm.models.loader import default_model_path
    from tiny_llm.models.tokenizer import Tokenizer

    _, meta = mx.load(str(default_model_path()), return_metadata=True)
    return Tokenizer.from_gguf_metadata(meta)


def mixed_run(tensor_parallel_size: int, variant: str = "float") -> dict:
    """The mixed batch (and two of its requests alone afterwards) on one engine; the
    record rank 0 returns (a worker never returns from the engine's constructor).
    ``variant``: float weights, 4-bit weights kept as stored, or n-gram speculation."""
    # The speculative run's model repeats its last token: text prompt lookup can predict.
    model = make_repeater_model() if variant == "speculative" else make_tiny_model(**TINY)
    if variant == "4-bit":
        nn.quantize(model, group_size=32, bits=4)
    # Drafts need pages beyond a request's own: the speculative run has room for them.
    options = (dict(OPTIONS, speculative="ngram", num_pages=64) if variant == "speculative"
               else OPTIONS)
    engine = LLMEngine(model, tokenizer(), tensor_parallel_size=tensor_parallel_size,
                       **options)
    prompts, params = workload(12, seed=5, shared_prefix=32, max_tokens=(4, 12), hi=40)
    logprobs = None if variant == "speculative" else 2  # a logprob request never drafts

    params = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True,
                             logprobs=logprobs) for p in params]
    outs = engine.generate(prompts, params, use_tqdm=False)
    alone = [engine.generate([prompts[i]], [params[i]], use_tqdm=False)[0] for i in (0, 7)]

    def record(out) -> dict:
        o = out.outputs[0]
        return {"tokens": o.token_ids, "logprobs": [lp.logprob for lp in o.logprobs or []]}

    workers = getattr(engine.runner, "workers", None)
    return {"batched": [record(o) for o in outs], "alone": [record(o) for o in alone],
            "stats": engine.stats(),
            "worker_kv_bytes": None if workers is None else workers.kv_cache_bytes}


@pytest.mark.task("8.3")
@pytest.mark.parametrize("variant", ["float", "4-bit", "speculative"])
def test_two_ranks_serve_a_mixed_batch_as_one_process_does(tmp_path, variant):
    """Chunked prefill, prefix hits and preemption (or n-gram drafts) on 2 ranks, float or
    4-bit weights: the single process's schedule and greedy tokens, log-probabilities
    within LOGPROB_ATOL; a request alone gets its batched tokens; half the pool bytes on
    every rank; the workers exit 0 when rank 0 ends."""
    ranks = LocalRanks(2, ["-c", RANK_SCRIPT, str(TESTS), "2", str(tmp_path / "tp.json"),
                           variant], tmp_path)
    single = mixed_run(1, variant)
    codes = ranks.wait(120)
    assert codes == [0, 0], ranks.output(0)[-3000:] + ranks.output(1)[-3000:]
    tp = json.loads((tmp_path / "tp.json").read_text())
    stats = single["stats"]
    if variant == "speculative":
        assert stats["num_draft_tokens"] > 0
    else:
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert {k: v for k, v in tp["stats"].items() if k != "kv_cache_bytes"} == {
        k: v for k, v in stats.items() if k != "kv_cache_bytes"}  # the same schedule
    for mine, theirs in zip(tp["batched"], single["batched"], strict=True):
        assert mine["tokens"] == theirs["tokens"]
        np.testing.assert_allclose(mine["logprobs"], theirs["logprobs"], atol=LOGPROB_ATOL)
    for alone, batched in zip(tp["alone"], [tp["batched"][0], tp["batched"][7]], strict=True):
        assert alone["tokens"] == batched["tokens"]  # prefill chunks differ: logprobs may move
        np.testing.assert_allclose(alone["logprobs"], batched["logprobs"], atol=LOGPROB_ATOL)
    assert tp["stats"]["kv_cache_bytes"] * 2 == stats["kv_cache_bytes"]
    assert tp["worker_kv_bytes"] == {"1": tp["stats"]["kv_cache_bytes"]}


ALL_REDUCE_SCRIPT = textwrap.dedent("""
    import json, sys
    import tiny_llm
    import mlx.core as mx
    from tiny_llm.tensor_parallel import all_reduce
    group = mx.distributed.init(strict=True, backend="ring")
    x = mx.random.normal((40, 96), key=mx.random.key(group.rank()))
    ours, ring = [], []
    for rows in (1, 3, 17, 40):
        ours.append(mx.array_equal(all_reduce(x[:rows], group)[:1], all_reduce(x, group)[:1]))
        ring.append(mx.array_equal(mx.distributed.all_sum(x[:rows], group=group)[:1],
                                   mx.distributed.all_sum(x, group=group)[:1]))
        mx.eval(ours, ring)  # every rank, in one order: collectives pair up across ranks
    every = mx.distributed.all_gather(all_reduce(x, group)[None], group=group)
    same = all(mx.array_equal(every[0], every[r]).item() for r in range(group.size()))
    xs = [mx.random.normal((40, 96), key=mx.random.key(r)) for r in range(group.size())]
    total = xs[0]
    for part in xs[1:]:
        total = total + part
    exact = mx.array_equal(all_reduce(x, group), total).item()
    if group.rank() == 0:
        json.dump({"ours": [a.item() for a in ours], "ring": [a.item() for a in ring],
                   "same_on_every_rank": same, "sum_in_rank_order": exact},
                  open(sys.argv[1], "w"))
""")


@pytest.mark.task("8.2")
def test_the_all_reduce_gives_a_row_the_same_bits_in_any_batch_on_every_rank(tmp_path):
    """On 3 ranks the all-reduce is the sum of the ranks' arrays added in rank order, a
    row's sum is the same bits whatever rows share the call, and the same on every rank;
    MLX's ring all_sum (the negative control) is not row-invariant."""
    ranks = LocalRanks(3, ["-c", ALL_REDUCE_SCRIPT, str(tmp_path / "r.json")], tmp_path)
    assert ranks.wait(60) == [0, 0, 0], ranks.output(0)[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["sum_in_rank_order"]
    assert result["ours"] == [True] * 4 and result["same_on_every_rank"]
    assert not all(result["ring"])


FAULT_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import test_tensor_parallel as t
    from tiny_llm.engine import LLMEngine
    from tiny_llm.sampling.sampler import SamplingParams
    engine = LLMEngine(t.make_tiny_model(**t.TINY), t.tokenizer(), tensor_parallel_size=2,
                       tensor_parallel_timeout=float(sys.argv[2]), num_pages=1024)
    print("serving", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    engine.generate([[1, 2, 3]] * 4, params, use_tqdm=False)
    print("finished?!", flush=True)
""")


def started(ranks: LocalRanks, marker: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while marker not in ranks.output(0):
        assert ranks.procs[0].poll() is None, ranks.output(0)[-3000:]
        assert time.monotonic() < deadline, "rank 0 did not start"
        time.sleep(0.1)
    time.sleep(0.5)  # into the steps


@pytest.mark.device_independent  # processes and sockets, not device decisions
@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_lost_worker_ends_rank_0_with_an_error_naming_it(tmp_path, fault):
    """SIGKILL: the ring breaks and rank 0's step fails naming rank 1. SIGSTOP: the step
    hangs in a collective and rank 0 exits once ``tensor_parallel_timeout`` (3 s) is up."""
    timeout = "30" if fault == "killed" else "3"  # a loss is found without the timeout
    ranks = LocalRanks(2, ["-c", FAULT_SCRIPT, str(TESTS), timeout], tmp_path)
    try:
        started(ranks, "serving")
        ranks.procs[1].send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        start = time.monotonic()
        code = ranks.procs[0].wait(30)
        took = time.monotonic() - start
    finally:
        ranks.kill()
    out = ranks.output(0)
    assert code != 0 and "finished?!" not in out
    if fault == "killed":
        assert "worker rank 1 has exited" in out, out[-3000:]
        assert took < 10
    else:
        assert "did not finish within 3 s" in out, out[-3000:]
        assert took < 10


@pytest.mark.device_independent  # processes and sockets, not device decisions
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_worker_ends_when_rank_0_dies(tmp_path, sig):
    """Rank 0 killed, or given SIGTERM with every worker alive (it ends by the signal, as
    without tensor parallelism): the worker exits 1."""
    ranks = LocalRanks(2, ["-c", FAULT_SCRIPT, str(TESTS), "30"], tmp_path)
    try:
        started(ranks, "serving")
        ranks.procs[0].send_signal(sig)
        code = ranks.procs[1].wait(20)
        assert ranks.procs[0].wait(20) == -sig
    finally:
        ranks.kill()
    out = ranks.output(1)
    assert code == 1 and ("rank 0 went away" in out or "a step failed" in out), out[-3000:]


SERVE_TINY_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import test_tensor_parallel as t
    from tiny_llm.engine import LLMEngine
    from tiny_llm.serving.app import serve
    engine = LLMEngine(t.make_tiny_model(**t.TINY), t.tokenizer(), tensor_parallel_size=2,
                       num_pages=64)
    serve(engine, "tiny", port=int(sys.argv[2]), shutdown_timeout=1.0)
""")


@pytest.mark.device_independent  # processes and sockets, not device decisions
def test_a_server_whose_worker_died_refuses_and_stops(tmp_path):
    """A worker killed while the server is idle: requests get a 503 naming it (or find the
    server gone), and rank 0 ends within a bounded time, saying why."""
    import openai

    port = free_ports(1)[0]
    ranks = LocalRanks(2, ["-c", SERVE_TINY_SCRIPT, str(TESTS), str(port)], tmp_path)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    try:
        _wait_healthy(client, ranks)
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=3).choices
        ranks.procs[1].kill()
        with pytest.raises((openai.APIStatusError, openai.APIConnectionError)) as failed:
            client.completions.create(model="tiny", prompt="hi", max_tokens=3)
        ranks.procs[0].wait(30)
    finally:
        ranks.kill()
    if isinstance(failed.value, openai.APIStatusError):
        assert failed.value.status_code == 503
        assert "worker rank 1 has exited" in failed.value.message
    assert "worker rank 1 has exited" in ranks.output(0)


@pytest.mark.device_independent  # processes and sockets, not device decisions
def test_a_server_ended_by_sigterm_after_its_worker_died_says_so(tmp_path):
    """A worker killed while the server is idle, and rank 0 given SIGTERM at once, as
    mlx.launch does once a rank has exited: the server shuts down as SIGTERM asks, then
    exits 1 with the error naming the worker (not 0, as if nothing had happened)."""
    import openai

    port = free_ports(1)[0]
    ranks = LocalRanks(2, ["-c", SERVE_TINY_SCRIPT, str(TESTS), str(port)], tmp_path)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    try:
        _wait_healthy(client, ranks)
        ranks.procs[1].kill()
        ranks.procs[1].wait()
        ranks.procs[0].send_signal(signal.SIGTERM)
        code = ranks.procs[0].wait(30)
    finally:
        ranks.kill()
    out = ranks.output(0)
    assert code == 1, out[-3000:]
    assert "tiny-llm: error: tensor-parallel worker rank 1 has exited" in out, out[-3000:]


STEP_FAILS_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import test_tensor_parallel as t
    from tiny_llm.engine import LLMEngine
    from tiny_llm.engine.runner import ModelRunner
    from tiny_llm.tensor_parallel import TensorParallelError
    engine = LLMEngine(t.make_tiny_model(**t.TINY), t.tokenizer(), tensor_parallel_size=2,
                       num_pages=64)
    forward, calls = ModelRunner.forward, []
    def fails_once(self, batch, head=True):  # rank 0's forward, after the send
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected")
        return forward(self, batch, head)
    ModelRunner.forward = fails_once
    for attempt in range(2):
        try:
            engine.generate([[1, 2, 3]], t.SamplingParams(max_tokens=8), use_tqdm=False)
            print("generated", flush=True)
        except TensorParallelError as e:
            print("refused:", e, flush=True)
""")


@pytest.mark.device_independent  # processes and sockets, not device decisions
def test_a_failure_on_rank_0_after_the_send_fails_every_later_step(tmp_path):
    ranks = LocalRanks(2, ["-c", STEP_FAILS_SCRIPT, str(TESTS)], tmp_path)
    assert ranks.wait(60) == [0, 1]  # the worker, left in the failed step, ends too
    out = ranks.output(0)
    assert "left a step worker rank 1 is in" in ranks.output(1)
    assert out.count("refused:") == 2 and "generated" not in out, out[-3000:]
    assert "MemoryError: injected" in out and "no later step runs" in out


@pytest.mark.device_independent  # processes and sockets, not device decisions
@pytest.mark.parametrize("n,args,message", [
    (2, ["--tensor-parallel-timeout", "0"], "tensor_parallel_timeout must be"),  # no load
    (2, [], "valid sizes: 1, 3"),  # the default model's 3 KV heads over 2 ranks
    (3, [], "mlx.launch started 3 processes"),  # 2 ranks asked, 3 started
])
def test_bad_options_are_refused_on_every_rank(tmp_path, n, args, message):
    generate = ["-m", "tiny_llm.cli", "generate", "--prompt", "hi", "--tensor-parallel-size",
                "2", *args]
    ranks = LocalRanks(n, generate, tmp_path)
    assert ranks.wait(120) == [2] * n
    for r in range(n):
        assert message in ranks.output(r), ranks.output(r)[-3000:]


SERVE_ARGS = ["-m", "tiny_llm.cli", "serve", "--tensor-parallel-size", "3", "--num-pages", "64",
              "--served-model-name", "m",
              "--max-num-batched-tokens", "64"]


@pytest.mark.device_independent  # processes and sockets, not device decisions
def test_serve_on_three_ranks_answers_the_openai_client(tmp_path):
    """The default model split over 3 ranks: three requests at once, one streamed, get the
    single process's greedy replies; SIGTERM to rank 0 ends every rank."""
    from concurrent.futures import ThreadPoolExecutor

    from tiny_llm.engine import LLM

    import openai

    port = free_ports(1)[0]
    ranks = LocalRanks(3, [*SERVE_ARGS, "--port", str(port)], tmp_path)
    questions = ["What is the capital of France?", "Name a colour.", "Say hi."]
    try:
        single = LLM(num_pages=64).chat([[{"role": "user", "content": q}] for q in questions],
                                        SamplingParams(temperature=0, max_tokens=8),
                                        use_tqdm=False)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        _wait_healthy(client, ranks)

        def ask(i: int) -> str:
            reply = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": questions[i]}],
                temperature=0, max_tokens=8, stream=i == 0)
            if i:
                return reply.choices[0].message.content
            return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)

        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(ask, range(3)))
        assert replies == [out.outputs[0].text for out in single]
        ranks.procs[0].send_signal(signal.SIGTERM)
        codes = ranks.wait(60)
    finally:
        ranks.kill()
    assert codes == [0, 0, 0], ranks.output(0)[-3000:]


# ------------------------------------------------------------------ the launch

def book_launch_command() -> list[str]:
    """The chapter's command that launches the chat on 3 ranks, as argv (``.venv/bin/X``:
    this interpreter's X)."""
    line = re.search(r"\.venv/bin/[^`\n]*launch -n 3 [^`\n]*", BOOK.read_text()).group(0)
    venv_bin = Path(sys.executable).parent
    return [str(venv_bin / a.removeprefix(".venv/bin/")) if a.startswith(".venv/bin/") else a
            for a in shlex.split(line)]


def wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        assert proc.poll() is None, path.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"{text!r} did not come"
        time.sleep(0.2)


def end(launcher: subprocess.Popen, ranks: dict[int, int]) -> None:
    for pid in ranks.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.kill()
    launcher.wait()


@pytest.mark.device_independent  # processes and sockets, not device decisions
def test_the_books_launch_command_fails_when_a_worker_dies(tmp_path):
    """The chapter's launch of the chat on 3 ranks, rank 1 killed while the chat waits for
    input: the launch exits non-zero (mlx.launch alone exits 0), and rank 0 writes its own
    error naming rank 1 (not ended silently by the launcher's SIGTERM)."""
    err = tmp_path / "stderr"
    with open(err, "wb") as stderr:
        launcher = subprocess.Popen(book_launch_command(), stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=stderr, cwd=TESTS.parent)
    ranks: dict[int, int] = {}
    try:
        wait_for(err, "chat with the model", launcher)
        ranks = launched_ranks(launcher.pid)
        assert sorted(ranks) == [0, 1, 2]
        os.kill(ranks[1], signal.SIGKILL)
        code = launcher.wait(60)
    finally:
        end(launcher, ranks)
    out = err.read_text(errors="replace")
    assert code != 0, out[-3000:]
    assert "tiny-llm: error: tensor-parallel worker rank 1 has exited" in out, out[-3000:]


RANK_1_EXITS = textwrap.dedent("""
    import os, sys, time
    print("up", os.environ["MLX_RANK"], flush=True)
    if os.environ["MLX_RANK"] == "1":
        sys.exit(int(sys.argv[1]))
    time.sleep(120)
""")


@pytest.mark.device_independent  # processes, not device decisions
@pytest.mark.parametrize("rank_1", [3, 0])
def test_the_launch_exits_with_the_ranks_status(tmp_path, rank_1):
    """Rank 1 exits 3 and the launcher ends rank 0 with SIGTERM: the launch exits 3, the
    status rank 1 chose. Rank 1 exits 0: rank 0 runs on until Ctrl-C, which ends it and the
    launch with 130."""
    out = tmp_path / "stdout"
    launch = [sys.executable, "-m", "tiny_llm.cli", "launch", "-n", "2", "--", sys.executable,
              "-c", RANK_1_EXITS, str(rank_1)]
    with open(out, "wb") as stdout:
        launcher = subprocess.Popen(launch, stdin=subprocess.PIPE, stdout=stdout)
    ranks: dict[int, int] = {}
    try:
        if rank_1 == 0:
            wait_for(out, "up 0", launcher)
            ranks = launched_ranks(launcher.pid)
            assert 0 in ranks
            launcher.send_signal(signal.SIGINT)
        code = launcher.wait(60)
        for pid in ranks.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        end(launcher, ranks)
    assert code == (3 if rank_1 else 130)


def ring_generate(tmp_path: Path, addresses: list[str]) -> LocalRanks:
    """``tiny-llm generate`` on 2 ranks with these ring addresses."""
    argv = ["-m", "tiny_llm.cli", "generate", "--prompt", "hi", "--tensor-parallel-size", "2"]
    return LocalRanks(2, argv, tmp_path, addresses=addresses)


@pytest.mark.device_independent  # processes and sockets, not device decisions
def test_an_unreachable_rank_is_named_within_seconds(tmp_path):
    """Rank 1's address is TEST-NET's 192.0.2.1: rank 1 refuses it as not this machine's,
    and rank 0 names it within seconds (an error where the host drops the packets, a word
    while it keeps trying where the connection is refused), without a traceback. MLX's
    ring alone would wait in accept for ever."""
    p0, p1 = free_ports(2)
    ranks = ring_generate(tmp_path, [f"127.0.0.1:{p0}", f"192.0.2.1:{p1}"])
    try:
        assert ranks.procs[1].wait(60) == 2
        deadline = time.monotonic() + 20
        while f"rank 0 cannot reach rank 1 at 192.0.2.1:{p1}" not in ranks.output(0):
            assert time.monotonic() < deadline, ranks.output(0)[-3000:]
            time.sleep(0.2)
    finally:
        ranks.kill()
    assert "192.0.2.1 is not an address of this machine" in ranks.output(1)
    for r in range(2):
        assert "Traceback" not in ranks.output(r), ranks.output(r)[-3000:]


@pytest.mark.device_independent  # processes and sockets, not device decisions
def test_a_busy_port_is_named(tmp_path):
    """Another program listens on rank 0's ring port: rank 0 exits 2 with an error naming
    the port and what to do, without a traceback."""
    p0, p1 = free_ports(2)
    with socket.create_server(("127.0.0.1", p0)):
        ranks = ring_generate(tmp_path, [f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"])
        try:
            code = ranks.procs[0].wait(60)
        finally:
            ranks.kill()
    out = ranks.output(0)
    assert code == 2, out[-3000:]
    assert f"rank 0 cannot listen on 127.0.0.1:{p0}" in out and "--starting-port" in out, out
    assert "Traceback" not in out


SMALL_WORKER_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[1])
    import test_tensor_parallel as t
    import tiny_llm.day3_paged_kv as paged
    import tiny_llm.engine.pool_size as pool_size
    from tiny_llm.engine import LLMEngine
    from tiny_llm.tensor_parallel import TensorParallelError
    if os.environ["MLX_RANK"] == "1":
        pool_size.available_memory = lambda: int(sys.argv[2])  # this worker's machine is smaller
        allocate = paged.PagePool.__init__
        def allocating(self, *args):
            print("allocating pages", flush=True)
            allocate(self, *args)
        paged.PagePool.__init__ = allocating
    try:
        LLMEngine(t.make_tiny_model(**t.TINY), t.tokenizer(), tensor_parallel_size=2,
                  num_pages=1024)
        print("started", flush=True)
    except TensorParallelError as e:
        print("refused:", e, flush=True)
""")


@pytest.mark.device_independent  # processes and memory, not device decisions
def test_a_worker_checks_its_own_memory_for_rank_0s_pool(tmp_path):
    """A worker whose machine has less memory than rank 0's pool of 1024 pages needs (faked
    on rank 1 only) refuses before it allocates a page, naming its rank, the pages and their
    bytes; rank 0 fails with that message."""
    from tiny_llm.engine.pool_size import kv_bytes_per_token
    from tiny_llm.tensor_parallel import local_config

    model = make_tiny_model(**TINY)
    page_bytes = kv_bytes_per_token(local_config(model.config, 2), model.dtype) * 16
    available = 1024 * page_bytes  # the pool may take 90% of it: one page too few
    ranks = LocalRanks(2, ["-c", SMALL_WORKER_SCRIPT, str(TESTS), str(available)], tmp_path)
    assert ranks.wait(120) == [0, 1]
    out, worker = ranks.output(0), ranks.output(1)
    assert "started" not in out, out[-3000:]
    assert f"refused: worker rank 1 could not start: ValueError: rank 0's KV pool of 1024 pages " \
           f"of {page_bytes} bytes" in out, out[-3000:]
    assert "worker rank 1 could not start" in worker and "allocating pages" not in worker, worker


def _wait_healthy(client, ranks: LocalRanks) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            client.models.list()
            return
        except Exception:
            for r, proc in enumerate(ranks.procs):
                assert proc.poll() is None, ranks.output(r)[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
