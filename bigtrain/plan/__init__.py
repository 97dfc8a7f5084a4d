"""The planner: per-rank memory and step time of any layout on any cluster, before launch.

    from bigtrain.plan import ModelSpec, Cluster, Layout, get_profile, evaluate, search
    model = ModelSpec.build(layers=32, hidden=4096, heads=32, vocab=32000, seq=4096)
    cluster = Cluster.build(8, get_profile("h100-80g"))
    plan = evaluate(model, Layout(dp=8, zero=1, micro_batch=1), cluster, global_batch=1024)
    plan.memory.total, plan.time.tokens_per_s
    best = search(model, cluster, global_batch=1024).best

See docs/planner.md for the formulas, assumptions and comparisons with published runs.
"""

# The submodule plan.calibrate first: importing it later would bind the package's ``calibrate`` to
# the module instead of the function below.
import bigtrain.plan.calibrate  # noqa: F401,E402  (isort: keep first)
from bigtrain.plan.activations import BlockActivations, block_activations, head_activations
from bigtrain.plan.cost import StepTime, step_time
from bigtrain.plan.hardware import PRESETS, HardwareProfile, calibrate, get_profile, load_profile, save_profile
from bigtrain.plan.layout import Cluster, Layout, layout_problems, parse_layout
from bigtrain.plan.memory import RankMemory, estimate_memory
from bigtrain.plan.states import state_bytes, zero_formula_bytes
from bigtrain.plan.model import ModelSpec
from bigtrain.plan.pipeline import PipelineModel, PipelineTerms, closed_form
from bigtrain.plan.search import Plan, SearchResult, evaluate, search

__all__ = [
    "PRESETS", "BlockActivations", "Cluster", "HardwareProfile", "Layout", "ModelSpec", "PipelineModel",
    "PipelineTerms", "Plan", "RankMemory", "SearchResult", "StepTime", "block_activations", "calibrate",
    "closed_form", "estimate_memory", "evaluate", "get_profile", "head_activations", "layout_problems",
    "load_profile", "parse_layout", "save_profile", "search", "state_bytes", "step_time", "zero_formula_bytes",
]
