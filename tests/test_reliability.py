"""The engine survives what users do to it.

Each test reproduces a defect an adversarial run found (two callers at once, a failure or
Ctrl-C inside a step, a reused id, abandoned or interleaved streams, absurd pool sizes,
invalid text), and asserts what a user of a server expects instead: no crash, no request
stranded, every request that goes on finishes with the tokens an undisturbed run gives
(seeded sampling included), and every page returns to the pool.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

from tiny_llm.engine import LLM, LLMEngine
from tiny_llm.kernels.device import rehearsing_gpu
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.testing.runs import greedy, random_prompts, served_alone

import pytest

PAGED = dict(max_num_seqs=4, max_num_batched_tokens=24, page_size=8, num_pages=64)


def sampled(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True)


def jobs(n: int = 6, seed: int = 0) -> list[tuple[dict, SamplingParams]]:
    """Greedy and seeded requests of mixed lengths (chunks, decodes, shared prefixes)."""
    rng = random.Random(seed)
    prompts = random_prompts(n, seed, lo=3, hi=40, shared_prefix=10)
    return [({"prompt_token_ids": p}, greedy(rng.randint(3, 10)) if i % 2
             else sampled(rng.randint(3, 10), seed=100 + i)) for i, p in enumerate(prompts)]


def drain(engine: LLMEngine, work, failures: int = 0, prepare=None) -> dict[int, list[int]]:
    """Add all jobs (then ``prepare(engine, ids)``), step to the end; tolerate
    ``failures`` exceptions from step()."""
    ids = {engine.add_request(p, sp): i for i, (p, sp) in enumerate(work)}
    if prepare:
        prepare(engine, list(ids))
    tokens: dict[int, list[int]] = {}
    caught, steps = 0, 0
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except (RuntimeError, KeyboardInterrupt):
            caught += 1
            continue
        for out in outputs:
            if out.finished:
                tokens[ids[out.request_id]] = out.outputs[0].token_ids
        steps += 1
        assert steps < 500, "no progress"
    assert caught == failures
    return tokens


def assert_clean(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and not engine.requests
    if "num_pages" in stats:
        assert stats["num_free_pages"] == stats["num_pages"]
        engine.kv.blocks.check_invariants()


# ---------------------------------------------------------------------------------------
# 1. Two callers at once.


def test_threads_calling_generate_and_stream_at_once_are_served(tiny_model, smollm_tokenizer):
    engine = LLMEngine(tiny_model, smollm_tokenizer, **PAGED)
    prompts = random_prompts(9, seed=21)
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def generate(first: int) -> None:
        try:
            outs = engine.generate([{"prompt_token_ids": p} for p in prompts[first:first + 3]],
                                   greedy(8), use_tqdm=False)
            results.update({first + i: o.outputs[0].token_ids for i, o in enumerate(outs)})
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    def stream() -> None:
        try:
            results[9] = list(engine.stream({"prompt_token_ids": prompts[0]}, greedy(8)))[
                -1].outputs[0].token_ids
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=generate, args=(i,)) for i in (0, 3, 6)]
    threads.append(threading.Thread(target=stream))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    for i in range(9):
        assert results[i] == served_alone(tiny_model, smollm_tokenizer, prompts[i], greedy(8))[0]
    assert results[9] == results[0]
    assert_clean(engine)


# ---------------------------------------------------------------------------------------
# 2. A step is all-or-nothing: failures injected at every point of a step.


class FailingModel:
    """Raises on the ``at``-th forward (through the model interface)."""

    def __init__(self, model, at: int):
        self.model, self.config, self.dtype, self.at, self.calls = model, model.config, \
            model.dtype, at, 0
        self.tensor_parallel = model.tensor_parallel

    def hidden_states(self, *args):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("injected: forward")
        return self.model.hidden_states(*args)

    def logits(self, *args):
        return self.model.logits(*args)


class FailingAttention:
    """Raises in the ``at``-th layer call (through the attention seam), after the inner
    backend has written that layer's K/V."""

    def __init__(self, inner, at: int):
        self.inner, self.at, self.calls = inner, at, 0
        self.name, self.storage = inner.name, inner.storage

    def begin_step(self, step):
        self.inner.begin_step(step)

    def attend(self, *args):
        out = self.inner.attend(*args)
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("injected: attention")
        return out

    def state(self):
        return self.inner.state()

    def fused_decode(self):
        return None  # every layer through attend: the failure must come from there


class FailingGenerator:
    """A request's random generator that fails its ``at``-th draw (sampling mid-batch)."""

    def __init__(self, rng, at: int):
        self.rng, self.at, self.calls = rng, at, 0
        self.bit_generator = rng.bit_generator

    def random(self):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("injected: sampling")
        return self.rng.random()


