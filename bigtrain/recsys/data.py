"""Click-through data: a synthetic Criteo-like generator and a reader of the Criteo TSV format.

Both hand out ``batch(step, first, count)``: samples ``first .. first + count`` of step ``step``'s
global batch as (dense [count, 13] fp32, ids [count, 26, hotness] int64, labels [count] fp32). A
rank asks for its own slice, so every layout trains on the same global batches.

The synthetic generator draws each sample from a counter-based hash of (seed, sample index,
feature, slot): no generator state, so a sample is the same whoever draws it and in whatever
batch shape (layout-independent), and a held-out slice (indices from ``HELD_OUT``) never meets
the training samples.

- dense features: standard normals;
- ids: power-law (log-uniform over [1, rows]: id k has probability ~ 1/k; a few rows are hot,
  as in Criteo);
- label: Bernoulli(sigmoid(logit)) with the planted signal ``logit = dense . beta + sum over the
  first ``SIGNAL_TABLES`` tables of a fixed effect per (table, id)`` (effects uniform in
  +-``EFFECT``, drawn from the hash too): what the model can learn, so the AUC can rise.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

DENSE, SPARSE = 13, 26
HELD_OUT = 1 << 40  # the first sample index of the held-out slice
SIGNAL_TABLES, EFFECT = 8, 2.0
MASK64 = (1 << 64) - 1


def _as_signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _M1, _M2 = (_as_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping arithmetic): a counter -> a well-spread hash."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def uniform(*keys: torch.Tensor | int) -> torch.Tensor:
    """U[0, 1) from the hash of ``keys`` (broadcast together), 24 bits of it."""
    h = torch.zeros((), dtype=torch.int64)
    for k in keys:
        h = mix64(h ^ (torch.as_tensor(k, dtype=torch.int64) * 0x2545F491))  # mix each key in turn
    return _shr(h, 40).to(torch.float64) / float(1 << 24)


class SyntheticCriteo:
    def __init__(self, table_rows: list[int], hotness: int = 1, seed: int = 0, dense: int = DENSE,
                 global_batch: int = 1, first_index: int = 0):
        self.rows = torch.tensor(table_rows, dtype=torch.float64)
        self.hotness, self.seed, self.dense, self.global_batch = hotness, seed, dense, global_batch
        self.first_index = first_index
        self.beta = torch.randn(dense, generator=torch.Generator().manual_seed(seed + 17)) / math.sqrt(dense)

    def held_out(self) -> "SyntheticCriteo":
        return SyntheticCriteo([int(r) for r in self.rows], self.hotness, self.seed, self.dense, self.global_batch,
                               HELD_OUT)

    def samples(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Samples ``first .. first + count`` of the stream (from ``first_index``)."""
        index = torch.arange(first, first + count, dtype=torch.int64) + self.first_index
        tables, hot = len(self.rows), self.hotness
        i = index.view(-1, 1)
        u1 = uniform(self.seed, 1, i, torch.arange(self.dense)).clamp_min(1e-12)
        u2 = uniform(self.seed, 2, i, torch.arange(self.dense))
        dense = (torch.sqrt(-2 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).float()  # Box-Muller
        slot = torch.arange(tables * hot).view(1, tables, hot)
        u = uniform(self.seed, 3, index.view(-1, 1, 1), slot)
        rows = self.rows.view(1, tables, 1)
        ids = torch.minimum(torch.exp(u * torch.log(rows + 1)).floor() - 1, rows - 1).clamp_min(0).long()
        effect = (uniform(self.seed, 4, torch.arange(tables).view(1, tables, 1), ids) * 2 - 1) * EFFECT
        logit = dense.double() @ self.beta.double() + effect[:, :SIGNAL_TABLES].mean(2).sum(1)
        labels = (uniform(self.seed, 5, index) < torch.sigmoid(logit)).float()
        return dense, ids, labels

    def batch(self, step: int, first: int, count: int):
        return self.samples(step * self.global_batch + first, count)


# -- the Criteo TSV format --------------------------------------------------------------------------
def read_criteo_tsv(path: str | Path, table_rows: list[int], dense: int = DENSE
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Criteo display-ads files (Kaggle / Terabyte day_N): one sample a line, tab-separated:
    label, ``dense`` integer features, then one hexadecimal category per table; any field may be
    empty. Dense values become log(1 + max(x, 0)) (0 when missing), as DLRM's preprocessing does;
    a category becomes its value modulo the table's rows (missing: 0). Raises ValueError naming the
    line of a malformed sample."""
    labels, dense_rows, id_rows = [], [], []
    tables = len(table_rows)
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            fields = line.rstrip("\n").split("\t")
            if len(fields) != 1 + dense + tables:
                raise ValueError(f"{path}:{number}: {len(fields)} tab-separated fields, expected "
                                 f"1 label + {dense} dense (model.dlrm_dense_features) + {tables} categorical "
                                 f"(the tables of embedding.tables) = {1 + dense + tables}")
            # a click label; any other value would train binary cross-entropy on a target outside [0, 1]
            if fields[0] not in ("0", "1"):
                raise ValueError(f"{path}:{number}: label {fields[0]!r} is not 0 or 1 (the first field is the click)")
            try:
                labels.append(float(fields[0]))
                dense_rows.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1:1 + dense]])
                id_rows.append([int(x, 16) % r if x else 0 for x, r in zip(fields[1 + dense:], table_rows)])
            except ValueError as e:
                raise ValueError(f"{path}:{number}: {e}") from None
    if not labels:
        raise ValueError(f"{path}: no samples")
    return (torch.tensor(dense_rows, dtype=torch.float32), torch.tensor(id_rows, dtype=torch.int64).unsqueeze(2),
            torch.tensor(labels, dtype=torch.float32))


class CriteoTsv:
    """Samples of a Criteo TSV file in file order, wrapping around; the last ``held_out_fraction``
    of the file is the held-out slice."""

    def __init__(self, path: str | Path, table_rows: list[int], global_batch: int, held_out_fraction: float = 0.1,
                 data=None, dense: int = DENSE):
        self.data = data if data is not None else read_criteo_tsv(path, table_rows, dense)
        self.path, self.table_rows, self.global_batch, self.dense = path, table_rows, global_batch, dense
        n = self.data[2].shape[0]
        # at least one held-out sample: a file shorter than 1 / held_out_fraction lines would
        # otherwise be scored on its own training samples
        held = max(1, int(n * held_out_fraction)) if held_out_fraction > 0 and data is None else 0
        if held and n - held < 1:
            raise ValueError(f"data.source = '{path}': {n} sample(s), too few to hold out the last "
                             f"{held_out_fraction:.0%} and train on the rest; give it at least 2 lines")
        self.split = n - held
        self.train = tuple(t[:self.split] for t in self.data)
        self.rest = tuple(t[self.split:] for t in self.data) if self.split < n else self.train

    def held_out(self) -> "CriteoTsv":
        return CriteoTsv(self.path, self.table_rows, self.global_batch, data=self.rest, dense=self.dense)

    def samples(self, first: int, count: int):
        index = torch.arange(first, first + count) % self.train[2].shape[0]
        return tuple(t[index] for t in self.train)

    def batch(self, step: int, first: int, count: int):
        return self.samples(step * self.global_batch + first, count)


def sampler_for(cfg, table_rows: list[int]):
    """The training sampler a Config names: data.source = 'synthetic' or a Criteo TSV file."""
    if cfg.data.source == "synthetic":
        return SyntheticCriteo(table_rows, cfg.embedding.hotness, cfg.train.seed, cfg.model.dlrm_dense_features,
                               cfg.train.global_batch)
    return CriteoTsv(cfg.data.source, table_rows, cfg.train.global_batch, dense=cfg.model.dlrm_dense_features)
