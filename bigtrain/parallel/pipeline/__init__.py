"""Pipeline parallelism: schedules as data, their validator, simulator and drawing.

Nothing in this package touches torch.distributed; an executor walks
``build_schedule(...).actions[rank]`` and posts the transfers.
"""

from bigtrain.parallel.pipeline.draw import draw_timeline
from bigtrain.parallel.pipeline.schedules import (
    SCHEDULE_KINDS,
    Action,
    Op,
    Schedule,
    build_schedule,
    compute_dependencies,
    matching_comm,
    outgoing_transfer,
)
from bigtrain.parallel.pipeline.simulate import SimResult, peak_inflight, simulate
from bigtrain.parallel.pipeline.validate import ScheduleError, validate

__all__ = [
    "SCHEDULE_KINDS",
    "Action",
    "Op",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "build_schedule",
    "compute_dependencies",
    "draw_timeline",
    "matching_comm",
    "outgoing_transfer",
    "peak_inflight",
    "simulate",
    "validate",
]
