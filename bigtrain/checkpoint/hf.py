"""The Hugging Face Llama format: a folder with ``config.json`` and ``model.safetensors`` that
``transformers.AutoModelForCausalLM.from_pretrained`` reads, written from bigtrain's weights and read
back into them (``model.init_from = "hf:PATH"``). No network, and no ``transformers`` import: the
format is plain JSON and safetensors.

Two architectures: ``llama`` (LlamaForCausalLM: ``attention_bias`` on q, k, v and o, ``mlp_bias``,
``head_dim``, ``rope_scaling`` of type linear, llama3 or yarn) and ``qwen2`` (Qwen2ForCausalLM: the
same decoder with biases on q, k and v only: bigtrain's ``model.qkv_bias``).

Two conventions differ. Names: ``layers.0.attention.wq.weight`` is
``model.layers.0.self_attn.q_proj.weight`` and so on (:data:`LAYER_NAMES`). Rotary pairs: bigtrain
rotates interleaved pairs (x[2i], x[2i+1]) of each head (Meta's original Llama); Hugging Face
rotates halves (x[i], x[i + head_dim/2]). The same model in the other convention has the rows of
each head of wq and wk reordered: even rows first, then odd ones (:func:`to_rotate_half`). The
reordering is a permutation, so export then import gives back the very same bits.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from bigtrain.config import ModelConfig, canonical_keys

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"

# bigtrain name inside a block -> Hugging Face name inside ``model.layers.N``.
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "feed_forward.w1.bias": "mlp.gate_proj.bias",
    "feed_forward.w3.bias": "mlp.up_proj.bias",
    "feed_forward.w2.bias": "mlp.down_proj.bias",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


class HFFormatError(ValueError):
    """A folder that is not a Llama model bigtrain can load; the message says what differs."""


def hf_name(name: str) -> str:
    """bigtrain's canonical parameter name -> the Hugging Face Llama name."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    raise HFFormatError(f"parameter '{name}' has no Hugging Face Llama counterpart")


