"""The fused decoder layers of decode steps (``tiny_llm/kernels/cpu_fused.py``).

- every step's logits with the fused layers are the op path's bit for bit, and so are the
  tokens, for each family's switches (Llama, Qwen2's q/k/v biases, Qwen3's head norms,
  interleaved RoPE, a checkpoint's rescaled RoPE frequencies, a separate LM head), float32
  and quantized weights (4 and 8 bits, formats mixed between layers), int8 activations,
  and both kernel backends, over a workload whose decode steps have several rows at
  different contexts; scales and biases kept as stored (float16, bfloat16) give the bits
  of their float32 copies, fused and op by op;
- the fused path runs for the layers of decode steps only: a step with prefill rows, the
  MLX-ops backends, ``cpu_kernels=False``, ``fused_layers=False``, MoE layers and a
  learner's extension all run op by op;
- the op writes the pools in place only when nothing else holds them: a pool array held
  elsewhere, or a view of one, sends the step op by op and keeps the holder's array as it
  was; replaced weights are read again;
- ``--no-fused-layers`` turns them off; bad input to the op is refused with a clear error;
- the kernels' phase clocks (``profile``) see every phase of a fused decode step once: together
  no more than the step, the pool's helper threads not counted, nothing counted while off.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

# The fused ops serve CPU streams: on a Mac they run on its CPU, and the GPU rehearsal, which
# would run them the same way, leaves them to the main pass.
pytestmark = [pytest.mark.usefixtures("cpu_device"), pytest.mark.device_independent]

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def quantize(model: nn.Module, formats) -> nn.Module:
    """``formats(path)``: (group_size, bits) of each quantizable layer."""
    nn.quantize(model, class_predicate=lambda path, module: hasattr(module, "to_quantized") and {
        "group_size": formats(path)[0], "bits": formats(path)[1]})
    return model


def as_stored(path: str) -> tuple[int, int]:  # the default GGUF's formats
    return (32, 8) if "embed" in path else (32, 4)


def mixed(path: str) -> tuple[int, int]:  # 8-bit MLPs, 4-bit attention, groups of 64
    return (64, 8) if "mlp" in path or "embed" in path else (64, 4)


def model_of(case: str) -> nn.Module:
    from tiny_llm.testing.models import make_tiny_model

    return {
        "llama": lambda: make_tiny_model("llama"),
        "qwen2-biases": lambda: make_tiny_model("qwen2"),
        "qwen3-head-norms": lambda: make_tiny_model("qwen3"),
        "interleaved-rope": lambda: make_tiny_model("llama", rope_traditional=True),
        "llama3-rope": lambda: make_tiny_model("llama", rope_scaling=LLAMA3_SCALING),
        "lm-head": lambda: make_tiny_model("qwen3", tie_word_embeddings=False),
        "4-bit": lambda: quantize(make_tiny_model("llama", tie_word_embeddings=True), as_stored),
        "8-bit-mixed": lambda: quantize(make_tiny_model("qwen2"), mixed),
    }[case]()


def run(model, tokenizer, **config):
    """Each request's tokens, the logits of every step and how many layers ran fused."""
    from tiny_llm.engine import LLMEngine
    from tiny_llm.kernels import cpu_fused
    from tiny_llm.testing.runs import tokens_of, workload

    engine = LLMEngine(model, tokenizer, num_pages=64, **config)
    logits = []
    sample = engine.runner.sample

    def recorded(step_logits, batch, verify=None):
        logits.append(np.array(step_logits))
        return sample(step_logits, batch, verify)

    engine.runner.sample = recorded
    prompts, params = workload(5, seed=11, max_tokens=(3, 10), hi=50)
    before = cpu_fused.fused_layers_run
    tokens = tokens_of(engine, prompts, params)
    return tokens, logits, cpu_fused.fused_layers_run - before


@pytest.mark.parametrize("case", ["llama", "qwen2-biases", "qwen3-head-norms", "interleaved-rope",
                                  "llama3-rope", "lm-head", "4-bit", "8-bit-mixed"])
@pytest.mark.parametrize("attention", ["flash", "vector"])
def test_fused_layers_give_the_op_paths_bits(smollm_tokenizer, case, attention):
    model = model_of(case)
    tokens, logits, fused = run(model, smollm_tokenizer, attention=attention)
    want_tokens, want_logits, none = run(model, smollm_tokenizer, attention=attention,
                                         fused_layers=False)
    assert none == 0 and fused > 0
    # Every step after the first (all prompts at once) is decode rows only: fused.
    assert fused == (len(logits) - 1) * model.config.num_hidden_layers
    assert tokens == want_tokens
    assert len(logits) == len(want_logits)
    for got, want in zip(logits, want_logits, strict=True):
        assert np.array_equal(got, want)


