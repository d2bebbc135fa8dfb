"""tiny_llm.models.model against mlx-lm's model classes (the model oracle).

Every test builds a tiny random model of one family, gives mlx-lm's class of the same
family exactly the same weights (parameter names are shared), and compares logits: over a
40-token prompt in one forward, over decode steps with each side's own KV cache (on MLX's
ops, and again with the engine's CPU kernels: the decode matmul, RoPE and SwiGLU of
``cpu_kernels.py``), with quantized weights, in chunks, with RoPE scaling and in half
precision. Weights are scaled
so that logits spread over several units (asserted), so a wrong detail cannot hide in
near-constant outputs.
"""

from __future__ import annotations

from tiny_llm.kernels.cpu_kernels import KernelPlan, kernels_available
from tiny_llm.models.loader import build_model, on_cpu
from tiny_llm.models.model import Model, ModelConfig
from tiny_llm.step.dense_kv import DenseKVCache
from tiny_llm.testing.models import mlx_lm_model, random_weights

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import cache as lm_cache

PROMPT_LEN = 40
DECODE_STEPS = 10
ATOL = 1e-4  # ours vs mlx-lm at float32

# Tiny configs covering each family's switches. qwen3: q/k norm, explicit head_dim (32) that
# differs from hidden / heads (16), tied embeddings. qwen2: q/k/v biases, untied. llama:
# untied, plain. GQA ratios 2, 4 and 1 (MHA), and 4 with 8 query heads.
BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
)
CONFIGS = {
    "qwen3-gqa2-hd32-tied": dict(BASE, model_type="qwen3", head_dim=32, tie_word_embeddings=True),
    "qwen2-gqa4-bias-untied": dict(
        BASE, model_type="qwen2", num_key_value_heads=1, tie_word_embeddings=False
    ),
    "llama-mha-untied": dict(
        BASE, model_type="llama", num_key_value_heads=4, tie_word_embeddings=False
    ),
    "llama-gqa4-tied": dict(
        BASE,
        model_type="llama",
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    ),
}


# ---------------------------------------------------------------------------------------------
# helpers


reference_model = mlx_lm_model


def build_pair(name: str, **overrides) -> tuple[Model, nn.Module, list[tuple[str, mx.array]]]:
    """Our model and mlx-lm's, loaded with the same random float32 weights."""
    hf = dict(CONFIGS[name], **overrides)
    ref = reference_model(hf)
    ours = Model(ModelConfig.from_hf(hf))
    weights = random_weights(ref)
    ours_names = {k for k, _ in tree_flatten(ours.parameters())}
    assert ours_names == {k for k, _ in weights}, "parameter names must match mlx-lm's"
    ref.load_weights(weights)
    ours.load_weights(weights)
    mx.eval(ref.parameters(), ours.parameters())
    return ours, ref, weights


def prompt(n: int = PROMPT_LEN, vocab: int = 256, seed: int = 1) -> mx.array:
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(seed)).astype(mx.int32)


def forward(model: Model, tokens: mx.array, start: int = 0, cache=None) -> mx.array:
    cache = cache if cache is not None else DenseKVCache(model.config.num_hidden_layers)
    positions = mx.arange(start, start + tokens.shape[0])
    return model(tokens, positions, cache)


def max_diff(a: mx.array, b: mx.array) -> float:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def assert_nontrivial(logits: mx.array) -> None:
    """Logits that a wrong model could not match by accident: spread out, varying by row."""
    assert logits.std().item() > 0.5
    assert len(set(mx.argmax(logits, axis=-1).tolist())) > 3


