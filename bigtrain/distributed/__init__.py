"""Mesh, counted collectives and launching."""

from bigtrain.distributed.comm import AxisComm, CommStats
from bigtrain.distributed.mesh import Mesh

__all__ = ["AxisComm", "CommStats", "Mesh"]
