"""``bigtrain data``: what a config trains on, before a run does.

The corpora (``data.source`` and those of ``data.blend``, with their shares), their training and
held-out tokens, how often the run's steps read each training token, and the first windows of the
first step decoded with the run's tokenizer, each with the corpus and position it came from: the
same windows the run's step 1 trains on (the sampler is the run's, prepared as ``bigtrain train``
prepares it). A first look at a new dataset, and the answer to "what did my config actually read?".
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bigtrain.config import Config
from bigtrain.data.blend import BlendedSampler
from bigtrain.data.blend_spec import parse_blend, source_share
from bigtrain.data.load import prepare_run_data, run_sampler
from bigtrain.data.tokenizer import load_tokenizer
from bigtrain.families import model_vocabulary


def cmd_data(cfg: Config, windows: int) -> int:
    """``bigtrain data``: the config validated and its data checked as ``bigtrain train`` checks them
    before launch (ConfigError naming the field), then :func:`describe_data` printed; 1 for a family
    with data of its own."""
    from bigtrain.config import ConfigError
    from bigtrain.families import family_of
    from bigtrain.data_checks import data_problems, held_out_source_problems
    from bigtrain.validation import validate

    validate(cfg)
    if not family_of(cfg).reads_tokens:
        print(f"bigtrain data: model.family = '{cfg.model.family}' reads data of its own, not token corpora; "
              f"bigtrain data shows token corpora", file=sys.stderr)
        return 1
    if problems := data_problems(cfg) + held_out_source_problems(cfg):
        raise ConfigError(problems)
    print(describe_data(cfg, windows=max(0, windows)))
    return 0


def describe_data(cfg: Config, windows: int = 2, width: int = 240) -> str:
    """The text ``bigtrain data`` prints (``windows`` of step 1's, each cut to ``width`` characters)."""
    d, t = cfg.data, cfg.train
    with tempfile.TemporaryDirectory() as scratch:  # (where a run keeps its tokenizer's copy)
        prepare_run_data(cfg, Path(scratch), main=True)  # tokenized now if it is not yet, as the launcher would
    vocab, vocab_field = model_vocabulary(cfg)
    sampler = run_sampler(cfg, vocab_size=vocab, vocab_field=vocab_field)
    blend = parse_blend(d.blend)
    parts = sampler.parts if isinstance(sampler, BlendedSampler) else [sampler]
    names = [f"data.source = '{d.source}'"] + [f"data.blend's {path}" for path, _ in blend]
    shares = [source_share(blend)] + [share for _, share in blend]
    step = t.global_batch * d.seq_len
    lines = [f"tokenizer: {d.tokenizer}; {vocab_field} = {vocab}",
             f"a step: train.global_batch x data.seq_len = {t.global_batch} x {d.seq_len} = {step:,} tokens; "
             f"train.steps = {t.steps:,} read {t.steps * step:,} (windows drawn at random, with replacement)"]
    for name, part, share in zip(names, parts, shares):
        train, held_out = part.token_counts()
        held = f", {held_out:,} held out (data.val_fraction = {d.val_fraction:g})" if held_out and not d.val_source else ""
        shared = f"; share {share:g}" if blend else ""
        lines.append(f"{name}: {train:,} training tokens{held}{shared}; the run reads each about "
                     f"{t.steps * step * share / max(train, 1):.3g} times")
    if d.val_source:
        lines.append(f"data.val_source = '{d.val_source}': {len(parts[0].val_tokens):,} held-out tokens")
    tokenizer = load_tokenizer(d.tokenizer)
    shown = min(windows, t.global_batch)
    if shown <= 0:  # --windows 0: the summary alone (a batch of no windows cannot be stacked)
        return "\n".join(lines)
    lines.append(f"step 1's first {shown} of {t.global_batch} windows, as the tokenizer writes them (ids where it cannot):")
    inputs, _ = sampler.batch(0, 0, shown)
    picks = sampler.picks(0) if isinstance(sampler, BlendedSampler) else (None, sampler.starts(0))
    for i in range(shown):
        where = names[int(picks[0][i])] if picks[0] is not None else names[0]
        shown_text = _as_text(tokenizer, inputs[i].tolist(), width)
        first = int(picks[1][i])
        lines.append(f"  [{i + 1}] {where}, tokens {first:,} to {first + d.seq_len - 1:,}: {shown_text}")
    return "\n".join(lines)


def _as_text(tokenizer, ids: list[int], width: int) -> str:
    """The window as the tokenizer writes it, cut to ``width`` characters; its ids where the tokenizer
    cannot write them (pre-tokenized ids past 255 read with data.tokenizer = 'bytes')."""
    try:
        text = tokenizer.decode(ids)
    except (ValueError, OverflowError, TypeError):
        return "ids " + " ".join(map(str, ids[:48])) + (" ..." if len(ids) > 48 else "")
    return repr(text if len(text) <= width else text[:width] + "...")
