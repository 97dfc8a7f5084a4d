"""What a run will read, write and allocate, checked before any rank starts.

:func:`validate` judges the config alone; these checks look at the machine: the data files (their
dtype, ids against the vocabulary, their length against the sampler's window), the folders the
run writes (the run directory, the corpus cache), the environment a launcher leaves (``RANK`` /
``WORLD_SIZE`` without one makes a plain ``bigtrain train`` wait for peers that never come), and
the memory the planner's model says the run needs. ``bigtrain train`` and ``bigtrain check`` call
:func:`check_environment` and :func:`preflight` before they launch anything; each problem names
the field (or variable) and a fix, and the CLI exits 2 on them without a traceback.

Nothing here creates a file or folder: writability is probed with a temporary file that is removed
at once, in the nearest folder that already exists.
"""

from __future__ import annotations

import copy
import os
import stat
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np

from bigtrain.config import Config, ConfigError
from bigtrain.families import family_of, model_vocabulary
from bigtrain.families.own import none_for
from bigtrain.data.corpus import (TEXT_SUFFIXES, cache_path, cached_corpus, files_key, stdlib_files, stdlib_key, text_files,
                                  token_dtype_problem)
from bigtrain.data.blend_spec import parse_blend
from bigtrain.data.load import blended_config, held_out_config, is_token_file, uses_shards
from bigtrain.data.fields import holds, records_problem, tokenizer_problem
from bigtrain.data.sampler import split_problem

SCAN_CHUNK = 1 << 24  # token ids compared with the vocabulary per step of the scan (64 MiB of int32)
LAUNCHER_MARKERS = ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                    "PMIX_RANK", "MV2_COMM_WORLD_RANK")
NAME_MAX = 255


# -- the environment ---------------------------------------------------------------------------------
def environment_problems(env: Mapping[str, str] = os.environ) -> tuple[list[str], list[str]]:
    """(problems, warnings) about the torch.distributed variables a launcher sets, or left behind."""
    rank, world = env.get("RANK"), env.get("WORLD_SIZE")
    unset = "unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT to train in this one process"
    if rank is None or world is None:
        if rank is None and world is None:
            return [], []
        present = "RANK" if world is None else "WORLD_SIZE"
        return [], [f"environment: {present} is set without {'WORLD_SIZE' if world is None else 'RANK'}, so no "
                    f"launcher started this process (a leftover?); ignoring it and running in one process"]
    numbers = {}
    problems = []
    for name, text in (("RANK", rank), ("WORLD_SIZE", world)):
        try:
            numbers[name] = int(text)
        except ValueError:
            problems.append(f"environment: {name} = '{text}' is not a whole number; {unset}, "
                            f"or start the ranks with torchrun")
    if problems:
        return problems, []
    r, n = numbers["RANK"], numbers["WORLD_SIZE"]
    if n < 1 or not 0 <= r < n:
        return [f"environment: RANK = {r} and WORLD_SIZE = {n}: need WORLD_SIZE >= 1 and 0 <= RANK < WORLD_SIZE; "
                f"{unset}"], []
    if n == 1:
        return [], []
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr or not port:
        missing = [k for k, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if not v]
        are = "is" if len(missing) == 1 else "are"
        return [f"environment: RANK = {r} and WORLD_SIZE = {n} are set but {' and '.join(missing)} {are} not, "
                f"so no launcher started this process (leftovers of an earlier shell?); {unset} (bigtrain "
                f"train starts its own ranks), or launch with torchrun"], []
    if not port.isdigit() or not 0 < int(port) < 65536:
        return [f"environment: MASTER_PORT = '{port}' is not a port number (1-65535); {unset}"], []
    if not any(k in env for k in LAUNCHER_MARKERS):
        return [], [f"environment: RANK = {r}, WORLD_SIZE = {n}, MASTER_ADDR = {addr}:{port} are set but no launcher "
                    f"(torchrun, SLURM, MPI) marked this process: this rank will wait up to distributed.timeout_s "
                    f"for {n - 1} other rank(s) to join. If these are leftovers, {unset}"]
    return [], []


def check_environment(env: Mapping[str, str] = os.environ) -> list[str]:
    """Raise a ConfigError on the environment's problems; return its warnings."""
    problems, warnings = environment_problems(env)
    if problems:
        raise ConfigError(problems)
    return warnings


