"""``parallel.cp`` and ``parallel.cp_mode`` against the rest of a config, before any process starts.

Imports no torch (as :mod:`bigtrain.validation`). What is built and why each rule holds:
docs/context-parallel.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bigtrain.config import Config

if TYPE_CHECKING:  # bigtrain.families imports this module (through its Hugging Face family)
    from bigtrain.families.spec import Family

CP_MODES = ("ring", "all-to-all", "hybrid")  # bigtrain.parallel.context


def divisor_near(n: int, target: int, search: int = 100_000) -> int:
    """The divisor of ``n`` nearest ``target``: searched outwards from it, a bounded number of
    steps (a suggestion must not take minutes on n = 10^12), else the nearer of 1 and n."""
    best = min((1, n), key=lambda d: abs(d - target))
    for k in range(min(abs(best - target), search) + 1):
        for d in (target - k, target + k):
            if 1 <= d <= n and n % d == 0:
                return d
    return best





def head_split_problems(what: str, degree: int, local_q: int, local_kv: int, other: str) -> list[str]:
    """An axis that gives each of its ``degree`` ranks whole attention heads (Ulysses' sp, all-to-all
    cp): the query heads per tp rank must divide by it; the key/value heads divide by it (split) or
    divide it (replicated). ``what`` names the setting, ``other`` an alternative to suggest."""
    field = what.split(" ")[0]
    axis = field.split(".")[-1]
    if local_q % degree:
        return [f"{what}: each rank takes whole attention heads, and there are {local_q} query heads per tp "
                f"rank (model.n_heads / parallel.tp); use {field} = {divisor_near(local_q, degree)}{other}"]
    if local_kv % degree and degree % local_kv:
        return [f"{what}: the {local_kv} key/value heads per tp rank (model.n_kv_heads / parallel.tp) must divide "
                f"by {axis} (split) or divide {axis} (replicated); use {field} = "
                f"{divisor_near(local_kv, degree)}{other}"]
    return []


def check_context_parallel(cfg: Config, family: "Family | None" = None) -> list[str]:
    """The rules every family's cp shares; ``family`` (``model.family``'s, when registered) says
    whether it has context-parallel attention at all (``Family.context_parallel``) and whether the
    [model] head counts describe its model (``model_fields``; else its own check_config divides its
    heads, as the Hugging Face family's does with its config.json's)."""
    p, m, seq = cfg.parallel, cfg.model, cfg.data.seq_len
    if p.cp_mode not in CP_MODES:
        return [f"parallel.cp_mode = {p.cp_mode!r}: must be one of {', '.join(repr(x) for x in CP_MODES)}"]
    if p.cp < 1:
        return [f"parallel.cp = {p.cp}: must be >= 1 (1: no context parallelism)"]
    if p.cp == 1:
        return []
    problems = []
    if p.cp_mode == "hybrid" and p.sp == 1:
        problems.append(f"parallel.cp_mode = 'hybrid' runs Ulysses over parallel.sp inside and the ring over "
                        f"parallel.cp across, and parallel.sp = 1; set parallel.sp > 1 (the sequence is then cut "
                        f"cp x sp ways) or parallel.cp_mode = 'ring'")
    if p.cp_mode != "hybrid" and p.sp > 1:
        problems.append(f"parallel.cp = {p.cp} with parallel.sp = {p.sp} and cp_mode '{p.cp_mode}': Ulysses over sp "
                        f"inside a ring over cp is parallel.cp_mode = 'hybrid'; set it, or parallel.sp = 1")
    chunks = 2 * p.cp
    if seq <= 0 or seq % chunks:
        near = max(chunks, seq // chunks * chunks)
        problems.append(f"data.seq_len = {seq} does not split into 2 x parallel.cp = {chunks} equal chunks (each cp "
                        f"rank holds chunks i and 2cp-1-i); use data.seq_len = {near} or a parallel.cp whose 2 x cp "
                        f"divides {seq}")
    elif p.sp > 1 and (seq // p.cp) % p.sp:
        problems.append(f"data.seq_len / parallel.cp = {seq // p.cp} does not divide by parallel.sp = {p.sp} "
                        f"(Ulysses cuts each cp rank's part); use data.seq_len = {2 * p.cp * p.sp * max(1, seq // (2 * p.cp * p.sp))}")
    elif p.sequence_parallel and p.tp > 1 and (seq // (p.cp * max(1, p.sp))) % p.tp:
        problems.append(f"parallel.sequence_parallel: data.seq_len / (cp x sp) = {seq // (p.cp * max(1, p.sp))} does "
                        f"not divide by parallel.tp = {p.tp}; change data.seq_len or turn sequence_parallel off")
    heads_described = family is None or family.model_fields
    if heads_described and p.cp_mode == "all-to-all" and p.tp > 0 and m.n_heads > 0 and m.n_heads % max(1, p.tp) == 0:
        local_q, local_kv = m.n_heads // p.tp, max(1, m.kv_heads // p.tp)
        problems += head_split_problems(f"parallel.cp = {p.cp} with cp_mode 'all-to-all'", p.cp, local_q, local_kv,
                                        " or cp_mode = 'ring'")
    if m.moe_experts > 0 and p.sp > 1:
        problems.append(f"parallel.cp = {p.cp} x parallel.sp = {p.sp} with model.moe_experts = {m.moe_experts}: an MoE "
                        f"block's part of each sequence would be cut twice (cp's chunk pairs, then Ulysses), which its "
                        f"capacity queues do not follow yet; use parallel.sp = 1 (cp alone) or parallel.cp = 1")
    if family is not None and family.context_parallel is None:  # nothing to attach the ring or all-to-all to
        problems.append(f"parallel.cp = {p.cp}: model.family = '{m.family}' has no context-parallel attention "
                        f"(its Family.context_parallel); use parallel.cp = 1")
    if p.dp_sync != "sync":
        problems.append(f"parallel.cp = {p.cp} with parallel.dp_sync = '{p.dp_sync}': not supported; use "
                        f"parallel.cp = 1 or dp_sync = 'sync'")
    return problems