def inject(engine: LLMEngine, point: str, at: int) -> None:
    if point == "forward":
        engine.runner.model = FailingModel(engine.model, at)
    elif point == "attention":
        engine.runner.attention = FailingAttention(engine.attention, at)
    elif point == "commit":  # Ctrl-C while the step's results are being recorded
        finish_step = engine.scheduler.finish_step
        calls = [0]

        def interrupted(chunks):
            calls[0] += 1
            if calls[0] == at:
                signal.raise_signal(signal.SIGINT)
            finish_step(chunks)

        engine.scheduler.finish_step = interrupted


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
@pytest.mark.parametrize("point,at", [("forward", 1), ("forward", 4), ("attention", 1),
                                      ("attention", 9), ("commit", 3), ("sampling", 2),
                                      ("sampling", 3)])
def test_a_failed_step_changes_nothing_and_the_engine_goes_on(tiny_model, smollm_tokenizer,
                                                             kv_cache, point, at):
    work = jobs(seed=at)
    options = PAGED if kv_cache == "paged" else dict(kv_cache="dense", max_num_seqs=4,
                                                     max_num_batched_tokens=24)
    expected = drain(LLMEngine(tiny_model, smollm_tokenizer, **options), work)
    engine = LLMEngine(tiny_model, smollm_tokenizer, **options)
    prepare = None
    if point == "sampling":  # the last seeded request's draw fails after the others drew

        def prepare(engine, ids):
            sampler = engine.requests[ids[4]].sampler
            sampler.rng = FailingGenerator(sampler.rng, at)
    else:
        inject(engine, point, at)
    got = drain(engine, work, failures=1, prepare=prepare)
    assert got == expected, f"a failure at {point} #{at} changed the tokens"
    assert_clean(engine)


def test_ctrl_c_during_generate_strands_nothing(tiny_model, smollm_tokenizer):
    """Ctrl-C at random moments of generate(): the call's requests are aborted, the engine
    is clean and serves the next call exactly."""
    engine = LLMEngine(tiny_model, smollm_tokenizer, **PAGED)
    work = jobs(8, seed=5)
    prompts, params = [p for p, _ in work], [sp for _, sp in work]
    expected = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    start = time.perf_counter()
    engine.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - start
    rng = random.Random(0)
    interrupted = 0
    for _ in range(12):
        timer = threading.Timer(rng.uniform(0, duration), os.kill,
                                (os.getpid(), signal.SIGINT))
        try:
            timer.start()
            engine.generate(prompts, params, use_tqdm=False)
        except KeyboardInterrupt:
            interrupted += 1
        while True:  # a signal sent just as generate returned lands here: absorb it
            try:
                timer.join()
                time.sleep(0.05)
                break
            except KeyboardInterrupt:
                pass
        assert_clean(engine)
    assert interrupted > 0
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert got == expected


# ---------------------------------------------------------------------------------------
# 3. Outputs belong to requests, not to ids.


def test_a_reused_id_never_receives_another_requests_output(tiny_model, smollm_tokenizer):
    engine = LLMEngine(tiny_model, smollm_tokenizer)
    a, b = random_prompts(2, seed=31)
    engine.add_request({"prompt_token_ids": a}, greedy(5), request_id="0")
    engine.abort("0")
    (out,) = engine.generate({"prompt_token_ids": b}, greedy(5), use_tqdm=False)
    assert out.request_id != "0" and out.finish_reason == "length"
    assert out.outputs[0].token_ids == served_alone(tiny_model, smollm_tokenizer, b,
                                                    greedy(5))[0]
    with pytest.raises(ValueError, match="already in use"):  # "0" owes its caller an output
        engine.add_request({"prompt_token_ids": b}, greedy(5), request_id="0")
    (aborted,) = engine.step()  # the abort reaches the caller of add_request ...
    assert aborted.request_id == "0" and aborted.finish_reason == "abort"
    assert aborted.prompt_token_ids == a
    engine.add_request({"prompt_token_ids": b}, greedy(5), request_id="0")  # ... then it is free
    assert_clean_after_steps(engine)