def test_int8_activations_fused_give_the_op_paths_bits(smollm_tokenizer):
    model = model_of("4-bit")
    tokens, logits, fused = run(model, smollm_tokenizer, int8_activations=True)
    want_tokens, want_logits, _ = run(model, smollm_tokenizer, int8_activations=True,
                                      fused_layers=False)
    assert fused > 0 and tokens == want_tokens
    assert all(np.array_equal(a, b) for a, b in zip(logits, want_logits, strict=True))


def with_scales(model: nn.Module, dtype: mx.Dtype) -> nn.Module:
    """``model`` with its quantized layers' scales and biases in ``dtype``, the embedding's
    lookup in float32 (as the loader keeps a checkpoint's float16 ones on the CPU)."""
    from mlx.utils import tree_flatten

    model.load_weights([(k, v.astype(dtype)) for k, v in tree_flatten(model.parameters())
                        if k.endswith((".scales", ".biases"))], strict=False)
    for m in model.modules():
        if isinstance(m, nn.QuantizedEmbedding):
            m.output_dtype = mx.float32
    return model


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("config", [dict(), dict(fused_layers=False), dict(int8_activations=True)],
                         ids=["fused", "op-by-op", "int8"])
def test_scales_as_stored_give_the_bits_of_float32_copies(smollm_tokenizer, dtype, config):
    model = with_scales(model_of("4-bit"), dtype)  # values dtype holds exactly
    assert model.model.embed_tokens.scales.dtype == dtype
    tokens, logits, fused = run(model, smollm_tokenizer, **config)
    assert (fused > 0) == config.get("fused_layers", True)
    want_tokens, want_logits, _ = run(with_scales(model, mx.float32), smollm_tokenizer, **config)
    assert model.model.embed_tokens.scales.dtype == mx.float32
    assert tokens == want_tokens
    assert all(np.array_equal(a, b) for a, b in zip(logits, want_logits, strict=True))


@pytest.mark.parametrize("config", [dict(attention="page_walk"), dict(attention="gather"),
                                    dict(cpu_kernels=False), dict(fused_layers=False)],
                         ids=["page-walk", "gather", "no-cpu-kernels", "fused-off"])
def test_other_paths_run_op_by_op(smollm_tokenizer, config):
    assert run(model_of("llama"), smollm_tokenizer, **config)[2] == 0


def test_a_draft_model_follows_the_engines_option(smollm_tokenizer):
    """Speculative decoding's draft model runs its decode steps fused too, and op by op
    with ``fused_layers=False``; the tokens do not change."""
    model = model_of("llama")
    draft = dict(speculative="draft", draft_model=(model_of("qwen3-head-norms"), smollm_tokenizer))
    tokens, _, fused = run(model, smollm_tokenizer, **draft)
    want, _, none = run(model, smollm_tokenizer, **draft, fused_layers=False)
    assert fused > 0 and none == 0 and tokens == want


def test_steps_with_prefill_rows_run_op_by_op(smollm_tokenizer):
    from tiny_llm.engine import LLMEngine
    from tiny_llm.kernels import cpu_fused
    from tiny_llm.testing.runs import greedy

    engine = LLMEngine(model_of("llama"), smollm_tokenizer, num_pages=64)
    engine.add_request({"prompt_token_ids": [5, 6, 7]}, greedy(6))
    engine.step()  # the prompt
    engine.step()  # a decode: fused
    before = cpu_fused.fused_layers_run
    engine.add_request({"prompt_token_ids": [8, 9]}, greedy(2))
    engine.step()  # a decode row and a prompt in one step: op by op
    assert cpu_fused.fused_layers_run == before
    engine.step()  # two decode rows
    assert cpu_fused.fused_layers_run == before + engine.model.config.num_hidden_layers


def test_moe_layers_run_op_by_op(smollm_tokenizer):
    from tiny_llm.testing.models import make_tiny_model

    model = make_tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, decoder_sparse_step=2)
    tokens, logits, fused = run(model, smollm_tokenizer)
    # Layer 0 is dense, layer 1 sparse: only the dense one of each decode step is fused.
    assert fused == len(logits) - 1
    assert tokens == run(model, smollm_tokenizer, fused_layers=False)[0]


def test_a_learners_extension_runs_op_by_op(smollm_tokenizer, monkeypatch):
    """With a learner's kernels loaded, the model must run them: the fused ops would run
    the reference's attention instead."""
    from tiny_llm.kernels import cpu_fused

    monkeypatch.setattr(cpu_fused, "extension", lambda: object())
    assert run(model_of("llama"), smollm_tokenizer)[2] == 0


