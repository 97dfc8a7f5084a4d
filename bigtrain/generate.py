"""``bigtrain generate RUN_DIR --prompt TEXT --tokens N [--temperature T] [--top-k K] [--seed S]``:
what a trained model writes after a prompt.

One process, the whole model (as ``bigtrain export``): the newest valid checkpoint's weights, whatever
layout wrote them, in the model the run's family builds (bigtrain's Llama; a Hugging Face decoder
through transformers: ``Family.generation_model``); or a Hugging Face Llama folder (``config.json``
and ``*.safetensors``, as ``model.init_from = "hf:PATH"`` reads) in bigtrain's Llama. The tokenizer is the run's
(``data.tokenizer``: its copy in the run directory) or the folder's ``tokenizer.json``, else bytes: a
token is a byte of the UTF-8 text (vocabulary 256). Sampling: temperature 0 is greedy
(argmax); otherwise softmax(logits / temperature), over the ``top_k`` most likely tokens when
``top_k > 0``, drawn from a generator seeded with ``seed`` (same seed, same text); it ends at the
model's end-of-text token, as transformers' ``generate()`` does (``--ignore-eos``: not). The context is the
last ``model.max_seq_len`` tokens (a config.json's ``max_position_embeddings``); no key/value cache: each new token
runs the model over the context again, which is what a small model on a CPU can afford.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from bigtrain.config import ModelConfig
from bigtrain.families import find_family
from bigtrain.families.own import none_for
from bigtrain.models.llama import build_model
from bigtrain.parallel.parallel_model import persistent_buffers

BYTE_VOCAB = 256


class GenerateError(ValueError):
    """A run directory or a setting that generation cannot use; the message says why."""


@dataclass
class Decoder:
    """What generation runs: ``model`` maps tokens (1, T) to logits (1, T, vocabulary)."""

    model: nn.Module
    vocab_size: int
    context: int  # the most tokens it reads at once (its rotary tables end there)

    def last_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The next token's logits (fp32) after the last ``context`` tokens of ``ids`` (1, T)."""
        return self.model(ids[:, -self.context:])[0, -1].float()


def load_model(source: Path) -> tuple[Decoder, dict]:
    """The whole model with the weights of ``source`` (a run directory, its ``checkpoints/``, one
    checkpoint, or a Hugging Face folder), and the config the run recorded ({} for a folder)."""
    from bigtrain.checkpoint.hf import CONFIG_FILE

    source = Path(source)
    if not source.exists():
        raise GenerateError(f"{source} does not exist; give a run directory (runs/<name>)")
    if (source / CONFIG_FILE).is_file() and not (source / "checkpoints").is_dir():
        return _hf_folder_model(source), {}
    from bigtrain.checkpoint.commit import newest_valid_checkpoint
    from bigtrain.checkpoint.export import checkpoint_weights
    from bigtrain.checkpoint.hf import model_as_trained

    root = source / "checkpoints" if (source / "checkpoints").is_dir() else source
    found = newest_valid_checkpoint(root)
    if found is None:
        raise GenerateError(f"no valid checkpoint under {source} (a run saves one at its end unless "
                            f"checkpoint.save_final = false)")
    path, meta = found
    with model_as_trained(meta) as model:  # a config.json as the run trained with it
        decoder = run_model(model)
    load_weights(decoder.model, checkpoint_weights(path), str(path))
    return decoder, meta["config"]


def run_model(cfg: ModelConfig) -> Decoder:
    """The whole model of a run's [model] section, built by its family, on the CPU in eval mode."""
    family = find_family(cfg)
    if family is None or not family.reads_tokens:
        raise GenerateError(f"model.family = '{cfg.family}': generate writes tokens from a decoder, and this "
                            f"run trained {family.summary if family is not None else 'no family bigtrain knows'}")
    if family.generation_model is None and not family.llama_fallbacks:
        raise GenerateError(none_for(family, "generation_model", "bigtrain generate (the whole model on the CPU, "
                                     "called as tokens -> logits)", "export its weights (bigtrain export RUN "
                                     "OUT.safetensors) and sample from your own model"))
    if family.generation_model is None:
        return Decoder(_plain_model(cfg), cfg.vocab_size, cfg.max_seq_len)
    try:
        model, vocab, context = family.generation_model(cfg)
    except (OSError, ValueError) as e:  # e.g. a config.json the run read that is no longer there
        raise GenerateError(f"cannot build the model the run recorded (model.family = '{cfg.family}'): "
                            f"{type(e).__name__}: {e}") from None
    return Decoder(model.eval(), vocab, context)