def assert_clean_after_steps(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()
    assert_clean(engine)


# ---------------------------------------------------------------------------------------
# 4. Streams: any number of them, interleaved with step loops; dropped ones abort.


def test_streams_and_step_loops_interleave_without_losing_outputs(tiny_model, smollm_tokenizer):
    engine = LLMEngine(tiny_model, smollm_tokenizer, **PAGED)
    p1, p2, p3 = random_prompts(3, seed=41)
    a = engine.stream({"prompt_token_ids": p1}, greedy(6))
    b = engine.stream({"prompt_token_ids": p2}, greedy(6))
    mine = engine.add_request({"prompt_token_ids": p3}, greedy(6))
    seen = []
    while len(seen) < 2:  # a user's step loop drives the engine a while ...
        seen += engine.step()
    assert {o.request_id for o in seen} == {mine}  # ... and gets only its own outputs
    done = threading.Event()
    results = {}

    def consume() -> None:
        results["a"] = [t for o in a for t in o.new_token_ids]  # a's queue, then driving
        results["b"] = [t for o in b for t in o.new_token_ids]
        done.set()

    threading.Thread(target=consume, daemon=True).start()
    assert done.wait(60), "a stream spun forever on outputs another consumer took"
    for name, prompt in (("a", p1), ("b", p2)):
        assert results[name] == served_alone(tiny_model, smollm_tokenizer, prompt,
                                             greedy(6))[0]
    rest = []
    while engine.has_unfinished_requests():
        rest += engine.step()
    assert [o.request_id for o in rest] == [mine] * len(rest) and rest[-1].finished
    assert [t for o in seen + rest for t in o.new_token_ids] == served_alone(
        tiny_model, smollm_tokenizer, p3, greedy(6))[0]
    assert_clean(engine)


def test_a_dropped_or_closed_stream_aborts_its_request(tiny_model, smollm_tokenizer):
    engine = LLMEngine(tiny_model, smollm_tokenizer, **PAGED)
    (p,) = random_prompts(1, seed=42)
    never_iterated = engine.stream({"prompt_token_ids": p}, greedy(50))
    engine.generate({"prompt_token_ids": p}, greedy(2), use_tqdm=False)  # it would decode ...
    assert engine.stats()["num_running"] == 1
    del never_iterated
    gc.collect()
    assert not engine.has_unfinished_requests()  # ... but dropped, it is aborted
    assert_clean(engine)
    stream = engine.stream({"prompt_token_ids": p}, greedy(50))
    next(stream)
    stream.close()
    assert_clean(engine)
    with engine.stream({"prompt_token_ids": p}, greedy(50)) as stream:
        next(stream)
    assert_clean(engine)


# ---------------------------------------------------------------------------------------
# 5. Memory is checked before it is allocated.


@pytest.mark.parametrize("options,message", [
    (dict(kv_memory_bytes=1.0), "kv_memory_bytes must be an integer"),
    (dict(kv_memory_bytes=True), "kv_memory_bytes must be an integer"),
    (dict(kv_memory_bytes=float("inf")), "kv_memory_bytes must be an integer"),
    (dict(kv_memory_bytes=1), "holds no page"),
    (dict(kv_memory_bytes=2), "holds no page"),
    (dict(num_pages=10**7), r"GiB available and the pool may take at most 90%"),
    (dict(kv_memory_bytes=10**15), r"GiB available"),
    (dict(kv_memory_fraction=0.95), r"kv_memory_fraction must be a number in \(0, 0.9\]"),
    (dict(kv_memory_fraction=0), "kv_memory_fraction must be"),
    (dict(kv_memory_fraction=0.5, num_pages=8), "at most one of"),
    (dict(kv_cache="dense", num_pages=64), "needs kv_cache='paged'"),
])
def test_pool_sizes_are_checked_before_allocating(tiny_model, smollm_tokenizer, options,
                                                  message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(tiny_model, smollm_tokenizer, **options)


def test_a_fraction_of_memory_sizes_the_pool(tiny_model, smollm_tokenizer):
    from tiny_llm.engine.pool_size import available_memory, kv_bytes_per_token

    engine = LLMEngine(tiny_model, smollm_tokenizer, kv_memory_fraction=0.001)
    page_bytes = kv_bytes_per_token(tiny_model.config, tiny_model.dtype) * 16
    expected = 0.001 * available_memory() / page_bytes
    assert abs(engine.stats()["num_pages"] - expected) <= 0.05 * expected + 1


def test_on_apple_silicon_the_pool_comes_from_the_working_set_less_the_model(monkeypatch):
    """The GPU's working set is a fixed size: the weights already in it are not the
    pool's (on Linux the OS's available memory has counted them)."""
    from tiny_llm.engine.pool_size import available_memory

    import mlx.core as mx

    weights = mx.zeros((16, 1024, 1024))  # 64 MiB that MLX holds, as a model's weights do
    mx.eval(weights)
    working_set = 8 << 30
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(mx, "device_info",
                        lambda: {"max_recommended_working_set_size": working_set})
    assert available_memory() == working_set - mx.get_active_memory()
    assert available_memory() <= working_set - weights.nbytes


# ---------------------------------------------------------------------------------------
# 6. Text is checked at the door.


def test_invalid_unicode_is_refused_naming_the_position(tiny_model, smollm_tokenizer):
    engine = LLMEngine(tiny_model, smollm_tokenizer)
    with pytest.raises(ValueError, match="the prompt is not valid Unicode: character 3"):
        engine.add_request("abc\ud800def")
    with pytest.raises(ValueError, match="message 1 'content' is not valid Unicode"):
        engine.add_request([{"role": "user", "content": "hi"},
                            {"role": "user", "content": "x\udcff"}])
    with pytest.raises(ValueError, match="SamplingParams.stop is not valid Unicode"):
        SamplingParams(stop=["ok\ud800"])
    assert not engine.requests


# These tests are of the CLI's behaviour, not its arithmetic: in the GPU rehearsal they run
# the model in float32, because a GPU's half precision would run on the CPU, where
# half-precision matmuls crawl.
FLOAT32 = ["--dtype", "float32"] if rehearsing_gpu() else []


def run_cli(args: list[str], stdin: bytes = b"", timeout: int = 120,
            after_start=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tiny_llm.cli", *args, *FLOAT32]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    if after_start:
        after_start(proc)
    out, err = proc.communicate(stdin, timeout=timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_chat_reports_an_undecodable_line_and_keeps_the_conversation():
    run = run_cli(["chat", "--max-tokens", "2", "--temperature", "0", "--num-pages", "64"],
                  stdin=b"\xffoops\nhi\n/exit\n")
    err = run.stderr.decode(errors="replace")
    assert run.returncode == 0, err
    assert "not valid Unicode: character 0" in err and "conversation is kept" in err
    assert run.stdout.decode().count("bot> ") == 1  # the next line was answered


def test_generate_stops_quietly_on_ctrl_c_and_on_a_closed_pipe():
    def interrupt_after_load(proc):
        for line in proc.stderr:  # "loaded in ..." comes once the model is loaded
            if line.startswith(b"loaded"):
                proc.send_signal(signal.SIGINT)
                return

    run = run_cli(["generate", "--prompt", "Count to one hundred.", "--max-tokens", "2000",
                   "--num-pages", "256"], after_start=interrupt_after_load)
    assert run.returncode == 130 and b"Traceback" not in run.stderr
    shell = subprocess.run(
        f"{sys.executable} -m tiny_llm.cli generate --prompt 'Count to fifty.' "
        f"--max-tokens 200 --num-pages 64 {' '.join(FLOAT32)} | head -c 1", shell=True,
        capture_output=True, timeout=120)
    assert b"Traceback" not in shell.stderr and b"BrokenPipe" not in shell.stderr


# ---------------------------------------------------------------------------------------
# Smaller: types and values a user can get wrong.


def test_clear_errors_for_wrong_types_and_values(tiny_model, smollm_tokenizer):
    engine = LLMEngine(tiny_model, smollm_tokenizer, max_model_len=64)
    vocab = tiny_model.config.vocab_size
    cases = [
        (TypeError, "decode bytes to str", lambda: engine.add_request(b"hello")),
        (TypeError, "got NoneType", lambda: engine.add_request(None)),
        (TypeError, r"SamplingParams\(\*\*d\)",
         lambda: engine.add_request("hi", {"max_tokens": 3})),
        (TypeError, "a dict prompt is", lambda: engine.add_request({"prompt": "hi"})),
        (ValueError, "stop_token_ids out of the vocabulary",
         lambda: engine.add_request("hi", SamplingParams(stop_token_ids=[vocab]))),
        (TypeError, "enable_chunked_prefill must be True or False",
         lambda: LLMEngine(tiny_model, smollm_tokenizer, enable_chunked_prefill="no")),
        (ValueError, "exceeds the model's context length",
         lambda: LLMEngine(tiny_model, smollm_tokenizer, max_model_len=10**6)),
        (ValueError, "max_num_seqs must be an integer",
         lambda: LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=2.0)),
        (ValueError, "attention='flash' reads paged K/V",
         lambda: LLMEngine(tiny_model, smollm_tokenizer, kv_cache="dense", attention="flash")),
        (TypeError, "message 0 'content' must be a string, got int",
         lambda: engine.add_request([{"role": "user", "content": 5}])),
        (ValueError, "a role is one of system, user, assistant",
         lambda: engine.add_request([{"role": "wizard", "content": "hi"}])),
        (TypeError, r"sampling_params must be .* got dict \(use SamplingParams\(\*\*d\)\)",
         lambda: engine.generate(["a"], {"max_tokens": 2}, use_tqdm=False)),
        (TypeError, "decode bytes to str", lambda: engine.generate(b"hello", use_tqdm=False)),
        (TypeError, r"generate takes a prompt or a list of prompts \(a prompt is a string.* "
         "got int", lambda: engine.generate(5, use_tqdm=False)),
        (TypeError, "generate takes a prompt .* got NoneType",
         lambda: engine.generate(None, use_tqdm=False)),
        (TypeError, "sampling_params must be a SamplingParams or a list of them, got float",
         lambda: engine.generate(["a"], 0.5, use_tqdm=False)),
        (TypeError, "params must be a SamplingParams, got int",
         lambda: engine.generate(["a", "b"], [greedy(2), 5], use_tqdm=False)),
    ]
    llm = LLM.__new__(LLM)  # the offline front door, over the same engine
    llm.engine = engine
    cases += [
        (TypeError, r"chat takes a conversation .* got int", lambda: llm.chat(5)),
        (TypeError, r"chat takes a conversation .* got str", lambda: llm.chat("hi")),
        (TypeError, r"chat takes a conversation .* got list", lambda: llm.chat([5])),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
    assert not engine.requests
    # A tuple of token ids is a prompt like a list.
    (out,) = engine.generate([(5, 6, 7)], greedy(2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


class RecordingGenerator:
    """A seeded request's generator that logs each draw as ``(who, n)``; fails the
    ``fail_at``-th draw if given."""

    def __init__(self, rng, who: int, log: list, fail_at: int | None = None):
        self.rng, self.who, self.log, self.fail_at, self.calls = rng, who, log, fail_at, 0
        self.bit_generator = rng.bit_generator

    def random(self):
        self.calls += 1
        if self.calls == self.fail_at:
            self.log.append((self.who, "failed"))
            raise RuntimeError("injected: sampling")
        self.log.append((self.who, self.calls))
        return self.rng.random()


def test_a_failed_draw_restores_every_generator_that_drew_in_its_step(tiny_model,
                                                                      smollm_tokenizer):
    """Three seeded requests decode in lockstep; the last one's third draw fails after the
    other two drew in that step: their generators must be put back too."""
    work = [({"prompt_token_ids": p}, sampled(8, seed=70 + i))
            for i, p in enumerate(random_prompts(3, seed=51, lo=5, hi=8))]
    expected = drain(LLMEngine(tiny_model, smollm_tokenizer, **PAGED), work)
    log: list[tuple[int, object]] = []

    def prepare(engine, ids):
        for who, request_id in enumerate(ids):
            sampler = engine.requests[request_id].sampler
            sampler.rng = RecordingGenerator(sampler.rng, who, log, 3 if who == 2 else None)

    got = drain(LLMEngine(tiny_model, smollm_tokenizer, **PAGED), work, failures=1,
                prepare=prepare)
    failed = log.index((2, "failed"))
    assert log[failed - 2:failed] == [(0, 3), (1, 3)], log  # both drew in the failing step
    assert got == expected, "a failed step left another request's generator advanced"


def test_a_failed_draw_takes_back_the_logprob_records_of_its_step(tiny_model,
                                                                   smollm_tokenizer):
    """Requests with logprobs (sampled, greedy, sampled) decode in lockstep; the last one's
    third draw fails after the other two recorded their token's logprobs in that step:
    those records go with the step, so each request ends with one record per token, the
    records of an undisturbed run."""
    prompts = random_prompts(3, seed=52, lo=5, hi=8)
    params = [replace(sampled(8, seed=80), logprobs=2), greedy(8, logprobs=2),
              replace(sampled(8, seed=81), logprobs=2)]

    def run(fail: bool) -> list:
        engine = LLMEngine(tiny_model, smollm_tokenizer, **PAGED)
        ids = [engine.add_request({"prompt_token_ids": p}, sp)
               for p, sp in zip(prompts, params, strict=True)]
        if fail:
            sampler = engine.requests[ids[2]].sampler
            sampler.rng = FailingGenerator(sampler.rng, 3)
        finished, failures = {}, 0
        while engine.has_unfinished_requests():
            try:
                finished |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
            except RuntimeError:
                failures += 1
        assert failures == fail
        return [finished[i] for i in ids]

    expected = run(fail=False)
    for got, want in zip(run(fail=True), expected, strict=True):
        assert len(got.logprobs) == len(got.token_ids) == 8
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
