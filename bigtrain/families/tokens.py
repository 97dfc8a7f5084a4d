"""Config rules every decoder family shares: a token corpus cut into global batches of sequences."""

from __future__ import annotations

import os
from pathlib import Path

from bigtrain.config import Config
from bigtrain.data.documents import compressed_problem, saved_dataset_problem
from bigtrain.field_checks import looked_in, path_exists


def data_parallel_named(cfg: Config) -> tuple[str, str]:
    """(``parallel.dp`` as a message names it, the field to change for another dp). Under HSDP the
    user may have set only ``parallel.dp_shard`` (dp follows as dp_replicate x dp_shard): a message
    about parallel.dp alone named a field they never typed."""
    p = cfg.parallel
    if p.dp_shard > 0:
        return (f"parallel.dp (parallel.dp_replicate x parallel.dp_shard = {p.dp_replicate} x {p.dp_shard})",
                "parallel.dp_shard")
    return "parallel.dp", "parallel.dp"


def token_batch_problems(cfg: Config) -> list[str]:
    """Micro-batches of whole sequences: the global batch splits evenly over them and the dp ranks."""
    t, dp = cfg.train, cfg.parallel.dp
    if min(t.global_batch, t.micro_batch, dp) <= 0:  # validation's own rules name those
        return []
    if t.global_batch % (t.micro_batch * dp):
        per_rank = t.micro_batch * dp
        fix = max(per_rank, t.global_batch // per_rank * per_rank)
        named, field = data_parallel_named(cfg)
        other = "train.micro_batch" if field == "parallel.dp" else f"train.micro_batch or {field}"
        return [f"train.global_batch = {t.global_batch} is not divisible by train.micro_batch x {named} = "
                f"{t.micro_batch} x {dp}; use train.global_batch = {fix} or change {other}"]
    return []


def token_data_problems(cfg: Config, vocab_size: int, max_seq_len: int, vocab_field: str = "model.vocab_size",
                        seq_field: str = "model.max_seq_len", seq_fixed_by: str = "") -> list[str]:
    """data.source, data.seq_len and data.ignore_target against a model of ``vocab_size`` tokens and
    ``max_seq_len`` positions (the fields named say where those come from; ``seq_fixed_by``: the
    file that sets ``seq_field``, which an override may not change)."""
    d = cfg.data
    problems = []
    if d.seq_len > max_seq_len and seq_fixed_by:
        # "raise model.max_seq_len" was the fix named, and raising it is refused as a mismatch with the file
        problems.append(f"data.seq_len = {d.seq_len} exceeds {seq_field} = {max_seq_len}, which {seq_fixed_by} "
                        f"sets; lower data.seq_len to at most {max_seq_len}")
    elif d.seq_len > max_seq_len:
        problems.append(f"data.seq_len = {d.seq_len} exceeds {seq_field} = {max_seq_len}; "
                        f"raise {seq_field} or lower data.seq_len")
    is_tokens = d.source.endswith((".bin", ".npy"))
    if not d.source.strip():  # Path('') is the current directory: every text file under it
        problems.append("data.source is empty; use 'stdlib', a text file or folder, or a .bin / .npy token file")
    elif d.source != "stdlib" and not path_exists(d.source):
        problems.append(f"data.source = '{d.source}': no such file or folder{looked_in(d.source)}; use 'stdlib' or an "
                        f"existing path")
    elif d.source != "stdlib" and not is_tokens and (packed := compressed_problem(Path(os.path.expanduser(d.source)))):
        problems.append(packed)
    elif d.source != "stdlib" and (saved := saved_dataset_problem(Path(os.path.expanduser(d.source)))):
        problems.append(saved)
    if not is_tokens and d.tokenizer == "bytes" and vocab_size < 256:
        problems.append(f"{vocab_field} = {vocab_size}: byte-level text needs at least 256; set it to 256")
    if not -1 <= d.ignore_target < vocab_size:
        problems.append(f"data.ignore_target = {d.ignore_target}: must be -1 (keep every target) or a token id "
                        f"below {vocab_field} = {vocab_size}")
    return problems