@torch.no_grad()
def load_weights(model: nn.Module, weights: dict[str, torch.Tensor], where: str) -> None:
    """Copy ``weights`` (full tensors by name) into ``model``'s parameters and persistent buffers
    (model state outside the gradient, such as sigmoid-bias routers' biases: left at their init,
    generation routed with other biases than the run trained); a tied weight is found under any of
    its names."""
    tensors: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tensors.setdefault(id(param), (param, []))[1].append(name)
    for name, buffer in persistent_buffers(model).items():  # not the rotary tables: derived, not checkpointed
        tensors.setdefault(id(buffer), (buffer, []))[1].append(name)
    missing, wrong = [], []
    for param, names in tensors.values():
        found = next((n for n in names if n in weights), None)
        if found is None:
            missing.append(names[0])
        elif tuple(weights[found].shape) != tuple(param.shape):
            wrong.append(f"{found} {tuple(weights[found].shape)} (the model's: {tuple(param.shape)})")
        else:
            param.copy_(weights[found])
    if missing or wrong:
        raise GenerateError(f"{where} does not hold the weights of the model it records: "
                            + "; ".join(filter(None, [f"missing {', '.join(missing[:5])}" if missing else "",
                                                      f"shapes differ: {', '.join(wrong[:5])}" if wrong else ""])))


def _plain_model(cfg: ModelConfig) -> nn.Module:
    model = build_model(cfg, device="cpu")
    model.init_buffers()
    return model.eval()


