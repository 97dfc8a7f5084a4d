"""What ``bigtrain plan`` shows: a readable table, a JSON document, and a PNG."""

from __future__ import annotations

from pathlib import Path

from bigtrain.plan.expert_load import exchange_payload, expert_load
from bigtrain.plan.layout import Cluster
from bigtrain.plan.search import Plan, SearchResult, explain_no_fit, explain_ranking, readable_bytes, readable_rate
from bigtrain.plan.model import ModelSpec

GIB = 2**30
MEMORY_ROWS = ("params", "grads", "optimizer", "model_states", "activations", "buffers", "allocator", "total")


def size(nbytes: float) -> str:
    return readable_bytes(nbytes, digits=2)


def rate(flops: float) -> str:
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops >= scale:
            return f"{flops / scale:,.0f} {unit}"
    return f"{flops:,.0f} FLOP/s"


def _header(model: ModelSpec, cluster: Cluster, global_batch: int) -> list[str]:
    hw = cluster.hardware
    return [f"model    {model.describe()}",
            f"cluster  {cluster.gpus} x {hw.name} in {cluster.nodes} node(s) of {cluster.gpus_per_node}: "
            f"{size(hw.memory_bytes)} each, peak {rate(hw.peak_flops_bf16)} bf16 / {rate(hw.peak_flops_fp32)} "
            f"fp32, " + (f"large GEMMs at {hw.gemm_fraction:.2f} of it (shape-aware)" if hw.gemm_fraction > 0
                          else f"x {hw.achievable_fraction:.2f} achievable"),
            f"batch    {global_batch} sequences x {model.seq} tokens = {global_batch * model.seq:,} tokens per step"]


def plan_table(plan: Plan) -> list[str]:
    """One layout: memory on the worst rank and where the step's time goes."""
    mem = plan.memory.to_dict()
    lines = [f"layout   {plan.layout.describe()}",
             f"fits     {'yes' if plan.fits else 'NO'} ({size(mem['total'])} of {size(mem['capacity'])} "
             f"on the worst rank, pipeline rank {mem['worst_pp_rank']})",
             "memory on the worst rank:"]
    lines += [f"  {name:<13}{size(mem[name]):>12}" for name in MEMORY_ROWS]
    lines += expert_rows_lines(plan)
    t = plan.time
    if t is not None:
        parts = ", ".join(f"{k} {v:.3g}" for k, v in t.breakdown.items() if v > 0)
        lines += [f"step     {t.step_time_s:.3g} s ({parts}; pipeline: {t.pipeline_source})",
                  f"speed    {readable_rate(t.tokens_per_s)} tokens/s ({readable_rate(t.tokens_per_s / plan.cluster.gpus)} per GPU), "
                  f"MFU {t.mfu:.1%}, HFU {t.hfu:.1%}, {t.micro_batches} micro-batches per step"]
    return lines


def expert_rows_lines(plan: Plan) -> list[str]:
    """What the activations and all-to-all assume of the routing (plan/expert_load.py), where it
    matters: under expert parallelism, or with a capacity factor."""
    model, layout, rows = plan.model, plan.layout, plan.memory.detail.get("moe_expert_rows")
    if rows is None or (layout.ep == 1 and not rows["capacity_bound"]):
        return []
    load = expert_load(model, layout.ep, layout.seq_shards)
    dispatch, combine = exchange_payload(model, layout, load.even)
    _, most = exchange_payload(model, layout, load.worst)
    if load.bounded:
        return [f"experts  capacity {model.capacity_factor:g}, priced at its bound: at most {load.worst:g} routed rows a "
                f"token on a rank's experts ({load.even:g} at an even split); the activations are an upper bound "
                f"whatever the router does",
                f"         all-to-all per MoE block and micro-batch: dispatch {size(dispatch)} at most, combine "
                f"{size(combine)} at an even split, {size(most)} at most (again in backward; time at the even split)"]
    lines = [f"experts  dropless, priced at an even split: {load.even:g} routed rows a token on each rank's experts; "
             f"all-to-all per MoE block and micro-batch: dispatch {size(dispatch)}, combine {size(combine)} "
             f"(again in backward)"]
    if "skewed_total" in rows:
        fits = "fits" if rows["skewed_fits"] else "does NOT fit"
        lines.append(f"         worst case, every routing on one rank's experts ({load.worst:g} rows a token): "
                     f"activations {size(rows['skewed_activations'])}, total {size(rows['skewed_total'])} ({fits}), "
                     f"combine {size(most)}; model.moe_capacity_factor bounds it")
    return lines


def ranking_table(result: SearchResult, top: int) -> list[str]:
    plans = result.ranked[:top]
    width = max(len(p.layout.describe()) for p in plans) + 2
    rows = [f"{'#':>3}  {'layout':<{width}}{'tokens/s':>12}{'MFU':>7}{'memory':>12}"]
    for i, plan in enumerate(plans, 1):
        rows.append(f"{i:>3}  {plan.layout.describe():<{width}}{readable_rate(plan.tokens_per_s):>12}{plan.time.mfu:>7.1%}"
                    f"{size(plan.memory.total):>12}")
    return rows