def test_the_command_line_turns_the_fused_layers_off():
    from tiny_llm.cli import build_parser, engine_options
    from tiny_llm.engine import EngineConfig

    parse = build_parser().parse_args
    assert "fused_layers" not in engine_options(parse(["generate", "--prompt", "hi"]))
    off = engine_options(parse(["generate", "--prompt", "hi", "--no-fused-layers"]))
    assert off == {"fused_layers": False} and EngineConfig().fused_layers
    with pytest.raises(TypeError, match="fused_layers"):
        EngineConfig(fused_layers="no")


def decode_engine(model, tokenizer):
    """An engine with one request whose next step is a decode step."""
    from tiny_llm.engine import LLMEngine
    from tiny_llm.testing.runs import greedy

    engine = LLMEngine(model, tokenizer, num_pages=64)
    engine.add_request({"prompt_token_ids": [5, 6, 7, 8]}, greedy(8))
    engine.step()  # the prompt
    engine.step()  # a decode step: the pools are now the op's
    return engine


def addresses(arrays) -> list[int]:
    """Where each array's buffer lies (numpy's view of it, dropped at once)."""
    return [np.asarray(a).ctypes.data for a in arrays]


def test_the_pools_are_written_in_place(smollm_tokenizer):
    from tiny_llm.kernels import cpu_fused
    from tiny_llm.kernels.extension import reference_extension

    engine = decode_engine(model_of("llama"), smollm_tokenizer)
    pool = engine.kv.pool
    # Addresses and copies only: a reference to a pool array would keep the op from
    # writing it.
    buffers, copies = addresses([*pool.k, *pool.v]), reference_extension().pool_copies()
    before, fused = [np.array(a) for a in [*pool.k, *pool.v]], cpu_fused.fused_layers_run
    engine.step()
    assert cpu_fused.fused_layers_run == fused + engine.model.config.num_hidden_layers
    # The same buffers, one more row each, and no copy of a pool.
    assert buffers == addresses([*pool.k, *pool.v])
    assert reference_extension().pool_copies() == copies
    for old, new in zip(before, [*pool.k, *pool.v], strict=True):
        changed = np.any(old != np.array(new), axis=-1).reshape(-1, old.shape[2]).any(axis=1)
        assert changed.sum() == 1  # the decode row's slot


@pytest.mark.parametrize("holder", ["reference", "view"])
def test_a_pool_held_elsewhere_is_not_written_in_place(smollm_tokenizer, holder):
    """An array of the pool that someone else holds (or a view of it) keeps its values: the
    step runs op by op, whose write copies that pool; the tokens do not change."""
    from tiny_llm.kernels import cpu_fused

    model = model_of("llama")
    engine, want = decode_engine(model, smollm_tokenizer), decode_engine(model, smollm_tokenizer)
    held = engine.kv.pool.k[1] if holder == "reference" else engine.kv.pool.k[1][:2]
    values, fused = np.array(held), cpu_fused.fused_layers_run
    out = engine.step()[0].outputs[0].token_ids
    assert cpu_fused.fused_layers_run == fused
    assert np.array_equal(np.array(held), values)
    assert out == want.step()[0].outputs[0].token_ids
    del held
    engine.step()
    assert cpu_fused.fused_layers_run > fused  # nothing holds the pools now: fused again


def replace(model: nn.Module, what: str) -> None:
    """An array, a module or a block of ``model`` replaced after it ran."""
    layers = model.model.layers
    if what == "array":
        down = layers[1].mlp.down_proj
        down.update({"scales": down.scales * 2})
    elif what == "module":
        first, second = layers[0].mlp, layers[1].mlp
        first.down_proj, second.down_proj = second.down_proj, first.down_proj
    else:  # two blocks trade places in the list (each keeps its own pools)
        layers[0], layers[1] = layers[1], layers[0]


@pytest.mark.parametrize("what", ["array", "module", "block"])
def test_replaced_weights_are_read_again(smollm_tokenizer, what):
    """The layers' arrays are read once and kept while the blocks, their modules and
    arrays stay the same; one replaced after a run is the one the next run multiplies by."""
    model = model_of("4-bit")
    run(model, smollm_tokenizer)
    replace(model, what)
    tokens, logits, fused = run(model, smollm_tokenizer)
    want_tokens, want_logits, _ = run(model, smollm_tokenizer, fused_layers=False)
    assert fused > 0 and tokens == want_tokens
    assert all(np.array_equal(a, b) for a, b in zip(logits, want_logits, strict=True))


