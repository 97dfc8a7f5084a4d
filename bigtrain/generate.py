"""``bigtrain generate RUN_DIR --prompt TEXT --tokens N [--temperature T] [--top-k K] [--seed S]``:
what a trained model writes after a prompt.

One process, the whole model (as ``bigtrain export``): the newest valid checkpoint's weights, whatever
layout wrote them, in the plain Llama; or a Hugging Face folder (``config.json`` and
``*.safetensors``, as ``model.init_from = "hf:PATH"`` reads). The tokenizer is the one the byte-level
corpora use: a token is a byte of the UTF-8 text (vocabulary 256). Sampling: temperature 0 is greedy
(argmax); otherwise softmax(logits / temperature), over the ``top_k`` most likely tokens when
``top_k > 0``, drawn from a generator seeded with ``seed`` (same seed, same text). The context is the
last ``model.max_seq_len`` tokens (the rotary tables end there); no key/value cache: each new token
runs the model over the context again, which is what a small model on a CPU can afford.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bigtrain.config import ModelConfig
from bigtrain.models.llama import Llama, build_model

BYTE_VOCAB = 256


class GenerateError(ValueError):
    """A run directory or a setting that generation cannot use; the message says why."""


def load_model(source: Path) -> tuple[Llama, dict]:
    """The plain model with the weights of ``source`` (a run directory, its ``checkpoints/``, one
    checkpoint, or a Hugging Face folder), and the config the run recorded ({} for a folder)."""
    from bigtrain.checkpoint.hf import CONFIG_FILE

    source = Path(source)
    if not source.exists():
        raise GenerateError(f"{source} does not exist; give a run directory (runs/<name>)")
    if (source / CONFIG_FILE).is_file() and not (source / "checkpoints").is_dir():
        return _hf_model(source), {}
    from bigtrain.checkpoint.commit import newest_valid_checkpoint
    from bigtrain.checkpoint.export import checkpoint_weights
    from bigtrain.checkpoint.hf import model_config

    root = source / "checkpoints" if (source / "checkpoints").is_dir() else source
    found = newest_valid_checkpoint(root)
    if found is None:
        raise GenerateError(f"no valid checkpoint under {source} (a run saves one at its end unless "
                            f"checkpoint.save_final = false)")
    path, meta = found
    cfg = model_config(meta["config"]["model"])
    model = _plain_model(cfg)
    missing, _ = model.load_state_dict(checkpoint_weights(path), strict=False)
    missing = [m for m in missing if not (m == "output.weight" and cfg.tie_embeddings)]
    if missing:
        raise GenerateError(f"{path} lacks weights of the model it records: {', '.join(missing[:5])}")
    return model, meta["config"]


def _plain_model(cfg: ModelConfig) -> Llama:
    model = build_model(cfg, device="cpu")
    model.init_buffers()
    return model.eval()


def _hf_model(folder: Path) -> Llama:
    from bigtrain.checkpoint.hf import HFWeights, model_values, read_hf_config

    cfg = ModelConfig(**model_values(read_hf_config(folder), str(folder)))
    model = _plain_model(cfg)
    weights = HFWeights(folder, cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head is one parameter, visited once
            param.copy_(weights(name, tuple(param.shape)))
    return model


def check_byte_level(model: Llama, run_config: dict) -> None:
    """The prompt is encoded as bytes: the model must have been trained on bytes."""
    source = str(run_config.get("data", {}).get("source", ""))
    tokenizer = str(run_config.get("data", {}).get("tokenizer", "bytes"))
    if tokenizer != "bytes":
        raise GenerateError(f"generate reads and writes bytes; this model was trained with data.tokenizer = "
                            f"'{tokenizer}': export it (bigtrain export RUN OUT --format hf) and generate with "
                            f"transformers, whose AutoTokenizer loads that folder")
    if model.cfg.vocab_size != BYTE_VOCAB or source.endswith((".bin", ".npy")):
        raise GenerateError(f"generate reads and writes bytes (vocabulary {BYTE_VOCAB}); this model has "
                            f"model.vocab_size = {model.cfg.vocab_size}" +
                            (f" and was trained on pre-tokenized data ({source})" if source else ""))


@torch.no_grad()
def sample(model: Llama, prompt: list[int], tokens: int, temperature: float = 1.0, top_k: int = 0,
           seed: int = 0) -> list[int]:
    """``tokens`` new token ids after ``prompt`` (see the module's docstring for the rules)."""
    if not prompt:
        raise GenerateError("--prompt is empty; give at least one character to continue")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long)
    out = []
    for _ in range(tokens):
        logits = model(ids[:, -model.cfg.max_seq_len:])[0, -1].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = logits.topk(top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def check_settings(tokens: int, temperature: float, top_k: int) -> None:
    problems = []
    if tokens < 0:
        problems.append(f"--tokens = {tokens}: give a number of tokens >= 0")
    if not temperature >= 0 or temperature == float("inf"):
        problems.append(f"--temperature = {temperature}: give a finite value >= 0 (0: greedy)")
    if top_k < 0:
        problems.append(f"--top-k = {top_k}: give 0 (all tokens) or a positive count")
    if problems:
        raise GenerateError("; ".join(problems))


def generate_text(source: Path, prompt: str, tokens: int, temperature: float = 1.0, top_k: int = 0,
                  seed: int = 0) -> str:
    """The prompt and its continuation, as text (bytes that are not valid UTF-8 are shown as U+FFFD)."""
    check_settings(tokens, temperature, top_k)
    model, run_config = load_model(source)
    check_byte_level(model, run_config)
    ids = list(prompt.encode("utf-8"))
    new = sample(model, ids, tokens, temperature, top_k, seed)
    return bytes(ids + new).decode("utf-8", errors="replace")
