"""Pipeline parallelism: schedules as data, their validator, simulator and drawing; stage
partitioning of a plain model; and the executor that runs a rank's action list.

Only ``executor`` touches torch.distributed: it walks ``build_schedule(...).actions[rank]``
and posts the transfers.
"""

from bigtrain.parallel.pipeline.draw import draw_timeline
from bigtrain.parallel.pipeline.executor import PipelineExecutor, align_timelines
from bigtrain.parallel.pipeline.partition import (
    BALANCE_MODES,
    LlamaStage,
    PipelineStage,
    SequentialStage,
    StageGroup,
    balanced_split_points,
    check_pipeline_layout,
    check_split_points,
    even_split_points,
    split_llama,
    split_model,
    split_sequential,
    stages_for_rank,
)
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
    "BALANCE_MODES",
    "LlamaStage",
    "PipelineExecutor",
    "PipelineStage",
    "SCHEDULE_KINDS",
    "SequentialStage",
    "StageGroup",
    "align_timelines",
    "balanced_split_points",
    "check_pipeline_layout",
    "check_split_points",
    "even_split_points",
    "split_llama",
    "split_model",
    "split_sequential",
    "stages_for_rank",
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