def _hf_folder_model(folder: Path) -> Decoder:
    from bigtrain.checkpoint.hf import HFFormatError, HFWeights, model_values, read_hf_config

    try:
        cfg = ModelConfig(**model_values(read_hf_config(folder), str(folder)))
    except HFFormatError as e:  # a folder is read as bigtrain's Llama; a run directory as its family's model
        raise GenerateError(f"{e}; generate from the run directory that trained it (its model family builds "
                            f"the model), or load the folder with transformers") from None
    model = _plain_model(cfg)
    weights = HFWeights(folder, cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head is one parameter, visited once
            param.copy_(weights(name, tuple(param.shape)))
    return Decoder(model, cfg.vocab_size, cfg.max_seq_len)


def run_directory(source: Path) -> Path:
    """The run directory of ``source`` (a run directory, its ``checkpoints/`` or one checkpoint)."""
    if (source / "checkpoints").is_dir():
        return source
    return source.parent if source.name == "checkpoints" else source.parent.parent


def text_tokenizer(source: Path, decoder: Decoder, run_config: dict):
    """The tokenizer the model's ids are in: the run's own (the copy ``bigtrain train`` keeps in
    the run directory, else the file its ``data.tokenizer`` names), a Hugging Face folder's
    ``tokenizer.json`` (what ``bigtrain export --format hf`` writes beside a tokenized run's
    weights), else bytes. A model trained on pre-tokenized ids, or whose vocabulary is smaller than
    its tokenizer's, is refused by name. (A run trained with its own tokenizer was refused with
    "export it and generate with transformers", right after the README's train command.)"""
    from bigtrain.data.load import run_tokenizer
    from bigtrain.data.tokenizer import BYTES, ByteTokenizer, TokenizerError, load_tokenizer

    source = Path(source)
    data = run_config.get("data", {})
    spec = str(data.get("tokenizer", BYTES))
    if run_config and spec != BYTES:
        spec = str(run_tokenizer(run_directory(source)) or spec)
    elif not run_config and (source / "tokenizer.json").is_file():  # a Hugging Face folder's own
        spec = str(source / "tokenizer.json")
    try:
        tokenizer = ByteTokenizer() if spec == BYTES else load_tokenizer(spec)
    except TokenizerError as e:
        raise GenerateError(f"the model's tokenizer cannot be read: {e}") from None
    where = str(data.get("source", ""))
    # A byte-level text run may pad its vocabulary past 256 (a multiple of 64, of tp): its text is
    # still bytes, and sampling keeps to them. It was refused as "trained on pre-tokenized ids".
    padded_text_run = bool(run_config) and decoder.vocab_size > BYTE_VOCAB
    if spec == BYTES and ((decoder.vocab_size != BYTE_VOCAB and not padded_text_run)
                          or where.endswith((".bin", ".npy"))):
        raise GenerateError(f"this model has a vocabulary of {decoder.vocab_size} and no tokenizer to write text "
                            f"with" + (f": it was trained on pre-tokenized ids ({where})" if where else
                                       " (no tokenizer.json in the folder)") +
                            f"; generate reads and writes bytes (vocabulary {BYTE_VOCAB}) or a run's tokenizer")
    if tokenizer.vocab_size > decoder.vocab_size:
        raise GenerateError(f"the tokenizer ({spec}) has {tokenizer.vocab_size} ids, more than the model's "
                            f"vocabulary of {decoder.vocab_size}: they are not the model's tokens")
    return tokenizer


def end_ids(source: Path, tokenizer, run_config: dict) -> set[int]:
    """The ids a generation stops at, as transformers' ``generate()`` stops on the same model: a Hugging
    Face folder's ``eos_token_id`` (one id or a list); a run's, the eos its export names
    (:func:`bigtrain.data.tokenizer.bos_eos_ids`: the token its tokenizer puts after each document,
    else ``data.document_end``, else a special token named as an end of text). Byte-level runs
    without ``data.document_end`` have none and write every token asked for."""
    import json

    from bigtrain.checkpoint.hf import CONFIG_FILE
    from bigtrain.data.tokenizer import bos_eos_ids

    if not run_config:
        try:
            eos = json.loads((Path(source) / CONFIG_FILE).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            return set()
        return {int(i) for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)}
    eos = bos_eos_ids(tokenizer, str(run_config.get("data", {}).get("document_end", ""))).get("eos_token_id")
    return {int(eos)} if eos is not None else set()


@torch.no_grad()
def sample(decoder: Decoder, prompt: list[int], tokens: int, temperature: float = 1.0, top_k: int = 0,
           seed: int = 0, vocab: int = 0, stop: set[int] = frozenset()) -> list[int]:
    """``tokens`` new token ids after ``prompt`` (see the module's docstring for the rules), drawn
    from the first ``vocab`` ids only when given: a model's vocabulary padded past its tokenizer's
    (1024 rows for 1000 ids) has rows no text ever trained, which no tokenizer can decode. Ends
    early after writing an id of ``stop`` (an end of text)."""
    if not prompt:
        raise GenerateError("--prompt is empty; give at least one character to continue")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long)
    out = []
    for _ in range(tokens):
        logits = decoder.last_logits(ids)
        if vocab:
            logits = logits[:vocab]
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = logits.topk(top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        out.append(nxt)
        if nxt in stop:
            break
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
                  seed: int = 0, ignore_eos: bool = False) -> str:
    """The prompt and its continuation, as text, in the model's tokenizer (:func:`text_tokenizer`;
    bytes that are not valid UTF-8 are shown as U+FFFD; a special token, such as an end of text, as
    itself). A leading token the tokenizer puts before each document (Llama's BOS) starts the
    prompt, as it started every training document, and is not printed. The continuation ends at
    the model's end of text (:func:`end_ids`), printed, unless ``ignore_eos``."""
    check_settings(tokens, temperature, top_k)
    decoder, run_config = load_model(source)
    tokenizer = text_tokenizer(source, decoder, run_config)
    ids = tokenizer.prompt_ids(prompt) if prompt else []
    leading = len(tokenizer.frame_ids()[0]) if prompt else 0
    stop = set() if ignore_eos else end_ids(source, tokenizer, run_config)
    new = sample(decoder, ids, tokens, temperature, top_k, seed, vocab=tokenizer.vocab_size, stop=stop)
    return tokenizer.decode(ids[leading:] + new)
