"""Published large runs and the planner's predictions of them (``python -m bigtrain.plan.published``).

Each run fixes what its paper reports (model, hardware, GPUs, batch, mesh, and recomputation or
sequence parallelism where stated); the planner chooses what is not reported (micro-batch,
schedule and v, and otherwise recomputation and ZeRO stage) by its own search, as it would for a
user. The metric is the one the source reports:

* ``hfu_tflops``: achieved TFLOP/s per GPU counting recomputation (Megatron-LM 2021 counts
  96 B s L h^2 (1 + s/6h + V/16Lh) per step, which is exactly our hardware FLOPs with full recompute);
* ``mfu``: model FLOPs utilization (Korthikanti et al. 2022, via the Megatron-LM README);
* ``mfu_tflops``: model TFLOP/s per GPU (Llama 3; Megatron-Core's H100 weak-scaling table);
* ``tokens_per_gpu_s``: tokens per GPU-second derived from reported GPU-hours and tokens (Llama 2);
  it includes every stall of a months-long run, so a prediction above it is expected.
"""

from __future__ import annotations

from dataclasses import dataclass

from bigtrain.plan.engine import BIGTRAIN, MEGATRON_CORE, Engine
from bigtrain.plan.hardware import get_profile
from bigtrain.plan.layout import Cluster
from bigtrain.plan.model import ModelSpec
from bigtrain.plan.search import Plan, search

GPT = dict(vocab=51200, seq=2048, mlp="gelu")
LLAMA3_405B = dict(layers=126, hidden=16384, heads=128, kv_heads=8, vocab=128256, seq=8192, ffn_hidden=53248)


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    model: dict
    hardware: str
    gpus: int
    global_batch: int
    fixed: dict  # layout keys the source reports
    metric: str
    value: float
    precision: str = "bf16"
    engine: Engine = BIGTRAIN  # what the source's software overlapped, where it says (plan/engine.py)


NARAYANAN = "Narayanan et al., SC'21 (arXiv 2104.04473), Table 1; README: 502 PFLOP/s on 3072 A100 for 1T"
KORTHIKANTI = "Korthikanti et al., MLSys'23 (arXiv 2205.05198), via the Megatron-LM README MFU table"
LLAMA3 = "Llama 3 Herd of Models (arXiv 2407.21783), Table 4 (also Balaji, SC'24)"
LLAMA2 = "Llama 2 (arXiv 2307.09288), Table 2: GPU-hours for 2.0 T tokens on A100-80GB"
# The Megatron-LM README's "Model table" (images/model_table.png in NVIDIA/Megatron-LM, read
# 2026-11-23): GPT weak scaling on H100, vocab 131072, seq 4096, communication overlapped in dp
# (--overlap-grad-reduce, --overlap-param-gather: the distributed optimizer, ZeRO-1), tp and pp.
MCORE = "Megatron-LM README, Model table (H100 weak scaling; per-GPU model TFLOP/s)"
MCORE_GPT = dict(vocab=131072, seq=4096, mlp="gelu")


def _mcore(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
           tflops: float) -> "PublishedRun":
    return PublishedRun(f"GPT {size}, {gpus} x H100", MCORE, dict(layers=layers, hidden=hidden, heads=heads, **MCORE_GPT),
                        "h100-80g", gpus, batch, dict(dp=48, tp=tp, pp=pp, sp=1, zero=1, tp_sp=tp > 1),
                        "mfu_tflops", tflops, engine=MEGATRON_CORE)