def test_bad_input_is_refused():
    from tiny_llm.kernels.extension import reference_extension

    ext = reference_extension()
    w = [mx.zeros((64, 64)), mx.zeros((32, 64)), mx.zeros((32, 64))]
    norm, inv_freq = mx.ones((64,)), mx.ones((8,))
    mlp = ([mx.zeros((128, 64)), mx.zeros((128, 64))], 0, 0)
    down = ([mx.zeros((64, 128))], 0, 0)
    layer = [norm, (w, 0, 0), [], [], inv_freq, norm, ([w[0]], 0, 0), mlp, down]
    shape = dict(n_heads=4, n_kv_heads=2, head_dim=16, eps=1e-6, post_eps=1e-6, rope_dims=16,
                 rope_traditional=False, rope_scale=1.0, scale=0.25)

    def with_(i, value):
        return [value if j == i else a for j, a in enumerate(layer)]

    run_ = ext.decoder_run([layer, layer], **shape)
    x, pos = mx.zeros((1, 64)), mx.zeros((1,), dtype=mx.int32)
    meta = (mx.zeros((1,), dtype=mx.int32), mx.zeros((1, 1), dtype=mx.int32),
            mx.ones((1,), dtype=mx.int32), mx.array([0, 1], dtype=mx.int32))
    pools = [mx.zeros((4, 16, 2, 16)) for _ in range(4)]
    mx.eval(pools)
    out = ext.decoder_layers(run_, x, pools[:2], pools[2:], pos, *meta, tiled=True)
    assert out.shape == (1, 64)
    with pytest.raises(ValueError, match="needs 3 weights"):
        ext.decoder_run([with_(1, (w[:2], 0, 0))], **shape)
    with pytest.raises(ValueError, match="does not serve this format"):
        packed = [a for m in w for a in mx.quantize(m, group_size=32, bits=4)]
        ext.decoder_run([with_(1, (packed, 32, 3))], **shape)
    with pytest.raises(ValueError, match="inv_freq"):
        ext.decoder_run([with_(4, mx.ones((3,)))], **shape)
    with pytest.raises(ValueError, match="down"):
        ext.decoder_run([with_(8, ([mx.zeros((32, 128))], 0, 0))], **shape)
    with pytest.raises(ValueError, match="float32 x"):
        ext.decoder_layers(run_, x.astype(mx.float16), pools[:2], pools[2:], pos, *meta,
                           tiled=True)
    with pytest.raises(ValueError, match="a k and a v pool for each layer"):
        ext.decoder_layers(run_, x, pools[:1], pools[2:3], pos, *meta, tiled=True)
    with pytest.raises(ValueError, match="pools"):
        ext.decoder_layers(run_, x, [pools[0], mx.zeros((4, 16, 1, 16))], pools[2:], pos, *meta,
                           tiled=True)
    with pytest.raises(ValueError, match="int32"):
        ext.decoder_layers(run_, x, pools[:2], pools[2:], pos, meta[0].astype(mx.float32),
                           *meta[1:], tiled=True)


def test_the_kernel_clocks_count_each_phase_of_a_step_once(smollm_tokenizer):
    import time

    from tiny_llm.engine import LLMEngine
    from tiny_llm.kernels import cpu_fused
    from tiny_llm.kernels.extension import reference_extension
    from tiny_llm.testing.runs import greedy

    ext = reference_extension()
    engine = LLMEngine(model_of("llama"), smollm_tokenizer, num_pages=64)
    for prompt in ([5, 6, 7], [8, 9, 10, 11]):
        engine.add_request({"prompt_token_ids": prompt}, greedy(6))
    engine.step()  # the prompts: op by op
    before = cpu_fused.fused_layers_run
    ext.profile(True)
    start = time.perf_counter()
    engine.step()
    wall = time.perf_counter() - start
    totals = ext.profile_totals()
    ext.profile(False)
    assert cpu_fused.fused_layers_run > before  # a fused step
    phases = ["projections", "attention", "kv_write", "vector_ops", "thread_wait"]
    assert all(totals[p] > 0 for p in phases[:4]), totals
    assert sum(totals[p] for p in phases) < wall  # exclusive: nothing counted twice
    assert totals["pool_jobs"] + totals["solo_jobs"] > 0
    engine.step()  # off: nothing counts
    assert ext.profile_totals() == totals


def test_the_pools_helper_threads_do_not_count():
    """A product spread over the pool: the clocks count the calling thread's wall time, not
    the cores' time (with both threads counted, the projections would take about twice the
    wall time)."""
    import os
    import time

    from tiny_llm.kernels.extension import reference_extension

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: no helper threads")
    ext = reference_extension()
    x, w = mx.random.normal((256, 512)), mx.random.normal((1024, 512))
    mx.eval(x, w)
    ext.profile(True)
    start = time.perf_counter()
    mx.eval(ext.linear(x, w))
    wall = time.perf_counter() - start
    totals = ext.profile_totals()
    ext.profile(False)
    assert totals["pool_jobs"] == 1 and totals["solo_jobs"] == 0
    assert 0 < totals["projections"] + totals["thread_wait"] <= wall