def to_rotate_half(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of wq / wk (or entries of their biases) from interleaved rotary pairs to rotate-half
    order, per head."""
    matrix = weight if weight.dim() == 2 else weight[:, None]
    rows, cols = matrix.shape
    return matrix.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(weight.shape)


def from_rotate_half(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`to_rotate_half`."""
    matrix = weight if weight.dim() == 2 else weight[:, None]
    rows, cols = matrix.shape
    return matrix.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(weight.shape)


def _rotary_heads(name: str, cfg: ModelConfig) -> int | None:
    """Heads whose rotary pairs a weight's rows (a bias's entries) hold (None where rotary does not act)."""
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return cfg.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return cfg.kv_heads
    return None


def model_config(values: dict) -> ModelConfig:
    """The ModelConfig a checkpoint's manifest recorded (fields newer than it keep their defaults)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    values = canonical_keys("model", values, "the checkpoint's manifest")  # older manifests: model.name
    return ModelConfig(**{k: v for k, v in values.items() if k in known})


@contextmanager
def model_as_trained(meta: dict) -> Iterator[ModelConfig]:
    """The [model] a checkpoint's manifest recorded, its family's description (a config.json at
    ``model.hf_config``) the one the run trained with, recorded in the manifest: a file edited,
    moved or deleted since would build another model (export, generate). Inside the context only:
    the recorded copy is a temporary file."""
    cfg = model_config(meta["config"]["model"])
    described = meta.get("model_description")
    if not described:  # a family described by its config alone, or a checkpoint older than the record
        yield cfg
        return
    with tempfile.TemporaryDirectory(prefix="bigtrain-described-") as folder:
        path = Path(folder) / CONFIG_FILE
        path.write_text(json.dumps(described, indent=2))
        yield dataclasses.replace(cfg, hf_config=str(path))


def hf_rope_scaling(cfg: ModelConfig) -> dict | None:
    """``rope_scaling`` of ``config.json`` (None without scaling)."""
    kind = cfg.rope_scaling
    if kind == "none":
        return None
    out = {"rope_type": kind, "factor": cfg.rope_factor}
    if kind == "llama3":
        out.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                   original_max_position_embeddings=cfg.rope_original_max_len)
    elif kind == "yarn":
        out.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow)
        if cfg.rope_original_max_len:
            out["original_max_position_embeddings"] = cfg.rope_original_max_len
        if cfg.rope_attention_factor:
            out["attention_factor"] = cfg.rope_attention_factor
    return out


def hf_architecture(cfg: ModelConfig) -> str:
    """'qwen2' for biases on q, k, v alone (Qwen2's attention), else 'llama'."""
    if any(cfg.is_moe_block(i) for i in range(cfg.n_layers)):
        raise HFFormatError(f"model.moe_experts = {cfg.moe_experts}: bigtrain's MoE Llama has no Hugging Face "
                            f"architecture; export its weights with --format safetensors (or train a Mixtral or "
                            f"Qwen-MoE config.json with model.family = 'hf', which exports to Hugging Face)")
    if cfg.qkv_bias and not cfg.attention_bias:
        if cfg.mlp_bias:
            raise HFFormatError("model.qkv_bias with model.mlp_bias has no Hugging Face architecture (Qwen2 has no "
                                "MLP biases; Llama's attention_bias includes the output projection's)")
        return "qwen2"
    return "llama"


def hf_config(cfg: ModelConfig, special: dict[str, int] | None = None) -> dict:
    """``config.json`` for ``cfg``: every field LlamaConfig (or Qwen2Config) needs, nothing
    run-specific (so the same weights always give the same file) but the tokenizer's ``special``
    ``bos_token_id`` / ``eos_token_id`` (those it has)."""
    arch = hf_architecture(cfg)
    out = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"], "model_type": arch,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta, "rope_scaling": hf_rope_scaling(cfg),
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "initializer_range": cfg.init_std,
        # None where the tokenizer has no such token (a byte-level vocabulary has none).
        "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32", **(special or {}),
    }
    if arch == "qwen2":
        out.update(use_sliding_window=False, max_window_layers=cfg.n_layers)
    else:
        out.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
    return out


def to_hf(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """bigtrain's full weights by canonical name -> Hugging Face's (a tied head written once, as the
    embedding, which is what ``tie_word_embeddings`` loads)."""
    out = {}
    for name, tensor in weights.items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        heads = _rotary_heads(name, cfg)
        out[hf_name(name)] = (to_rotate_half(tensor, heads) if heads else tensor).contiguous()
    return out


def save_hf(weights: dict[str, torch.Tensor], cfg: ModelConfig, out: Path,
            special: dict[str, int] | None = None) -> Path:
    """Write the folder ``out`` (config.json, with the tokenizer's ``special`` token ids, and
    model.safetensors); returns it. A model the format
    cannot hold (an MoE Llama) is refused before anything is written: a config.json left alone in
    the folder (or over an earlier export's) would be read as a model."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ValueError("--format hf writes safetensors: pip install safetensors") from None
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; --format hf writes a folder: give a folder name")
    config, tensors = hf_config(cfg, special), to_hf(weights, cfg)  # each raises HFFormatError for what it cannot hold
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    readable_as_umask(out / WEIGHTS_FILE)
    return out


def readable_as_umask(path: Path) -> None:
    """Give ``path`` the mode a new file gets here (0644 under the usual umask): safetensors writes
    through a private temporary file (0600), which another user (a serving job) could not read."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


# -- import -----------------------------------------------------------------------------------
def read_hf_config(folder: str | Path) -> dict:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise HFFormatError(f"{folder} is not a Hugging Face model folder: {path} does not exist")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise HFFormatError(f"{path} is not valid JSON: {e}") from None


LLAMA_MODEL_TYPES = ("llama", "qwen2")  # the config.json model_types bigtrain's Llama reads


def other_family_hint(folder: str | Path) -> str:
    """What to set when ``model.init_from = "hf:FOLDER"`` names a decoder bigtrain's Llama does not
    read (a Qwen3, Mistral or Mixtral folder): the ``hf`` family builds it with transformers from
    the folder's config.json. '' for a folder of a type the Llama reads (its own problems say why)."""
    try:
        model_type = read_hf_config(folder).get("model_type", "llama")
    except HFFormatError:
        return ""
    if model_type in LLAMA_MODEL_TYPES:
        return ""
    return (f"; a '{model_type}' model trains as model.family = 'hf', built by transformers from its config.json: "
            f"add --model.family=hf --model.hf_config={shlex.quote(str(folder))}")


ROPE_KEYS = {"linear": {"factor"}, "llama3": {"factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings"},
             "yarn": {"factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "attention_factor",
                      "mscale", "mscale_all_dim", "truncate"}}


def _yarn_attention_factor(rope: dict) -> float:
    """YaRN's factor on cos and sin as Hugging Face derives it; 0 (bigtrain's default formula) when
    it is that default."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    mscale, mscale_all_dim, factor = rope.get("mscale"), rope.get("mscale_all_dim"), float(rope["factor"])
    if not (mscale and mscale_all_dim):
        return 0.0

    def get_mscale(scale: float, m: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))


def rope_values(rope, problems: list[str]) -> dict[str, object]:
    """bigtrain's rope_* fields for a ``rope_scaling`` entry (appends what it cannot represent)."""
    if not rope:
        return {"rope_scaling": "none"}
    if not isinstance(rope, dict):
        problems.append(f"rope_scaling = {rope!r} is not a table")
        return {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "default":
        return {"rope_scaling": "none"}
    if kind not in ROPE_KEYS:
        problems.append(f"rope_scaling type {kind!r}; bigtrain has 'linear', 'llama3' and 'yarn'")
        return {}
    missing = [k for k in ("factor",) + (("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                                         if kind == "llama3" else ()) if rope.get(k) is None]
    if missing:
        problems.append(f"rope_scaling ({kind}) without {', '.join(missing)}")
        return {}
    if kind == "yarn" and rope.get("truncate", True) is False:
        problems.append("rope_scaling (yarn) with truncate = false; bigtrain's YaRN truncates the ramp's bounds")
    values = {"rope_scaling": kind, "rope_factor": float(rope["factor"])}
    if kind == "llama3":
        values.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]),
                      rope_original_max_len=int(rope["original_max_position_embeddings"]))
    elif kind == "yarn":
        values.update(rope_beta_fast=float(rope.get("beta_fast") or 32), rope_beta_slow=float(rope.get("beta_slow") or 1),
                      rope_original_max_len=int(rope.get("original_max_position_embeddings") or 0),
                      rope_attention_factor=_yarn_attention_factor(rope))
    return values


def rope_scaling_and_theta(hf: dict) -> tuple[dict | None, float]:
    """(``rope_scaling``, ``rope_theta``) of a ``config.json`` as transformers 4 writes them, or read
    from transformers 5's ``rope_parameters`` (one table holding both; type 'default' is no scaling)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        scaling = None if params.get("rope_type", params.get("type", "default")) == "default" else params
        return scaling, float(params.get("rope_theta", hf.get("rope_theta", 1e4)))
    return hf.get("rope_scaling"), float(hf.get("rope_theta", 1e4))


# max_position_embeddings where a config.json leaves it out: transformers' default of its model type
# (a Qwen2 file without it got 2048 here and 32768 there, which yarn without an original length reads).
DEFAULT_POSITIONS = {"llama": 2048, "qwen2": 32768}


def model_values(hf: dict, where: str) -> dict[str, object]:
    """The ``[model]`` fields a Hugging Face Llama or Qwen2 ``config.json`` sets; raises
    HFFormatError for what bigtrain's Llama does not have (other activations, other rotary
    scalings, partial rotary embeddings, sliding windows, attention dropout)."""
    problems = []
    arch = hf.get("model_type", "llama")
    if arch not in LLAMA_MODEL_TYPES:
        problems.append(f"model_type = {arch!r}, not 'llama' or 'qwen2'")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {hf['hidden_act']!r}; bigtrain's MLP is SwiGLU ('silu')")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor = {hf['partial_rotary_factor']}; bigtrain rotates whole heads")
    if arch == "qwen2" and hf.get("use_sliding_window"):
        problems.append("use_sliding_window = true; bigtrain's attention is full causal attention")
    if float(hf.get("attention_dropout") or 0.0) > 0:  # fine-tuned without it, not a word: refused, as model.family = 'hf' does
        problems.append(f"attention_dropout = {float(hf['attention_dropout']):g}; bigtrain's Llama trains without "
                        f"dropout (set \"attention_dropout\": 0.0 in its config.json to fine-tune without it)")
    if quantized := quantized_problem(hf):
        problems.append(quantized)
    scaling, theta = rope_scaling_and_theta(hf)
    rope = rope_values(scaling, problems)
    heads = hf.get("num_attention_heads", 0)
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in hf]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if problems:
        raise HFFormatError(f"{where}: cannot load into bigtrain's Llama: {'; '.join(problems)}")
    head_dim = hf.get("head_dim")
    own_head_dim = 0 if head_dim in (None, hf["hidden_size"] // heads) else int(head_dim)
    return {"family": "llama", "vocab_size": hf["vocab_size"], "dim": hf["hidden_size"],
            "n_layers": hf["num_hidden_layers"], "n_heads": heads,
            "n_kv_heads": hf.get("num_key_value_heads") or heads, "ffn_hidden": hf["intermediate_size"],
            "max_seq_len": hf.get("max_position_embeddings", DEFAULT_POSITIONS[arch]), "rope_theta": theta,
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "tie_embeddings": bool(hf.get("tie_word_embeddings")),
            "attention_head_dim": own_head_dim,
            "attention_bias": arch == "llama" and bool(hf.get("attention_bias")),
            "qkv_bias": arch == "qwen2", "mlp_bias": arch == "llama" and bool(hf.get("mlp_bias")), **rope}


def hf_folder(init_from: str) -> Path | None:
    """The folder of ``model.init_from = "hf:PATH"`` (None when it names none)."""
    return Path(init_from[3:]).expanduser() if init_from.startswith("hf:") else None


# The config.json fields of a quantized checkpoint (transformers' and llm-compressor's older one):
# weights stored as float8 or int8 codes of the full shape, their scales in tensors beside them.
QUANTIZATION_FIELDS = ("quantization_config", "compression_config")


def quantized_problem(fields: dict) -> str | None:
    """Why a quantized checkpoint's config.json (an FP8 Qwen3, a compressed-tensors Llama) cannot be
    read: its weights have the model's shapes, so they loaded as plain values, unscaled (an FP8
    block-quantized folder: 5e3 off relative), and trained silently from them."""
    field = next((f for f in QUANTIZATION_FIELDS if fields.get(f)), None)
    if field is None:
        return None
    method = fields[field].get("quant_method", "?") if isinstance(fields[field], dict) else "?"
    return (f"{field} (quant_method {method!r}): the weights are stored quantized, their scales apart, which "
            f"bigtrain reads as plain values; use the model's unquantized (bf16 or fp32) checkpoint")


def float_weights(tensor: torch.Tensor, key: str, folder: Path) -> torch.Tensor:
    """``tensor`` in fp32; a float8 or integer tensor (quantized codes, whatever the config.json
    says) refused by name rather than read as values."""
    if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise HFFormatError(f"{folder}: '{key}' is stored as {tensor.dtype}, quantized codes rather than weights; "
                            f"use the model's unquantized (bf16 or fp32) checkpoint")
    return tensor.float()


def weights_problem(folder: Path) -> str | None:
    """Why ``folder`` holds no weights ``model.init_from`` reads (None when it has ``*.safetensors``):
    a folder of ``pytorch_model*.bin`` only (an older Hugging Face save) got a traceback from the
    ranks after launch; it is named before launch, with the line that converts it."""
    if any(folder.glob("*.safetensors")):
        return None
    pickled = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
    convert = (f": it holds {pickled[0]}{' and more' if len(pickled) > 1 else ''}, which bigtrain does not read (a "
               f"pickle); write safetensors beside it with transformers: python -c \"from transformers import "
               f"AutoModelForCausalLM as M; M.from_pretrained('{folder}').save_pretrained('{folder}')\"") if pickled else ""
    return f"{folder} holds no *.safetensors weights{convert}"


def architecture_problems(cfg: ModelConfig, folder: Path) -> list[str]:
    """How ``cfg`` differs from the folder's architecture, each with the override that fixes it."""
    values = model_values(read_hf_config(folder), str(folder / CONFIG_FILE))
    return [f"model.{k} = {getattr(cfg, k)!r}, but model.init_from's {folder / CONFIG_FILE} has {v!r}; "
            f"set --model.{k}={v} (or leave the [model] section to the folder)"
            for k, v in values.items() if getattr(cfg, k) != v and not (k == "n_kv_heads" and cfg.kv_heads == v)
            and not (k == "ffn_hidden" and cfg.ffn_dim == v)
            and not (k == "attention_head_dim" and v == 0 and cfg.head_dim == cfg.dim // max(1, cfg.n_heads))]


class HFWeights:
    """Initial values from a Hugging Face folder, by bigtrain name: what ``parallelize`` cuts each
    rank's shard from (``init_fn``). Tensors are read one at a time, lazily, from the mapped file."""

    def __init__(self, folder: str | Path, cfg: ModelConfig):
        from safetensors import safe_open

        self.folder, self.cfg = Path(folder), cfg
        problems = architecture_problems(cfg, self.folder)
        if problems:
            raise HFFormatError("; ".join(problems))
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise HFFormatError(f"{self.folder} holds no .safetensors file (only safetensors weights are read)")
        self._where = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                self._where.update({k: f for k in handle.keys()})

    def __call__(self, name: str, shape: tuple) -> torch.Tensor:
        from safetensors import safe_open

        if name == "output.weight" and self.cfg.tie_embeddings:
            name = "tok_embeddings.weight"
        key = hf_name(name)
        if key not in self._where:
            raise HFFormatError(f"{self.folder}: no tensor '{key}' (bigtrain's '{name}')")
        with safe_open(str(self._where[key]), framework="pt") as handle:
            tensor = float_weights(handle.get_tensor(key), key, self.folder)
        if tuple(tensor.shape) != tuple(shape):
            raise HFFormatError(f"{self.folder}: '{key}' has shape {tuple(tensor.shape)}, the model needs {tuple(shape)}")
        heads = _rotary_heads(name, self.cfg)
        return from_rotate_half(tensor, heads).contiguous() if heads else tensor


def initial_weights(cfg: ModelConfig) -> HFWeights | None:
    """``parallelize``'s ``init_fn`` for ``model.init_from`` (None: the model's own random init)."""
    folder = hf_folder(cfg.init_from)
    return HFWeights(folder, cfg) if folder is not None else None


class SafetensorsWeights:
    """Initial values from a Hugging Face folder's ``*.safetensors`` under the model's own names."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.folder, self._where = folder, {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as handle:
                self._where.update({k: f for k in handle.keys()})

    def __call__(self, name: str, shape: tuple) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._where:
            raise ValueError(f"model.init_from: {self.folder} has no tensor '{name}'")
        with safe_open(str(self._where[name]), framework="pt") as handle:
            tensor = float_weights(handle.get_tensor(name), name, self.folder)
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"model.init_from: '{name}' in {self.folder} has shape {tuple(tensor.shape)}, the "
                             f"model of model.hf_config needs {tuple(shape)}")
        return tensor