RUNS = [
    PublishedRun("GPT 1.7B, 32 x A100", NARAYANAN, dict(layers=24, hidden=2304, heads=24, **GPT), "a100-80g", 32,
                 512, dict(dp=32, tp=1, pp=1, sp=1, zero=0, recompute="full"), "hfu_tflops", 137, "fp16"),
    PublishedRun("GPT 3.6B, 64 x A100", NARAYANAN, dict(layers=30, hidden=3072, heads=32, **GPT), "a100-80g", 64,
                 512, dict(dp=32, tp=2, pp=1, sp=1, zero=0, recompute="full", tp_sp=False), "hfu_tflops", 138, "fp16"),
    PublishedRun("GPT 7.5B, 128 x A100", NARAYANAN, dict(layers=36, hidden=4096, heads=32, **GPT), "a100-80g", 128,
                 512, dict(dp=32, tp=4, pp=1, sp=1, zero=0, recompute="full", tp_sp=False), "hfu_tflops", 142, "fp16"),
    PublishedRun("GPT 18.4B, 256 x A100", NARAYANAN, dict(layers=40, hidden=6144, heads=48, **GPT), "a100-80g", 256,
                 1024, dict(dp=32, tp=8, pp=1, sp=1, zero=0, recompute="full", tp_sp=False), "hfu_tflops", 135, "fp16"),
    PublishedRun("GPT 39.1B, 512 x A100", NARAYANAN, dict(layers=48, hidden=8192, heads=64, **GPT), "a100-80g", 512,
                 1536, dict(dp=32, tp=8, pp=2, sp=1, zero=0, recompute="full", tp_sp=False), "hfu_tflops", 138,
                 "fp16"),
    PublishedRun("GPT 76.1B, 1024 x A100", NARAYANAN, dict(layers=60, hidden=10240, heads=80, **GPT), "a100-80g",
                 1024, 1792, dict(dp=32, tp=8, pp=4, sp=1, zero=0, recompute="full", tp_sp=False), "hfu_tflops", 140,
                 "fp16"),
    PublishedRun("GPT 145.6B, 1536 x A100", NARAYANAN, dict(layers=80, hidden=12288, heads=96, **GPT), "a100-80g",
                 1536, 2304, dict(dp=24, tp=8, pp=8, sp=1, zero=0, recompute="full", tp_sp=False), "hfu_tflops", 148,
                 "fp16"),
    PublishedRun("GPT 310.1B, 1920 x A100", NARAYANAN, dict(layers=96, hidden=16384, heads=128, **GPT), "a100-80g",
                 1920, 2160, dict(dp=15, tp=8, pp=16, sp=1, zero=0, recompute="full", tp_sp=False), "hfu_tflops", 155,
                 "fp16"),
    PublishedRun("GPT 529.6B, 2520 x A100", NARAYANAN, dict(layers=105, hidden=20480, heads=128, **GPT), "a100-80g",
                 2520, 2520, dict(dp=9, tp=8, pp=35, sp=1, zero=0, recompute="full", tp_sp=False), "hfu_tflops", 163,
                 "fp16"),
    PublishedRun("GPT 1T, 3072 x A100", NARAYANAN, dict(layers=128, hidden=25600, heads=160, **GPT), "a100-80g",
                 3072, 3072, dict(dp=6, tp=8, pp=64, sp=1, zero=0, recompute="full", tp_sp=False), "hfu_tflops", 163,
                 "fp16"),
    PublishedRun("GPT 22B, 8 x A100", KORTHIKANTI, dict(layers=48, hidden=6144, heads=64, **GPT), "a100-80g", 8, 4,
                 dict(dp=1, tp=8, pp=1, sp=1, tp_sp=True), "mfu", 0.415),
    PublishedRun("GPT 175B, 64 x A100", KORTHIKANTI, dict(layers=96, hidden=12288, heads=96, **GPT), "a100-80g", 64,
                 64, dict(dp=1, tp=8, pp=8, sp=1, tp_sp=True), "mfu", 0.514),
    PublishedRun("GPT 530B, 280 x A100", KORTHIKANTI, dict(layers=105, hidden=20480, heads=128, **GPT), "a100-80g",
                 280, 280, dict(dp=1, tp=8, pp=35, sp=1, tp_sp=True), "mfu", 0.560),
    PublishedRun("GPT 1T, 512 x A100", KORTHIKANTI, dict(layers=128, hidden=25600, heads=160, **GPT), "a100-80g",
                 512, 512, dict(dp=1, tp=8, pp=64, sp=1, tp_sp=True), "mfu", 0.563),
    _mcore("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _mcore("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    _mcore("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    _mcore("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    _mcore("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    _mcore("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    _mcore("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    _mcore("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    _mcore("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
    PublishedRun("Llama 3 405B, 8192 x H100", LLAMA3, LLAMA3_405B, "h100-80g", 8192, 2048,
                 dict(dp=64, tp=8, pp=16, sp=1, micro_batch=1, tp_sp=True), "mfu_tflops", 430),
    PublishedRun("Llama 3 405B, 16384 x H100", LLAMA3, LLAMA3_405B, "h100-80g", 16384, 2048,
                 dict(dp=128, tp=8, pp=16, sp=1, micro_batch=1, tp_sp=True), "mfu_tflops", 400),
    PublishedRun("Llama 2 7B, A100 (512 assumed)", LLAMA2,
                 dict(layers=32, hidden=4096, heads=32, vocab=32000, seq=4096, ffn_hidden=11008), "a100-80g", 512,
                 1024, {}, "tokens_per_gpu_s", 2.0e12 / (184_320 * 3600)),
    PublishedRun("Llama 2 70B, A100 (512 assumed)", LLAMA2,
                 dict(layers=80, hidden=8192, heads=64, kv_heads=8, vocab=32000, seq=4096, ffn_hidden=28672),
                 "a100-80g", 512, 1024, {}, "tokens_per_gpu_s", 2.0e12 / (1_720_320 * 3600)),
]


def predicted_metric(plan: Plan, metric: str) -> float:
    t, gpus = plan.time, plan.cluster.gpus
    if metric == "hfu_tflops":
        return t.achieved_flops_per_gpu(gpus, hardware=True) / 1e12
    if metric == "mfu_tflops":
        return t.achieved_flops_per_gpu(gpus) / 1e12
    if metric == "mfu":
        return t.mfu
    if metric == "tokens_per_gpu_s":
        return t.tokens_per_s / gpus
    raise ValueError(f"unknown metric {metric!r}")


def run_profile(run: PublishedRun, hardware: dict | None = None):
    """The run's hardware profile (``hardware`` overrides fields), with the attention kernel it had."""
    import dataclasses

    return dataclasses.replace(get_profile(run.hardware), **(hardware or {}),
                               attention_kernel="unfused" if run.source in UNFUSED else "flash")


def predict(run: PublishedRun) -> Plan | None:
    """The planner's best layout for the run (None if nothing with the reported keys fits)."""
    model = ModelSpec.build(name=run.name, **run.model)
    cluster = Cluster.build(run.gpus, run_profile(run), engine=run.engine)
    return search(model, cluster, run.global_batch, {**run.fixed, "precision": run.precision}).best


# The keys a source leaves out, as the planner's search chose them (docs/planner.md): with these the
# whole layout is given and the comparison judges the time model alone (scripts/planner-published.py).
CHOSEN = {
    "GPT 1.7B, 32 x A100": dict(micro_batch=8),
    "GPT 3.6B, 64 x A100": dict(micro_batch=8),
    "GPT 7.5B, 128 x A100": dict(micro_batch=8),
    "GPT 18.4B, 256 x A100": dict(micro_batch=8),
    "GPT 39.1B, 512 x A100": dict(micro_batch=4, schedule="interleaved", v=4),
    "GPT 76.1B, 1024 x A100": dict(micro_batch=2, schedule="interleaved", v=4),
    "GPT 145.6B, 1536 x A100": dict(micro_batch=1, schedule="interleaved", v=4),
    "GPT 310.1B, 1920 x A100": dict(micro_batch=1, schedule="interleaved", v=4),
    "GPT 529.6B, 2520 x A100": dict(micro_batch=1, schedule="interleaved", v=2),
    "GPT 1T, 3072 x A100": dict(micro_batch=1, schedule="interleaved", v=2),
    "GPT 22B, 8 x A100": dict(zero=0, micro_batch=4, recompute="none"),
    "GPT 175B, 64 x A100": dict(zero=0, micro_batch=1, schedule="interleaved", v=4, recompute="none"),
    "GPT 530B, 280 x A100": dict(zero=0, micro_batch=1, schedule="1f1b", recompute="none"),
    "GPT 1T, 512 x A100": dict(zero=0, micro_batch=1, schedule="interleaved", v=2, recompute="every", every=2),
    "GPT 1.7B, 48 x H100": dict(micro_batch=4, recompute="none"),
    "GPT 7.1B, 96 x H100": dict(micro_batch=4, recompute="none"),
    "GPT 16B, 192 x H100": dict(micro_batch=4, recompute="none"),
    "GPT 32B, 384 x H100": dict(micro_batch=4, recompute="none"),
    "GPT 70B, 768 x H100": dict(micro_batch=2, schedule="interleaved", v=4, recompute="none"),
    "GPT 119B, 1536 x H100": dict(micro_batch=1, schedule="interleaved", v=4, recompute="none"),
    "GPT 177B, 2304 x H100": dict(micro_batch=1, schedule="interleaved", v=4, recompute="none"),
    "GPT 314B, 3072 x H100": dict(micro_batch=1, schedule="interleaved", v=4, recompute="every", every=2),
    "GPT 462B, 6144 x H100": dict(micro_batch=1, schedule="interleaved", v=4, recompute="every", every=2),
    "Llama 3 405B, 8192 x H100": dict(zero=2, schedule="interleaved", v=4, recompute="full"),
    "Llama 3 405B, 16384 x H100": dict(zero=2, schedule="interleaved", v=4, recompute="full"),
    "Llama 2 7B, A100 (512 assumed)": dict(dp=512, tp=1, pp=1, sp=1, zero=3, micro_batch=2, recompute="none"),
    "Llama 2 70B, A100 (512 assumed)": dict(dp=128, tp=4, pp=1, sp=1, zero=3, micro_batch=2, recompute="selective",
                                            tp_sp=True),
}
# Megatron-LM 2021-22 materialized the s x s scores (no flash kernel); Llama 2 and 3 used flash attention.
UNFUSED = (NARAYANAN, KORTHIKANTI)


def full_layout(run: PublishedRun):
    from bigtrain.plan.layout import Layout

    return Layout(**{**run.fixed, **CHOSEN[run.name], "precision": run.precision})


def evaluate_published(run: PublishedRun, hardware: dict | None = None) -> dict:
    """The run with its whole layout given, on its profile (``hardware`` overrides fields)."""
    from bigtrain.plan.search import evaluate

    profile = run_profile(run, hardware)
    model = ModelSpec.build(name=run.name, **run.model)
    plan = evaluate(model, full_layout(run), Cluster.build(run.gpus, profile, engine=run.engine), run.global_batch)
    value = predicted_metric(plan, run.metric)
    return {"run": run.name, "source": run.source, "metric": run.metric, "published": run.value, "predicted": value,
            "ratio": value / run.value, "fits": plan.fits,
            "layout": plan.layout.describe() + ("" if plan.fits else " (does not fit)")}


def comparison_rows() -> list[dict]:
    rows = []
    for run in RUNS:
        plan = predict(run)
        value = predicted_metric(plan, run.metric) if plan else float("nan")
        rows.append({"run": run.name, "source": run.source, "metric": run.metric, "published": run.value,
                     "predicted": value, "ratio": value / run.value,
                     "layout": plan.layout.describe() if plan else "nothing fits"})
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| run | metric | published | predicted | predicted / published | layout the planner chose |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        fmt = (lambda v: f"{v:.1%}") if r["metric"] == "mfu" else (lambda v: f"{v:,.0f}")
        lines.append(f"| {r['run']} | {r['metric']} | {fmt(r['published'])} | {fmt(r['predicted'])} | "
                     f"{r['ratio']:.2f} | `{r['layout']}` |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(markdown_table(comparison_rows()))
