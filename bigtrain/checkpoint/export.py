"""``bigtrain export RUN_DIR OUT [--format safetensors|hf]``: the newest valid checkpoint's weights,
consolidated: one file (``safetensors``, the default), or a Hugging Face Llama / Qwen2 folder (``hf``,
:mod:`bigtrain.checkpoint.hf`) that ``AutoModelForCausalLM.from_pretrained`` loads, with the run's
tokenizer beside it for ``AutoTokenizer`` (when it trained with one).

Offline and for models that fit in one process's memory: each parameter is read whole from the
sharded checkpoint (whatever layout wrote it) under its canonical name, a tied weight once (as
``tok_embeddings.weight``). The file is safetensors when the optional ``safetensors`` package is
installed (``pip install safetensors``), else a ``torch.save`` dict ``.pt`` (and the caller says so).
Optimizer state is not exported.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from bigtrain.checkpoint.commit import newest_valid_checkpoint
from bigtrain.checkpoint.hf import readable_as_umask
from bigtrain.checkpoint.sharded import ChunkReader
from bigtrain.config import ModelConfig


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every parameter of the checkpoint at ``path``, whole, by name (one at a time from disk)."""
    reader = ChunkReader(path)
    out = {}
    for fqn in sorted(reader.entries):
        if fqn.startswith("optim/"):
            continue
        tensor = reader.empty(fqn)
        reader.read([(fqn, (0,) * tensor.dim(), tensor)])
        out[fqn] = tensor
    return out


FORMATS = ("safetensors", "hf")
# What AutoTokenizer reads from a model folder (the first two are what an export writes).
STALE_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def write_tokenizer(checkpoint: Path, data: dict, out: Path, max_len: int) -> None:
    """Put the run's tokenizer beside the exported weights, so that ``AutoTokenizer`` loads the
    folder too: the copy the run keeps in its directory (``bigtrain train`` writes one), else the
    file its ``data.tokenizer`` names. A byte-level run has none to write."""
    from bigtrain.data.tokenizer import BYTES, TokenizerError, write_for_transformers

    spec = data.get("tokenizer", BYTES)
    if spec == BYTES:
        # A folder an earlier export filled keeps its tokenizer files: AutoTokenizer would load another
        # run's tokenizer for this byte-level model. Said, not removed (a user may have put one there).
        stale = [name for name in STALE_TOKENIZER_FILES if (Path(out) / name).exists()]
        if stale:
            print(f"bigtrain export: warning: {out} holds {', '.join(stale)}, which this byte-level run did not "
                  f"write (an earlier export into the same folder?); AutoTokenizer would load it for this "
                  f"model: remove it, or export into an empty folder", file=sys.stderr)
        return
    try:
        write_for_transformers(tokenizer_source(checkpoint, spec), out, max_len, special_token_ids(checkpoint, data))
    except TokenizerError as e:
        print(f"bigtrain export: warning: {e}", file=sys.stderr)


def tokenizer_source(checkpoint: Path, spec: str) -> str:
    """The run's tokenizer: the copy its directory keeps (``bigtrain train`` writes one), else the
    file ``data.tokenizer`` (``spec``) names."""
    from bigtrain.data.load import run_tokenizer
    from bigtrain.data.tokenizer import BYTES

    if spec == BYTES:
        return spec
    run_dir = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
    kept = run_tokenizer(run_dir) if run_dir is not None else None
    return str(kept) if kept else spec


def special_token_ids(checkpoint: Path, data: dict) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` of the run's tokenizer, those it has
    (:func:`bigtrain.data.tokenizer.bos_eos_ids`); none when it cannot be read (the tokenizer's
    export says why)."""
    from bigtrain.data.tokenizer import BYTES, TokenizerError, bos_eos_ids, load_tokenizer

    try:
        tokenizer = load_tokenizer(tokenizer_source(checkpoint, data.get("tokenizer", BYTES)))
        return bos_eos_ids(tokenizer, data.get("document_end", ""))
    except TokenizerError:
        return {}


def export(run_dir: Path, out: Path, fmt: str = "safetensors",
           folder_writer: Callable[[ModelConfig], Callable | None] | None = None) -> tuple[Path, str]:
    """Write the weights of the newest valid checkpoint under ``run_dir`` (a run directory, its
    ``checkpoints/``, or one checkpoint) to ``out``; returns (the path written, 'safetensors', 'torch'
    or 'hf'). ``folder_writer``: for ``hf``, the writer of the run's model family given its
    [model] section (``(model, weights, out) -> folder``), or None for the Llama conversion."""
    from bigtrain.checkpoint import FORMAT

    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: must be one of {', '.join(FORMATS)}")
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    found = newest_valid_checkpoint(root)
    if found is None:
        raise FileNotFoundError(f"no valid checkpoint under {run_dir} (a run saves one at its end unless "
                                f"checkpoint.save_final = false; a folder that is no run directory holds none)")
    path, meta = found
    out = Path(out)
    if fmt == "safetensors" and out.is_dir():  # `export RUN runs/mine-hf` without --format hf
        raise ValueError(f"{out} is a folder; --format safetensors writes one file: give a file name "
                         f"({out / 'model.safetensors'}), or --format hf to write a Hugging Face folder")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is an old-format checkpoint; export reads sharded '{FORMAT}' checkpoints")
    weights = checkpoint_weights(path)
    if fmt == "hf":
        from bigtrain.checkpoint.hf import model_as_trained, save_hf

        with model_as_trained(meta) as cfg, _writing(out):
            writer = folder_writer(cfg) if folder_writer is not None else None
            if writer is not None:  # a family with names and a config.json of its own
                folder = writer(cfg, weights, out)
                # Its context is its config.json's (the family reads no model.max_seq_len).
                context = (meta.get("model_description") or {}).get("max_position_embeddings", cfg.max_seq_len)
            else:  # its config.json's bos / eos are the run's tokenizer's (generate() stops at the eos)
                special = special_token_ids(path, meta["config"].get("data", {}))
                folder, context = save_hf(weights, cfg, out, special), cfg.max_seq_len
        write_tokenizer(path, meta["config"].get("data", {}), folder, context)
        return folder, "hf"
    info = {"step": str(meta["step"]), "source": str(path), "format": FORMAT}
    try:
        from safetensors.torch import save_file
    except ImportError:
        if out.suffix == ".safetensors":
            out = out.with_suffix(".pt")
        with _writing(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"weights": weights, "meta": info}, out)
        return out, "torch"
    with _writing(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out), metadata=info)
        readable_as_umask(out)
    return out, "safetensors"


@contextmanager
def _writing(out: Path) -> Iterator[None]:
    """A write the place refuses (no permission, a full disk, a path through a file) is a ValueError
    naming ``out`` and the fix, which the command prints: it was a traceback from safetensors' Rust
    writer. The errors raised with a message of our own (no errno) pass unchanged."""
    try:
        yield
    except OSError as e:
        if e.errno is None:
            raise
        import errno

        why = "a part of its path is a file, not a folder" if e.errno in (errno.EEXIST, errno.ENOTDIR) \
            else e.strerror or str(e)
        raise ValueError(_unwritable(out, why)) from None
    except Exception as e:  # safetensors' own error type, which it does not export under a stable name
        if type(e).__name__ != "SafetensorError":
            raise
        raise ValueError(_unwritable(out, str(e))) from None


def _unwritable(out: Path, why: str) -> str:
    return (f"{out} could not be written ({why}); give OUT a place this process can write to (a writable folder "
            f"with free space)")