def text_report(model: ModelSpec, cluster: Cluster, global_batch: int, result: SearchResult, top: int = 5) -> str:
    lines = _header(model, cluster, global_batch) + [""]
    if result.best is not None:
        lines += plan_table(result.best) + [""]
        if len(result.ranked) > 1:
            lines += ["ranked layouts that fit:"] + ranking_table(result, top) + [""]
        lines += explain_ranking(result, top=3)
    else:
        lines += explain_no_fit(result, cluster)
        if result.closest is not None:
            lines += [""] + plan_table(result.closest)
    return "\n".join(lines)


def json_report(model: ModelSpec, cluster: Cluster, global_batch: int, result: SearchResult, top: int = 5) -> dict:
    """At least: fits, params, memory{params, grads, optimizer, model_states, activations, total},
    step_time_s, tokens_per_s, mfu and the resolved layout (of the best plan, or of the closest
    one when nothing fits)."""
    chosen = result.best or result.closest
    out = chosen.to_dict()
    out.update(model=model.__dict__.copy(), hardware=cluster.hardware.to_dict(), gpus=cluster.gpus,
               gpus_per_node=cluster.gpus_per_node, global_batch=global_batch,
               layouts_considered=result.considered, layouts_valid=result.valid, layouts_rejected=result.rejected,
               ranked=[p.to_dict() for p in result.ranked[:top]])
    if result.best is not None:
        out["explanation"] = explain_ranking(result, top=3)
    else:
        out["explanation"] = explain_no_fit(result, cluster)
        out["closest"] = chosen.layout.describe()
    return out


def write_png(path: str | Path, result: SearchResult, top: int = 10) -> Path:
    """Left: the chosen layout's memory on its worst rank against the device; middle: the ranked
    layouts' predicted speed (axis from 0, each labelled with its gap to #1); right:
    each ranked layout's memory on its worst rank, by kind, against the device."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = result.best or result.closest
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(18, 5.5), gridspec_kw={"width_ratios": [1, 2.2, 1.4]})
    _memory_panel(left, plan)
    _ranking_panel(middle, result.ranked[:top], len(result.ranked))
    _ranked_memory_panel(right, result.ranked[:top])
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _memory_panel(ax, plan: Plan) -> None:
    mem = plan.memory.to_dict()
    bottom = 0.0
    for name in ("params", "grads", "optimizer", "activations", "buffers", "allocator"):
        value = mem[name] / GIB
        ax.bar(0, value, width=0.6, bottom=bottom, label=f"{name} {value:.2f} GiB")
        bottom += value
    ax.axhline(mem["capacity"] / GIB, color="black", linestyle="--", label=f"device {mem['capacity'] / GIB:.1f} GiB")
    ax.set_xlim(-0.5, 2.2)
    ax.set_xticks([])
    ax.set_ylabel("GiB on the worst rank")
    ax.set_title(("fits" if plan.fits else "does not fit") + f" ({mem['total'] / GIB:.1f} GiB)", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")


def _ranking_panel(ax, ranked: list[Plan], total: int) -> None:
    if not ranked:
        ax.text(0.5, 0.5, "no layout fits", ha="center", va="center")
        ax.set_axis_off()
        return
    speeds = [p.tokens_per_s for p in ranked][::-1]
    ax.barh(range(len(ranked)), speeds, color="tab:blue", alpha=0.35)
    high = max(speeds)
    # From 0, so bar lengths compare honestly: the top layouts are often within a few percent, and
    # an axis cut near the slowest made a 0.5% gap look like 2x. Each label gives the gap in numbers.
    ax.set_xlim(0, high * 1.02)
    left = 0.0
    for y, plan in enumerate(ranked[::-1]):
        gap = plan.tokens_per_s / high - 1
        ax.text(left, y, f" {plan.layout.describe()}   MFU {plan.time.mfu:.1%}   "
                         f"{readable_rate(plan.tokens_per_s)} tok/s" + (f" ({gap:+.1%} vs #1)" if y < len(ranked) - 1 else ""),
                va="center", fontsize=7)
    ax.set_yticks(range(len(ranked)), [f"#{i}" for i in range(len(ranked), 0, -1)])
    ax.set_xlabel("predicted tokens/s")
    ax.set_title(f"top {len(ranked)} of {total} layouts that fit", fontsize=10)


def _ranked_memory_panel(ax, ranked: list[Plan]) -> None:
    if not ranked:
        ax.set_axis_off()
        return
    kinds = ("params", "grads", "optimizer", "activations", "buffers", "allocator")
    rows = [p.memory.to_dict() for p in ranked][::-1]
    left = [0.0] * len(rows)
    for kind in kinds:
        values = [r[kind] / GIB for r in rows]
        ax.barh(range(len(rows)), values, left=left, label=kind)
        left = [a + b for a, b in zip(left, values)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.1f}", va="center", fontsize=7)
    ax.axvline(rows[0]["capacity"] / GIB, color="black", linestyle="--", label="device")
    ax.set_yticks(range(len(rows)), [f"#{i}" for i in range(len(rows), 0, -1)])
    ax.set_xlabel("GiB on the worst rank")
    ax.set_title("memory of each ranked layout", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4)
