"""Layout-independent sampling of token windows.

Sampling depends only on (seed, step, global batch): step ``t`` draws the same ``global_batch``
windows whatever the layout, and each data-parallel rank takes its contiguous slice. Resuming at
step ``t`` therefore needs nothing but ``t``. The tokens are any 1-D sequence of ids that slices
into arrays: a memory-mapped file, or the shards of a tokenized corpus (:class:`ShardedTokens`).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from bigtrain.core.targets import IGNORE_INDEX


FINGERPRINT_SAMPLES, FINGERPRINT_TOKENS = 16, 64  # places read for a corpus's fingerprint, tokens at each


class DataChanged(RuntimeError):
    """The token file a run maps became shorter while the run read it (exit 1)."""


class MappedFile:
    """The file behind a memory-mapped corpus, and its size when the run mapped it. Reading a page
    of a mapping past the end of a file truncated meanwhile kills the process with SIGBUS, naming
    nothing; :meth:`check` is called before every read of windows and names the file instead.
    (A file replaced by a rename keeps the old one mapped and is not a problem.)"""

    def __init__(self, path: str, size: int, field: str = "data.source"):
        self.path, self.size, self.field = path, size, field

    @classmethod
    def of(cls, tokens: np.ndarray, field: str = "data.source") -> "MappedFile | None":
        name = getattr(tokens, "filename", None)
        if not isinstance(tokens, np.memmap) or not name:
            return None
        try:
            return cls(name, os.stat(name).st_size, field)
        except OSError:
            return None

    def check(self) -> None:
        try:
            now = os.stat(self.path).st_size
        except OSError as e:
            now, why = None, e.strerror
        else:
            why = None
        if now is not None and now >= self.size:
            return
        state = f"it has {now} bytes" if now is not None else f"it cannot be read ({why})"
        raise DataChanged(f"{self.field}: the token file {self.path} changed while the run read it: {state}, {self.size} when the "
                          f"run started (truncated or rewritten in place?); the run stopped before reading past its "
                          f"end. Restore the file (or write a new one under another name: {self.field}), then "
                          f"continue with --resume")


def split_problem(tokens: int, seq_len: int, val_fraction: float) -> str | None:
    """Why a corpus of ``tokens`` ids cannot be cut into a training part holding one window and the
    next target and a held-out slice (``val_fraction``) holding one window; None when it can. The
    sampler raises it, and the checks before launch ask it of every corpus whose length they know."""
    held_out = int(tokens * val_fraction)
    if tokens - held_out < seq_len + 2:
        if not held_out:
            return f"corpus has {tokens} tokens, fewer than data.seq_len + 2 = {seq_len + 2}"
        return (f"data.val_fraction = {val_fraction:g} leaves {tokens - held_out} tokens before the held-out slice, "
                f"fewer than data.seq_len + 2 = {seq_len + 2}; lower data.val_fraction or give a longer corpus")
    if held_out and held_out < seq_len + 1:
        return (f"data.val_fraction = {val_fraction:g} holds out {held_out} tokens, fewer than one window "
                f"(data.seq_len + 1 = {seq_len + 1}); raise data.val_fraction or give a longer corpus")
    return None


class TokenSampler:
    """Random windows of ``seq_len + 1`` tokens; inputs and next-token targets. Targets equal to
    ``ignore_target`` (when >= 0) become :data:`IGNORE_INDEX`, so the loss leaves them out.

    ``val_fraction`` holds out the corpus's last tokens: training windows lie wholly before them,
    validation windows (:meth:`eval_batch`) wholly inside them, so the two never share a token.
    The split depends on the corpus and the fraction only, not on the layout or the seed. Or
    ``val_tokens``: a held-out corpus of its own (``data.val_source``), read as that slice is.

    ``vocab_size`` (set by ``vocab_field``): every window is checked against it as it is read, and
    one holding an id outside it is refused, naming the id and where it is. ``bigtrain train``
    checks token files before launch; this guards what reaches a Trainer made directly, where an
    id past the vocabulary crashed at tp=1 and trained silently at tp=2 (no vocabulary shard holds
    it: a zero embedding row, a target no logit stands for)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int, ignore_target: int = -1,
                 val_fraction: float = 0.0, vocab_size: int | None = None, vocab_field: str = "model.vocab_size",
                 val_tokens: np.ndarray | None = None, source_field: str = "data.source"):
        problem = split_problem(len(tokens), seq_len, val_fraction)
        if problem:
            raise ValueError(problem)
        if val_tokens is not None and val_fraction:
            raise ValueError("held-out data twice: a held-out corpus (data.val_source) and data.val_fraction")
        if val_tokens is not None and len(val_tokens) < seq_len + 1:
            raise ValueError(f"data.val_source has {len(val_tokens)} tokens, fewer than one window (data.seq_len + 1 "
                             f"= {seq_len + 1}); give a longer held-out corpus")
        held_out = int(len(tokens) * val_fraction)
        self.val_tokens = tokens[len(tokens) - held_out:] if held_out else tokens[:0]
        if val_tokens is not None:  # a corpus of its own (data.val_source)
            self.val_tokens = val_tokens
            self.val_mapped = MappedFile.of(val_tokens, "data.val_source")
        tokens = tokens[:len(tokens) - held_out]
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.ignore_target = ignore_target
        self.vocab_size, self.vocab_field, self.source_field = vocab_size, vocab_field, source_field
        self.mapped = MappedFile.of(tokens, source_field)
        if val_tokens is None:
            self.val_mapped = self.mapped  # the held-out slice is the corpus's
        self.val_where = "held-out slice" if val_tokens is None else "held-out corpus"

    def starts(self, step: int) -> np.ndarray:
        """Window starts of the whole global batch at ``step`` (layout-independent)."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)

    def _windows(self, tokens: np.ndarray, starts: np.ndarray, where: str = "corpus") -> tuple[torch.Tensor, torch.Tensor]:
        mapped = self.mapped if where == "corpus" else self.val_mapped
        if mapped is not None:
            mapped.check()
        windows = np.stack([np.asarray(tokens[s:s + self.seq_len + 1], dtype=np.int64) for s in starts])
        if self.vocab_size is not None and len(windows) and (windows.min() < 0 or windows.max() >= self.vocab_size):
            raise ValueError(self._outside_vocabulary(windows, starts, where))
        data = torch.from_numpy(windows)
        targets = data[:, 1:]
        if self.ignore_target >= 0:
            targets = targets.masked_fill(targets == self.ignore_target, IGNORE_INDEX)
        return data[:, :-1], targets

    def _outside_vocabulary(self, windows: np.ndarray, starts: np.ndarray, where: str) -> str:
        row, column = (int(i) for i in np.argwhere((windows < 0) | (windows >= self.vocab_size))[0])
        value, field = int(windows[row, column]), self.vocab_field
        fix = (f"set {field} to at least {value + 1}, or re-tokenize" if value >= 0 else
               "ids cannot be negative, re-tokenize")
        source = "data.val_source" if where == "held-out corpus" else self.source_field
        return (f"{source}: token id {value} at position {int(starts[row]) + column} of the {where}, outside "
                f"0 .. {field} - 1 = {self.vocab_size - 1}; {fix}")

    def token_counts(self) -> tuple[int, int]:
        """(training tokens, held-out tokens)."""
        return len(self.tokens), len(self.val_tokens)

    def fingerprint(self) -> str:
        """A digest of the corpus's tokens at :data:`FINGERPRINT_SAMPLES` places spread over its
        training part and its held-out tokens: a checkpoint records it, so a resume on a corpus
        edited in place (or tokenized again by another tokenizer) with the same token counts is
        said too. A sample, not every token: it costs a few reads whatever the corpus's size."""
        digest = hashlib.sha1()
        for tokens in (self.tokens, self.val_tokens):
            if len(tokens) == 0:
                continue
            for start in np.linspace(0, max(0, len(tokens) - FINGERPRINT_TOKENS), FINGERPRINT_SAMPLES).astype(np.int64):
                digest.update(np.asarray(tokens[start:start + FINGERPRINT_TOKENS], dtype=np.int64).tobytes())
        return digest.hexdigest()[:16]

    def batch(self, step: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``first .. first+count-1`` of the global batch at ``step``."""
        return self._windows(self.tokens, self.starts(step)[first:first + count])

    def counted_targets(self, step: int) -> int:
        """Targets the loss counts in the whole global batch at ``step``: the normalizer that makes
        every layout's summed loss the mean of one process (at least 1, so an all-masked batch is 0)."""
        if self.ignore_target < 0:
            return self.global_batch * self.seq_len
        return max(1, int((self.batch(step, 0, self.global_batch)[1] != IGNORE_INDEX).sum()))

    def micro_batches(self, step: int, dp_rank: int, dp: int, micro_batch: int):
        """This rank's micro-batches at ``step``: its contiguous slice of the global batch, in order."""
        per_rank = self.global_batch // dp
        for first in range(dp_rank * per_rank, (dp_rank + 1) * per_rank, micro_batch):
            yield self.batch(step, first, micro_batch)

    # -- the held-out slice ---------------------------------------------------------------------
    def eval_starts(self, batch: int, batches: int) -> np.ndarray:
        """Window starts (in the held-out slice) of validation global batch ``batch`` of
        ``batches``: all ``batches x global_batch`` windows spread evenly over the slice, the same
        at every evaluation (no randomness: the evaluations of a run are comparable)."""
        last = len(self.val_tokens) - self.seq_len - 1
        every = np.linspace(0, last, batches * self.global_batch).round().astype(np.int64)
        return every[batch * self.global_batch:(batch + 1) * self.global_batch]

    def eval_batch(self, batch: int, batches: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``first .. first+count-1`` of validation global batch ``batch``."""
        return self._windows(self.val_tokens, self.eval_starts(batch, batches)[first:first + count], self.val_where)

    def eval_targets(self, batches: int) -> int:
        """Targets the validation loss counts over all ``batches`` (its normalizer; at least 1)."""
        if self.ignore_target < 0:
            return batches * self.global_batch * self.seq_len
        return max(1, sum(int((self.eval_batch(b, batches, 0, self.global_batch)[1] != IGNORE_INDEX).sum())
                          for b in range(batches)))

    def eval_micro_batches(self, batches: int, dp_rank: int, dp: int, micro_batch: int):
        """This rank's micro-batches of every validation batch, as :meth:`micro_batches` cuts them."""
        per_rank = self.global_batch // dp
        for batch in range(batches):
            for first in range(dp_rank * per_rank, (dp_rank + 1) * per_rank, micro_batch):
                yield self.eval_batch(batch, batches, first, micro_batch)
