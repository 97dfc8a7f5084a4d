"""What the training engine overlaps and how wide it reduces: the part of a step's time that is
software, not hardware.

The planner predicts bigtrain's own runtime (``BIGTRAIN``). A published run was made by another
engine, and the time of its layout depends on what that engine hid: ``plan/published.py`` gives
each run the engine its source states, so the comparison judges the time model and not the
difference between two runtimes. Every overlap hides behind the hardware profile's
``comm_overlap`` share of the compute window it runs under; nothing here is fitted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Engine:
    name: str
    # Tensor-parallel all-gathers and reduce-scatters split into chunks that run under the GEMMs
    # they feed (Megatron-Core's --tp-comm-overlap, Transformer Engine userbuffers). bigtrain runs
    # them on the critical path of every layer.
    tp_comm_overlap: bool = False
    # ZeRO-1/2's all-gather of the updated weights issued bucket by bucket under the next step's
    # first forward (--overlap-param-gather). bigtrain gathers synchronously after the step.
    param_gather_overlap: bool = False
    # Bytes per gradient element on the wire; 0: the runtime's reduce dtype (the training precision's,
    # fp32 under fp16: bigtrain/precision.py). Megatron keeps fp32
    # main gradients under bf16 and reduces them in fp32 unless --grad-reduce-in-bf16
    # (megatron/training/arguments.py: "bfloat16 requires gradient accumulation and all-reduce
    # to be done in fp32").
    grad_reduce_bytes: int = 0
    # Hybrid sharded data parallel (ZeRO within a group, replicas across groups: parallel.dp_replicate).
    # The search offers it only to an engine that has it; the published runs' sources did not use it.
    hybrid_sharding: bool = False


BIGTRAIN = Engine("bigtrain", hybrid_sharding=True)
# The Megatron-LM README's H100 table: --overlap-grad-reduce, --overlap-param-gather and
# --tp-comm-overlap, bf16 with the default fp32 gradient reduction.
MEGATRON_CORE = Engine("Megatron-Core", tp_comm_overlap=True, param_gather_overlap=True, grad_reduce_bytes=4)
