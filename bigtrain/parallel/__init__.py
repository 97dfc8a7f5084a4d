"""Parallel layouts applied to plain models: data parallel and ZeRO 0-3 (tensor, sequence and
pipeline execution to come)."""

from bigtrain.parallel.data import DataParallel
from bigtrain.parallel.replicated import ReplicatedEngine
from bigtrain.parallel.zero import ZeroEngine

__all__ = ["DataParallel", "ReplicatedEngine", "ZeroEngine"]
