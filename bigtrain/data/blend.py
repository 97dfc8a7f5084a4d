"""``data.blend``: training windows drawn from several corpora, each window's corpus by its share.

Megatron's blended datasets (the weights of ``--data-path``), drawn as the single corpus's windows are:
from a generator seeded by (seed, step), so every layout draws the same windows and a resume at step
``t`` needs nothing but ``t``. Each window lies in one corpus (its corpus first, then a start in that
corpus's training part), and each corpus is a :class:`~bigtrain.data.sampler.TokenSampler` of its
own: its held-out tail (``data.val_fraction``), its checks of ids against the vocabulary, its mapped
file's, each naming its field. Evaluation windows are shared out among the corpora's held-out tails
by share (largest remainders) and spread evenly within each, the same at every evaluation; with
``data.val_source`` they are that corpus's, as without a blend.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import numpy as np
import torch

from bigtrain.data.sampler import TokenSampler


class BlendedSampler(TokenSampler):
    """``parts[0]`` is data.source's sampler (holding data.val_source's corpus, when
    ``held_out_corpus``), the others data.blend's; ``shares`` their shares of the windows. It holds
    no corpus of its own: it draws the windows (:meth:`batch`, :meth:`eval_batch`) and reads them
    from its parts, and what :class:`TokenSampler` builds on those two (the micro-batches of a rank,
    the counted targets, the evaluation's) is shared as it is."""

    def __init__(self, parts: list[TokenSampler], shares: list[float], held_out_corpus: bool = False):
        first = parts[0]
        self.parts, self.shares = parts, np.asarray(shares, dtype=np.float64) / float(sum(shares))
        self.seq_len, self.global_batch, self.seed = first.seq_len, first.global_batch, first.seed
        self.ignore_target, self.held_out_corpus = first.ignore_target, held_out_corpus

    def token_counts(self) -> tuple[int, int]:
        counts = [p.token_counts() for p in self.parts]
        held_out = counts[0][1] if self.held_out_corpus else sum(h for _, h in counts)
        return sum(t for t, _ in counts), held_out

    def fingerprint(self) -> str:
        return hashlib.sha1("|".join(p.fingerprint() for p in self.parts).encode()).hexdigest()[:16]

    def picks(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(corpus, start) of each window of the global batch at ``step`` (layout-independent)."""
        rng = np.random.default_rng([self.seed, step, len(self.parts)])  # not the single corpus's stream
        which = rng.choice(len(self.parts), size=self.global_batch, p=self.shares)
        room = np.array([len(p.tokens) - self.seq_len - 1 for p in self.parts])
        return which, (rng.random(self.global_batch) * room[which]).astype(np.int64)

    def starts(self, step: int) -> np.ndarray:
        return self.picks(step)[1]

    def batch(self, step: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        which, starts = self.picks(step)
        return self._gather(which[first:first + count], starts[first:first + count],
                            lambda part, s: part._windows(part.tokens, s))

    # -- the held-out data ----------------------------------------------------------------------
    def eval_picks(self, batches: int) -> tuple[np.ndarray, np.ndarray]:
        """(corpus, start) of all ``batches x global_batch`` evaluation windows: each corpus's count
        by its share (largest remainders), spread evenly over its held-out tail, in corpus order."""
        total = batches * self.global_batch
        exact = self.shares * total
        counts = np.floor(exact).astype(np.int64)
        counts[np.argsort(-(exact - counts), kind="stable")[:total - counts.sum()]] += 1
        which = np.repeat(np.arange(len(self.parts)), counts)
        starts = [np.linspace(0, len(p.val_tokens) - self.seq_len - 1, n).round().astype(np.int64)
                  for p, n in zip(self.parts, counts)]
        return which, np.concatenate(starts)

    def eval_batch(self, batch: int, batches: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.held_out_corpus:  # data.val_source: one corpus of its own, as without a blend
            return self.parts[0].eval_batch(batch, batches, first, count)
        which, starts = self.eval_picks(batches)
        rows = slice(batch * self.global_batch + first, batch * self.global_batch + first + count)
        return self._gather(which[rows], starts[rows], lambda part, s: part._windows(part.val_tokens, s, part.val_where))

    def _gather(self, which: np.ndarray, starts: np.ndarray,
                read: Callable[[TokenSampler, np.ndarray], tuple[torch.Tensor, torch.Tensor]]):
        """The windows (inputs, targets) of ``starts``, each read from its corpus ``which``, in order."""
        inputs = torch.empty((len(which), self.seq_len), dtype=torch.int64)
        targets = torch.empty((len(which), self.seq_len), dtype=torch.int64)
        for corpus in np.unique(which):
            rows = np.nonzero(which == corpus)[0]
            at = torch.from_numpy(rows)
            inputs[at], targets[at] = read(self.parts[corpus], starts[rows])
        return inputs, targets