def compare_prompt_and_decode(ours: Model, ref: nn.Module, atol: float = ATOL,
                              decode_kernel: bool = False, int8: bool = False,
                              decode_rtol: float | None = None) -> None:
    """One prompt forward, then DECODE_STEPS greedy steps, ours vs mlx-lm, each with its cache;
    with ``decode_kernel`` the decode steps' matmuls take the extension's kernel as the
    engine's decode rows do (``tiny_llm/kernels/cpu_kernels.py``), with ``int8`` in int8
    activations; ``decode_rtol``: the decode steps' logits within that fraction of their
    largest magnitude (else within ``atol``)."""
    tokens = prompt(vocab=ours.config.vocab_size)
    ref_cache = lm_cache.make_prompt_cache(ref)
    our_cache = DenseKVCache(ours.config.num_hidden_layers)
    expected = ref(tokens[None], cache=ref_cache)[0]
    got = forward(ours, tokens, cache=our_cache)
    assert got.shape == (PROMPT_LEN, ours.config.vocab_size)
    assert_nontrivial(expected)
    assert max_diff(got, expected) <= atol, "prompt logits differ from mlx-lm"

    token = mx.argmax(expected[-1:], axis=-1).astype(mx.int32)
    # As the model runner plans a step: the kernels serve where the CPU is the device.
    kernels = KernelPlan(1, int8) if decode_kernel and kernels_available() else None
    for step in range(DECODE_STEPS):
        expected = ref(token[None], cache=ref_cache)[0]
        got = ours(token, mx.array([PROMPT_LEN + step]), our_cache, kernels=kernels)
        assert got.shape == (1, ours.config.vocab_size)
        tolerance = atol if decode_rtol is None else decode_rtol * mx.abs(expected).max().item()
        assert max_diff(got, expected) <= tolerance, f"decode step {step} differs from mlx-lm"
        token = mx.argmax(expected, axis=-1).astype(mx.int32)
    assert our_cache.length == PROMPT_LEN + DECODE_STEPS
    assert ref_cache[0].offset == PROMPT_LEN + DECODE_STEPS


# ---------------------------------------------------------------------------------------------
# float32 equivalence with mlx-lm


@pytest.mark.parametrize("decode_kernel", [False, True], ids=["mlx-matmul", "decode-kernel"])
@pytest.mark.parametrize("name", CONFIGS)
def test_matches_mlx_lm_prompt_and_decode(name, decode_kernel, request):
    if decode_kernel:  # the extension's kernels serve CPU streams: on a Mac, its CPU
        request.getfixturevalue("cpu_device")
    ours, ref, _ = build_pair(name)
    compare_prompt_and_decode(ours, ref, decode_kernel=decode_kernel)


def test_configs_exercise_each_switch():
    """The families really differ where the tests claim (a guard on CONFIGS themselves)."""
    q3 = ModelConfig.from_hf(CONFIGS["qwen3-gqa2-hd32-tied"])
    assert q3.qk_norm and q3.tie_word_embeddings and q3.head_dim == 32 != 64 // 4
    q2 = ModelConfig.from_hf(CONFIGS["qwen2-gqa4-bias-untied"])
    assert q2.attention_bias and not q2.tie_word_embeddings and q2.num_queries_per_kv == 4
    ll = ModelConfig.from_hf(CONFIGS["llama-mha-untied"])
    assert not (ll.qk_norm or ll.attention_bias or ll.tie_word_embeddings)
    assert ll.num_queries_per_kv == 1
    names = {k for k, _ in tree_flatten(Model(q3).parameters())}
    assert "model.layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" not in names
    names = {k for k, _ in tree_flatten(Model(q2).parameters())}
    assert "model.layers.1.self_attn.v_proj.bias" in names and "lm_head.weight" in names


# ---------------------------------------------------------------------------------------------
# quantized weights


@pytest.mark.parametrize("group_size, bits", [(32, 4), (64, 4), (64, 8)])
@pytest.mark.parametrize("name", CONFIGS)
def test_quantized_matches_mlx_lm(name, group_size, bits):
    ours, ref, _ = build_pair(name)
    float_logits = forward(ours, prompt())
    nn.quantize(ref, group_size=group_size, bits=bits)
    nn.quantize(ours, group_size=group_size, bits=bits)
    ref_params = dict(tree_flatten(ref.parameters()))
    our_params = dict(tree_flatten(ours.parameters()))
    assert ref_params.keys() == our_params.keys()
    assert "model.embed_tokens.scales" in our_params
    assert our_params["model.layers.0.mlp.up_proj.weight"].dtype == mx.uint32
    # Same float weights quantize identically; load mlx-lm's anyway so both use one set.
    ours.load_weights(list(ref_params.items()))
    # The decode steps take the extension's quantized kernel (the engine's decode rows).
    compare_prompt_and_decode(ours, ref, decode_kernel=True)
    # Quantization changed the model (so the comparison above is about quantized weights).
    assert max_diff(forward(ours, prompt()), float_logits) > 1e-2