# -- folders the run writes ------------------------------------------------------------------------
def writable_dir_problem(path: str | Path, name: str) -> str | None:
    """Why ``path`` cannot be (or become) a folder this process writes into; None when it can."""
    text = str(path)
    if not text.strip():
        return f"{name} is empty; give a folder"
    try:
        target = Path(os.path.expanduser(text)).absolute()
        too_long = [p for p in target.parts if len(os.fsencode(p)) > NAME_MAX]
        if too_long:
            return f"{name} = '{text}': the name '{too_long[0][:40]}...' is longer than {NAME_MAX} bytes"
        probe = target
        while not os.path.lexists(probe):
            probe = probe.parent
        mode = os.stat(probe).st_mode  # follows links: a dangling one raises
        if not stat.S_ISDIR(mode):
            where = "it" if probe == target else f"'{probe}'"
            return f"{name} = '{text}': {where} exists and is not a folder; choose another path"
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".bigtrain-write-test-")
        os.close(fd)
        os.unlink(tmp)
    except (OSError, ValueError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        return f"{name} = '{text}': cannot write there ({reason}); choose a folder you can write"
    return None


# -- data ------------------------------------------------------------------------------------------
def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def data_problems(cfg: Config) -> list[str]:
    """The corpus ``data.source`` names, against the model and the sampler: one problem at most."""
    d, family = cfg.data, family_of(cfg)
    if not family.reads_tokens:  # its own data (a recommender's): validation checked it
        return []
    vocab, vocab_field = model_vocabulary(cfg)  # a family described by its own file (a config.json) sets it there
    need = d.seq_len + 2  # TokenSampler draws starts in [0, len - seq_len - 1): a window of seq_len + 1, and one more
    if d.document_end and is_token_file(d.source):
        return [f"data.document_end = {d.document_end!r} with data.source = '{d.source}', ids tokenized already: "
                f"it is put between documents as they are tokenized; leave data.document_end = '' (or give the text)"]
    if (d.tokenizer != "bytes" or d.document_end) and (problem := tokenizer_problem(cfg, vocab, vocab_field)):
        return [problem]
    if d.source == "stdlib" and uses_shards(d):
        return [problem] if (problem := _writable_cache_problem(cfg)) else []
    if d.source == "stdlib":
        problem = _cache_problem(cfg, stdlib_key())
        if problem is None and d.max_bytes and d.max_bytes < need:
            problem = (f"data.max_bytes = {d.max_bytes} caps the corpus below data.seq_len + 2 = {need} tokens "
                       f"(one window and the next target); raise data.max_bytes or set it to 0")
        if problem is None and d.val_fraction:
            problem = _held_out_problem(d, "data.source = 'stdlib' has", _stdlib_tokens(d))
        return [problem] if problem else []
    src = Path(os.path.expanduser(d.source))
    try:
        mode = os.stat(src).st_mode
    except (OSError, ValueError) as e:
        return [f"data.source = '{d.source}': cannot be read ({getattr(e, 'strerror', None) or e})"]
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return [f"data.source = '{d.source}' is {_kind(mode)}, not a file or folder; give a text file or folder, "
                f"or a .bin / .npy token file"]
    if uses_shards(d):  # tokenized into shards before launch (bigtrain.data.shards); its length is known then
        problem = records_problem(cfg) or _writable_cache_problem(cfg)
        return [problem] if problem else []
    if src.suffix in (".bin", ".npy"):  # as load_tokens decides
        if stat.S_ISDIR(mode):
            return [f"data.source = '{d.source}' is a folder; a .bin / .npy source must be a token file"]
        problem = _token_file_problem(d, src, vocab, vocab_field)
    else:
        problem = _text_problem(cfg, src, need)
    return [problem] if problem else []


def held_out_source_problems(cfg: Config) -> list[str]:
    """``data.val_source`` and the corpora of ``data.blend`` held to ``data.source``'s checks (each is
    read the same way, and its ids meet the same embedding), each message naming its field."""
    d, problems = cfg.data, []
    named = [(held_out_config(d), f"data.val_source = '{d.val_source}'", "data.val_source")] if d.val_source else []
    named += [(blended_config(d, path), f"data.blend's {path}", "data.blend") for path, _ in parse_blend(d.blend)]
    for data, label, field in named:
        as_source = copy.copy(cfg)
        as_source.data = data
        problems += [p.replace(f"data.source = '{data.source}'", label).replace("data.source", field)
                     for p in data_problems(as_source)]
    return problems


def _stdlib_tokens(d) -> int:
    """The byte corpus of the standard library: its cached file's length, else its files' bytes up to
    data.max_bytes (stat-ed only when data.val_fraction needs the length)."""
    cached = cached_corpus(stdlib_key(), d.cache_dir, d.max_bytes)
    if cached.is_file():
        return cached.stat().st_size
    total = sum(f.stat().st_size for f in stdlib_files())
    return min(total, d.max_bytes) if d.max_bytes else total


def _held_out_problem(d, where: str, tokens: int) -> str | None:
    """The corpus of ``tokens`` ids cut by data.val_fraction: a training part and a held-out slice of
    a window each (the sampler's own rule, asked before launch rather than raised in every rank)."""
    problem = split_problem(tokens, d.seq_len, d.val_fraction) if d.val_fraction else None
    return f"{problem} ({where} {tokens} tokens)" if problem else None


def _unreadable(path: Path) -> str | None:
    try:
        with open(path, "rb"):
            return None
    except OSError as e:
        return e.strerror or str(e)


def _token_file_problem(d, path: Path, vocab: int, vocab_field: str) -> str | None:
    field, need = f"data.source = '{d.source}'", d.seq_len + 2
    reason = _unreadable(path)
    if reason:
        return f"{field}: cannot be read ({reason})"
    size = path.stat().st_size
    if size == 0:
        return f"{field} is empty; it needs at least data.seq_len + 2 = {need} token ids"
    if path.suffix == ".bin":
        if size % 2:
            return (f"{field} has an odd number of bytes ({size}): a .bin holds uint16 token ids, 2 bytes each; "
                    f"write it with np.asarray(ids, dtype=np.uint16).tofile(path), or save a .npy")
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
    else:
        problem = _npy_header_problem(path, size)
        if problem:
            return f"{field} {problem}"
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - numpy raises several kinds on a damaged header or size
            return f"{field} is not a readable .npy array ({' '.join(str(e).split())[:200]}); save it with np.save"
        tokens = tokens.reshape(-1) if tokens.flags.c_contiguous else tokens.ravel(order="K")
    if len(tokens) < need:
        return (f"{field} has {len(tokens)} token ids, fewer than data.seq_len + 2 = {need} (one window and the "
                f"next target); lower data.seq_len or give a longer corpus")
    return (_held_out_problem(d, f"{field} has", len(tokens)) or _id_range_problem(field, tokens, vocab, vocab_field)
            or (_wide_ids_problem(field, tokens) if path.suffix == ".bin" else None))


def _wide_ids_problem(field: str, tokens: np.ndarray) -> str | None:
    """A .bin of ids written 4 or 8 bytes each (``np.int32(ids).tofile``), read as uint16: every id
    becomes its low half and a run of high halves, which are 0 (or tiny) for every id below 65536 and
    so pass the vocabulary check, and the run would train on every other token replaced by 0. Seen in
    the first ids: the values at odd positions are far below those at even positions. Real uint16 text
    has no such pattern (its odd positions are as varied as the even ones)."""
    head = np.asarray(tokens[:min(len(tokens), 1 << 20) // 2 * 2])
    if len(head) < 64:
        return None
    low, high = head[0::2], head[1::2]
    if int(high.max()) * 256 >= int(low.max()):
        return None
    return (f"{field}: every second uint16 value is at most {int(high.max())} while the others reach "
            f"{int(low.max())}: it looks like 32- or 64-bit ids (np.int32 / np.int64 .tofile) read 2 bytes at a "
            f"time; a .bin holds uint16 ids: write np.asarray(ids, dtype=np.uint16).tofile(path), or np.save a "
            f".npy (which keeps its dtype)")


def _npy_header_problem(path: Path, size: int) -> str | None:
    """The header alone: not a .npy at all, ids that are not integers, or fewer bytes than it promises."""
    fmt = np.lib.format
    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            return "is not a .npy file (no NumPy header); save the ids with np.save, or name a text file .txt"
        f.seek(0)
        try:
            version = fmt.read_magic(f)
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(f)
        except Exception as e:  # noqa: BLE001 - a damaged header: say what numpy says
            return f"has a damaged .npy header ({' '.join(str(e).split())[:200]}); save it again with np.save"
        problem = token_dtype_problem(dtype)
        if problem:
            return problem
        promised = f.tell() + int(np.prod(shape, dtype=object)) * dtype.itemsize
    if promised > size:
        return (f"is truncated: its header promises {int(np.prod(shape, dtype=object))} ids ({promised} bytes), "
                f"the file has {size} bytes; save it again with np.save")
    return None


def _id_range_problem(field: str, tokens: np.ndarray, vocab: int, vocab_field: str = "model.vocab_size") -> str | None:
    """Scan the ids chunk by chunk (memory-mapped: the file is never loaded whole): the first id
    out of range, and the largest and smallest of all, for the fix."""
    info = np.iinfo(tokens.dtype)
    if info.min >= 0 and info.max < vocab:
        return None  # every value the dtype can hold is a valid id: nothing to scan
    first, low, high = None, 0, 0
    for start in range(0, len(tokens), SCAN_CHUNK):
        chunk = np.asarray(tokens[start:start + SCAN_CHUNK])
        low, high = min(low, int(chunk.min())), max(high, int(chunk.max()))
        if first is None and (low < 0 or high >= vocab):
            bad = (chunk < 0) | (chunk >= vocab)
            at = int(np.argmax(bad))
            first = (start + at, int(chunk[at]))
    if first is None:
        return None
    at, value = first
    text = f"{field} holds token id {value} at position {at}, outside 0 .. {vocab_field} - 1 = {vocab - 1}"
    if high >= vocab:
        text += f"; the largest id is {high}: set {vocab_field} to at least {high + 1}, or re-tokenize"
    if low < 0:
        text += f"; the smallest is {low}: ids cannot be negative, re-tokenize"
    return text


def _text_problem(cfg: Config, src: Path, need: int) -> str | None:
    d = cfg.data
    field = f"data.source = '{d.source}'"
    if cfg.model.vocab_size < 256:  # validate judged the name ('x.bin/' ends otherwise than its suffix)
        return f"{field} is read as byte-level text, which needs model.vocab_size >= 256; set it to 256"
    if src.is_dir():
        try:
            next(os.scandir(src), None)
        except OSError as e:
            return f"{field}: the folder cannot be listed ({e.strerror})"
    files = text_files(src)
    if not files:
        return (f"{field}: no text files in this folder (looked for {', '.join(TEXT_SUFFIXES)}"
                f"{holds(src)}); give a folder with such files, a text file, or a .bin / .npy token file")
    total = 0
    for f in files:
        reason = _unreadable(f)
        if reason:
            return f"{field}: '{f}' cannot be read ({reason})"
        total += f.stat().st_size
        if d.max_bytes and total >= d.max_bytes:
            total = d.max_bytes
            break
    if total < need:
        cap = f" (data.max_bytes = {d.max_bytes})" if d.max_bytes and total == d.max_bytes else ""
        return (f"{field} has {total} bytes of text{cap}, fewer than data.seq_len + 2 = {need} tokens (one window "
                f"and the next target); lower data.seq_len or give a longer corpus")
    problem = _held_out_problem(d, f"{field} has", total)
    if problem:
        return problem
    try:
        key = files_key(files)
    except OSError as e:
        return f"{field}: a file changed while it was read ({e.strerror}); try again"
    return _cache_problem(cfg, key)


def _writable_cache_problem(cfg: Config) -> str | None:
    where = cfg.data.cache_dir or str(cache_path(""))
    problem = writable_dir_problem(where, "data.cache_dir")
    if problem and not cfg.data.cache_dir:
        problem += " (the default, under your home folder; set data.cache_dir)"
    return problem


def _cache_problem(cfg: Config, key: str) -> str | None:
    """A text corpus is tokenized into data.cache_dir once: the folder must be writable unless
    the corpus is already there."""
    try:
        if cached_corpus(key, cfg.data.cache_dir, cfg.data.max_bytes).is_file():
            return None
    except (OSError, ValueError):
        pass
    where = cfg.data.cache_dir or str(cache_path(""))
    problem = writable_dir_problem(where, "data.cache_dir")
    if problem and not cfg.data.cache_dir:
        problem += " (the default, under your home folder; set data.cache_dir)"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if problem is None and cfg.data.source == "stdlib" and not (stdlib / "os.py").is_file():
        problem = "data.source = 'stdlib': this Python has no standard library sources to read; give a corpus"
    return problem


# -- memory ----------------------------------------------------------------------------------------
def preflight(cfg: Config, output_dir: str | Path, output_name: str = "--output-dir",
              local_ranks: int = 1, cuda: bool = False, check_size: bool = True) -> list[str]:
    """Raise a ConfigError naming every problem with the data, the output folder and the size of
    the run (not with ``check_size=False``: ``bigtrain train --force``); return warnings (the caller
    prints them)."""
    from bigtrain.plan.refit import size_problems_and_fixes

    problems = data_problems(cfg) + held_out_source_problems(cfg)
    out = writable_dir_problem(output_dir, output_name)
    if out:
        problems.append(out)
    if not check_size:
        size, warnings = [], []
    else:
        nvme_dir = os.path.expanduser(cfg.offload.nvme_dir) if cfg.offload.nvme_dir else str(Path(output_dir) / "offload")
        family = family_of(cfg)
        if family.size_problems is None and family.planner_config is None and not family.llama_fallbacks:
            size, warnings = [], [none_for(family, "size_problems", "no size check before launch (whether the model "
                                           "fits this machine's memory)", "the run finds out when it runs")]
        elif family.size_problems is not None:
            from bigtrain.plan.fit import machine_memory

            size, warnings = family.size_problems(cfg, local_ranks, cuda, nvme_dir=nvme_dir, machine=machine_memory(cuda))
        elif family.planner_config is not None:  # priced as bigtrain's Llama of the same shapes
            size, warnings = size_problems_and_fixes(family.planner_config(cfg), local_ranks, cuda, nvme_dir=nvme_dir,
                                                     runs_as=cfg)
            said = (f"model.family = '{cfg.model.family}', priced as bigtrain's Llama of the same shapes (the model.* "
                    f"fields named here are its own sizes under bigtrain's names)")
            size, warnings = [f"{said}: {p}" for p in size], [f"{said}: {w}" for w in warnings]
        else:
            size, warnings = size_problems_and_fixes(cfg, local_ranks, cuda, nvme_dir=nvme_dir)
    problems += size
    if problems:
        raise ConfigError(problems)
    return (layout_warnings(cfg) + init_from_tokenizer_warnings(cfg) + init_from_position_warnings(cfg)
            + held_out_warnings(cfg) + schedule_warnings(cfg) + warnings)


def init_from_position_warnings(cfg: Config) -> list[str]:
    """A Hugging Face family's model.hf_config that changes only the positions of model.init_from's
    folder (a context extension: bigtrain.families.hf.init_from_position_changes)."""
    if cfg.model.family != "hf" or not cfg.model.init_from:
        return []
    from bigtrain.families.hf import init_from_position_changes

    return init_from_position_changes(cfg)


def schedule_warnings(cfg: Config) -> list[str]:
    """A warm-up as long as the run: the learning rate rises the whole run and never reaches
    optim.lr (a preset's 100-step warm-up under a short --train.steps, without a word)."""
    o, t = cfg.optim, cfg.train
    if o.warmup_steps >= t.steps > 0:
        reached = o.lr * t.steps / o.warmup_steps
        return [f"optim.warmup_steps = {o.warmup_steps} >= train.steps = {t.steps}: the learning rate rises for the "
                f"whole run and ends at {reached:.3g}, not optim.lr = {o.lr:g}; lower optim.warmup_steps (e.g. "
                f"{max(1, t.steps // 10)}) or train longer"]
    return []


def held_out_warnings(cfg: Config) -> list[str]:
    """A held-out slice nothing evaluates: data.val_fraction takes its tokens from training, and with
    train.eval_every = 0 no eval_loss is ever logged (the opposite, eval_every without a slice, is
    refused by validation)."""
    d, t = cfg.data, cfg.train
    if d.val_source and t.eval_every == 0 and family_of(cfg).reads_tokens:
        return [f"data.val_source = '{d.val_source}' is never evaluated: train.eval_every = 0 (no eval_loss is logged); "
                f"set train.eval_every, e.g. {max(1, t.steps // 10)}"]
    if d.val_fraction > 0 and t.eval_every == 0 and family_of(cfg).reads_tokens:
        return [f"data.val_fraction = {d.val_fraction:g} holds out the corpus's last tokens from training, but "
                f"train.eval_every = 0 never evaluates them (no eval_loss is logged); set train.eval_every, e.g. "
                f"{max(1, t.steps // 10)}, or data.val_fraction = 0"]
    return []


def init_from_tokenizer_warnings(cfg: Config) -> list[str]:
    """A model started from a Hugging Face folder that holds a tokenizer, trained on other ids: its
    embedding rows mean that tokenizer's tokens. `--model.init_from=hf:FOLDER` with the default
    data.tokenizer = 'bytes' fine-tuned a pretrained model on byte ids without a word (a user of
    transformers expects the folder's tokenizer to come with its model)."""
    from bigtrain.checkpoint.hf import hf_folder
    from bigtrain.data.tokenizer import BYTES, HF_FILE, file_digest, tokenizer_file

    folder = hf_folder(cfg.model.init_from)
    if folder is None or cfg.data.source.endswith((".bin", ".npy")):  # ids given as they are
        return []
    theirs = folder / HF_FILE
    if not theirs.is_file():
        return []
    fix = f"set data.tokenizer = '{folder}' to train on the model's own tokens"
    if cfg.data.tokenizer == BYTES:
        return [f"model.init_from's folder has a tokenizer ({theirs}), but data.tokenizer = 'bytes': the model is "
                f"trained on byte ids (0-255), which its embedding reads as other tokens; {fix}"]
    try:
        ours = tokenizer_file(cfg.data.tokenizer)
        same = ours.is_file() and file_digest(ours) == file_digest(theirs)
    except OSError:
        return []  # an unreadable data.tokenizer is refused by name elsewhere
    if same or not ours.is_file():
        return []
    return [f"data.tokenizer = '{cfg.data.tokenizer}' is not the tokenizer beside model.init_from's weights "
            f"({theirs} holds another file): if its ids are not that tokenizer's, the model reads them as other "
            f"tokens; {fix}"]


def layout_warnings(cfg: Config) -> list[str]:
    """Layouts that run but do not do what their name promises."""
    p, offload = cfg.parallel, cfg.offload
    if p.zero and p.dp == 1 and offload.optimizer == "none" and offload.params == "none":  # offload runs on ZeRO's engine
        return [f"parallel.zero = {p.zero} with parallel.dp = 1: ZeRO shards over the data-parallel ranks, so one "
                f"rank holds everything and nothing is saved (it only adds the engine's work); use parallel.dp > 1 "
                f"or parallel.zero = 0"]
    return []


def print_warnings(warnings: list[str]) -> None:
    """On stderr, once: under a launcher every rank finds the same warnings, and rank 0 says them;
    in ranks that ``bigtrain train`` or ``check`` started, none does: the launching process said them
    before the launch (from the same resolved config), and its rank 0 said each a second time."""
    from bigtrain.distributed.launch import launched_by_bigtrain

    if os.environ.get("RANK", "0") != "0" or launched_by_bigtrain():
        return
    for text in warnings:
        print(f"bigtrain: warning: {text}", file=sys.stderr)


def check_inputs(cfg: Config, output_dir: str | Path, output_name: str, check_size: bool = True) -> list[str]:
    """:func:`preflight` for this process: the ranks this machine runs (the launcher's local world, or
    the layout's when bigtrain launches), on CUDA if the run will be (``check_size=False``:
    ``--force``, no size check); raises a ConfigError, returns warnings."""
    import torch

    from bigtrain.distributed.launch import launched_externally

    if launched_externally():
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ["WORLD_SIZE"])
    else:
        local = cfg.parallel.world_size
    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    return preflight(cfg, output_dir, output_name, local_ranks=local, cuda=cuda, check_size=check_size)