# Int8 activations round each decode row to int8 per 32 values (steps of 1/127 of the
# group's largest |x|), and every layer adds its rounding: the stated tolerance, against
# mlx-lm's float products, is a tenth of the largest logit (these tiny random models,
# hidden size 64, came to 0.079 at most).
INT8_RTOL = 0.1


@pytest.mark.parametrize("group_size, bits", [(32, 4), (64, 8)])
@pytest.mark.parametrize("name", CONFIGS)
def test_int8_activations_match_mlx_lm_within_the_stated_tolerance(name, group_size, bits,
                                                                  cpu_device):
    ours, ref, _ = build_pair(name)
    nn.quantize(ref, group_size=group_size, bits=bits)
    nn.quantize(ours, group_size=group_size, bits=bits)
    ours.load_weights(list(tree_flatten(ref.parameters())))
    compare_prompt_and_decode(ours, ref, decode_kernel=True, int8=True, decode_rtol=INT8_RTOL)
    # The rounding is real (the test above holds the float kernel to 1e-4).
    tokens = mx.array([5, 17, 3], dtype=mx.int32)
    cache = DenseKVCache(ours.config.num_hidden_layers)
    forward(ours, tokens[:2], cache=cache)
    rounded = ours(tokens[2:], mx.array([2]), cache, kernels=KernelPlan(1, int8=True))
    assert max_diff(rounded, ref(tokens[None])[0, -1:]) > 1e-4


def quantize_tensor(w: mx.array, group_size: int, bits: int) -> dict[str, mx.array]:
    """One tensor as a checkpoint stores it: packed uint32 plus float16 scales and biases."""
    q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    return {"weight": q, "scales": scales.astype(mx.float16), "biases": biases.astype(mx.float16)}


# (group_size, bits) per module kind: 8-bit embedding, 4-bit linears, a 4-bit head in groups of
# 32 where the head is untied, as GGUF files and mixed-precision MLX checkpoints do.
MIXED = {"embed_tokens": (32, 8), "lm_head": (32, 4), "proj": (64, 4)}


def mixed_quantized_checkpoint(weights: list[tuple[str, mx.array]]) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for name, w in weights:
        module, _, kind = name.rpartition(".")
        spec = next((v for k, v in MIXED.items() if module.endswith(k)), None)
        if kind != "weight" or spec is None:
            out[name] = w
            continue
        for part, tensor in quantize_tensor(w, *spec).items():
            out[f"{module}.{part}"] = tensor
    return out


def exact_dequantized(checkpoint: dict[str, mx.array]) -> list[tuple[str, mx.array]]:
    """The float32 weights a quantized checkpoint stands for: scale * q + bias, in float32."""
    out = []
    for name, w in checkpoint.items():
        module, _, kind = name.rpartition(".")
        if kind in ("scales", "biases"):
            continue
        if kind == "weight" and f"{module}.scales" in checkpoint:
            scales = checkpoint[f"{module}.scales"].astype(mx.float32)
            biases = checkpoint[f"{module}.biases"].astype(mx.float32)
            group_size, bits = next(v for k, v in MIXED.items() if module.endswith(k))
            w = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
        out.append((name, w))
    return out


@pytest.mark.parametrize("name", ["qwen3-gqa2-hd32-tied", "qwen2-gqa4-bias-untied"])
def test_build_model_infers_mixed_quantization(name):
    hf = CONFIGS[name]
    config = ModelConfig.from_hf(hf)
    weights = random_weights(reference_model(hf))
    checkpoint = mixed_quantized_checkpoint(weights)
    assert checkpoint["model.embed_tokens.weight"].shape == (256, 64 * 8 // 32)
    tokens = prompt()

    # dequantize=True: plain float32 layers holding exactly scale * q + bias.
    deq = build_model(config, checkpoint, dtype=mx.float32, dequantize=True)
    expected = dict(exact_dequantized(checkpoint))
    got = dict(tree_flatten(deq.parameters()))
    assert got.keys() == expected.keys()
    for k, v in got.items():
        assert v.dtype == mx.float32, k
        assert mx.array_equal(v, expected[k]), f"{k} is not the exact float32 dequantization"
    assert not any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in deq.modules()
    )
    ref = reference_model(hf)
    ref.load_weights(list(expected.items()))
    deq_logits = forward(deq, tokens)
    assert_nontrivial(deq_logits)
    assert max_diff(deq_logits, ref(tokens[None])[0]) <= ATOL

    # dequantize=False: bits and group size inferred per tensor, the same as mlx-lm quantized
    # with the same per-module settings.
    quant = build_model(config, checkpoint, dtype=mx.float32, dequantize=False)
    layers = dict(quant.named_modules())
    embed = layers["model.embed_tokens"]
    assert isinstance(embed, nn.QuantizedEmbedding) and (embed.bits, embed.group_size) == (8, 32)
    down = layers["model.layers.1.mlp.down_proj"]
    assert isinstance(down, nn.QuantizedLinear) and (down.bits, down.group_size) == (4, 64)
    if not config.tie_word_embeddings:
        head = layers["lm_head"]
        assert isinstance(head, nn.QuantizedLinear) and (head.bits, head.group_size) == (4, 32)

    def predicate(path, module):
        spec = next((v for k, v in MIXED.items() if path.endswith(k)), None)
        return False if spec is None else {"group_size": spec[0], "bits": spec[1]}

    ref = reference_model(hf)
    nn.quantize(ref, class_predicate=predicate)
    ref.load_weights(
        [(k, v if v.dtype == mx.uint32 else v.astype(mx.float32)) for k, v in checkpoint.items()]
    )
    quant_logits = forward(quant, tokens)
    assert max_diff(quant_logits, ref(tokens[None])[0]) <= ATOL
    # The same numbers either way: only the matmul's summation order differs.
    assert max_diff(quant_logits, deq_logits) <= 1e-3

    # On the CPU the scales and biases stay as stored (float16) and are widened as the
    # kernels read them: the bits of a model built from float32 copies of them.
    if on_cpu():
        assert embed.scales.dtype == down.biases.dtype == mx.float16
        copies = {k: v.astype(mx.float32) if k.endswith((".scales", ".biases")) else v
                  for k, v in checkpoint.items()}
        wide = build_model(config, copies, dtype=mx.float32, dequantize=False)
        assert dict(wide.named_modules())["model.embed_tokens"].scales.dtype == mx.float32
        assert mx.array_equal(forward(wide, tokens), quant_logits)
    else:  # elsewhere they take the model's dtype, as MLX's kernels expect
        assert embed.scales.dtype == down.biases.dtype == mx.float32


# ---------------------------------------------------------------------------------------------
# logit_rows, chunked prefill


@pytest.mark.parametrize("name", ["qwen3-gqa2-hd32-tied", "llama-mha-untied"])
def test_logit_rows_select_rows_of_full_output(name):
    ours, _, _ = build_pair(name)
    tokens = prompt()
    full = forward(ours, tokens)
    for rows in ([39], [0, 17, 39], [39, 5, 5, 0]):
        cache = DenseKVCache(ours.config.num_hidden_layers)
        got = ours(tokens, mx.arange(PROMPT_LEN), cache, mx.array(rows, dtype=mx.int32))
        assert got.shape == (len(rows), ours.config.vocab_size)
        assert max_diff(got, full[mx.array(rows)]) <= 1e-5
        assert cache.length == PROMPT_LEN  # every row still went through attention


@pytest.mark.parametrize("chunk", [1, 3, 16])
@pytest.mark.parametrize("name", CONFIGS)
def test_chunked_prompt_equals_one_shot(name, chunk):
    ours, _, _ = build_pair(name)
    tokens = prompt()
    full = forward(ours, tokens)
    cache = DenseKVCache(ours.config.num_hidden_layers)
    parts = []
    for start in range(0, PROMPT_LEN, chunk):
        end = min(start + chunk, PROMPT_LEN)
        parts.append(ours(tokens[start:end], mx.arange(start, end), cache))
        assert cache.length == end
    # 1e-5 relative to the logits' scale: the same math, but OpenBLAS takes another GEMM
    # kernel for 16 rows or more, which moves float32 results by ~10 ulps;
    # with the wheel's reference BLAS (TINY_LLM_NO_OPENBLAS=1) this holds at 1e-5 absolute.
    assert max_diff(mx.concatenate(parts), full) <= 1e-5 * max(1.0, mx.abs(full).max().item())


# ---------------------------------------------------------------------------------------------
# RoPE scaling


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small enough that head_dim 32 with theta 1e4 has high, medium and low frequency bands
    # (wavelengths 6.3 .. 3.5e4 against thresholds 16 and 64), so every branch is used.
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "scaling",
    [LLAMA3_SCALING, {"rope_type": "linear", "factor": 4.0}, {"type": "linear", "factor": 4.0}],
    ids=["llama3", "linear", "linear-legacy-key"],
)
def test_rope_scaling_matches_mlx_lm(scaling):
    overrides = dict(head_dim=32, num_attention_heads=2, num_key_value_heads=1)
    ours, ref, weights = build_pair("llama-mha-untied", rope_scaling=scaling, **overrides)
    compare_prompt_and_decode(ours, ref)
    # The scaling is not a no-op: the same weights without it give other logits.
    plain = Model(ModelConfig.from_hf(dict(CONFIGS["llama-mha-untied"], **overrides)))
    plain.load_weights(weights)
    assert max_diff(forward(plain, prompt()), forward(ours, prompt())) > 0.1


def test_llama3_frequencies_cover_all_bands():
    from tiny_llm.models.model import rope_frequencies

    config = ModelConfig.from_hf(
        dict(CONFIGS["llama-mha-untied"], head_dim=32, rope_scaling=LLAMA3_SCALING)
    )
    scaled = rope_frequencies(config)
    base = 10000.0 ** (mx.arange(0, 32, 2, dtype=mx.float32) / 32)
    ratio = (scaled / base).tolist()
    assert ratio[0] == pytest.approx(1.0)  # high frequency: untouched
    assert ratio[-1] == pytest.approx(8.0)  # low frequency: wavelength scaled by the factor
    assert any(1.01 < r < 7.99 for r in ratio)  # medium: smoothly interpolated
    assert ratio == sorted(ratio)


# ---------------------------------------------------------------------------------------------
# half precision


# float16 keeps 11 significant bits (relative rounding 2^-11 ~ 5e-4), bfloat16 8 (~4e-3).
# Rounding weights and activations through two layers, the norms and the vocab projection
# adds up to several times that. Measured on these configs, relative to the float32 logits:
# max error / max |logit| <= 0.005 (float16), 0.045 (bfloat16); RMS error / logit std <=
# 0.003 and 0.025. The bounds below leave 3-4x margin; a real bug (wrong RoPE, mask, norm)
# moves logits by O(1) of their spread, far beyond them.
HALF_TOL = {mx.float16: (0.02, 0.01), mx.bfloat16: (0.15, 0.08)}  # (max, rms), relative


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["qwen3-gqa2-hd32-tied", "qwen2-gqa4-bias-untied"])
def test_half_precision_stays_close_to_float32(name, dtype):
    hf = CONFIGS[name]
    config = ModelConfig.from_hf(hf)
    weights = dict(random_weights(reference_model(hf)))
    tokens = prompt()
    reference = forward(build_model(config, weights, dtype=mx.float32, dequantize=True), tokens)

    model = build_model(config, weights, dtype=dtype, dequantize=True)
    assert model.dtype == dtype
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {dtype}
    cache = DenseKVCache(config.num_hidden_layers)
    logits = forward(model, tokens, cache=cache)
    assert logits.dtype == dtype and cache.keys[0].dtype == dtype
    # decode one more step in half precision too
    step = model(tokens[:1], mx.array([PROMPT_LEN]), cache)
    assert step.dtype == dtype and cache.length == PROMPT_LEN + 1

    max_tol, rms_tol = HALF_TOL[dtype]
    scale = mx.abs(reference).max().item()
    err = max_diff(logits, reference)
    assert err <= max_tol * scale, f"max error {err} vs logit scale {scale}"
    rms_err = mx.sqrt(mx.mean((logits.astype(mx.float32) - reference) ** 2)).item()
    assert rms_err <= rms_tol * reference.std().item()
