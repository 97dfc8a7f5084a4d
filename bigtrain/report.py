"""The end-of-run report: a loss-curve PNG and a short markdown summary that says which run it is
(config hash, code, torch, layout, model, data), what it reached (final and held-out loss, tokens,
wall time), and the planner's prediction beside what was measured (step time, tokens/s, memory); for
a mixture of experts, each MoE block's expert load over the steps (a PNG) and at the last step (a table)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bigtrain.metrics import human_bytes, human_duration, read_metrics
from bigtrain.run_segments import read_segments, totals

MEM_KEYS = ("params", "grads", "optimizer", "activations")


def plot_loss(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".", label="training")
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], marker="o", label="held-out")
        ax.legend()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


MAX_BLOCKS_DRAWN = 6  # MoE blocks with a panel of their own in expert_load.png (the first ones)


def expert_load(records: list[dict]) -> dict[str, tuple[list[int], list[list[float]]]]:
    """{MoE block: (logged steps, per step each expert's share of the block's routings)} from the
    ``moe`` metrics (empty for a dense run)."""
    out: dict[str, tuple[list[int], list[list[float]]]] = {}
    for r in records:
        for block, m in (r.get("moe") or {}).items():
            total = sum(m["load"]) or 1
            steps, shares = out.setdefault(block, ([], []))
            steps.append(r["step"])
            shares.append([n / total for n in m["load"]])
    return out


def plot_expert_load(load: dict[str, tuple[list[int], list[list[float]]]], path: Path) -> None:
    """One panel per MoE block: each expert's share of the routings over the steps (1/E is balance)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = list(load)[:MAX_BLOCKS_DRAWN]
    fig, axes = plt.subplots(len(blocks), 1, figsize=(6, 1.8 * len(blocks) + 0.6), sharex=True, squeeze=False)
    for ax, block in zip(axes[:, 0], blocks):
        steps, shares = load[block]
        experts = len(shares[0])
        for e in range(experts):
            ax.plot(steps, [row[e] for row in shares], linewidth=1, label=f"expert {e}")
        ax.axhline(1 / experts, color="black", linewidth=0.8, linestyle="--")
        ax.set_ylabel("share")
        ax.set_title(block, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=6, ncol=4, loc="upper right")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _expert_load_lines(records: list[dict], load: dict) -> list[str]:
    last = next(r["moe"] for r in reversed(records) if r.get("moe"))
    lines = ["", "## Expert load (routings per expert, before capacity drops)", "", "![expert load](expert_load.png)",
             "", f"Last logged step ({next(r['step'] for r in reversed(records) if r.get('moe'))}); the dashed line "
             "in the plot is an even share, 1/E:", "", "| block | share per expert | max / mean | dropped | aux loss |",
             "|---|---|---|---|---|"]
    for block, m in last.items():
        total, experts = sum(m["load"]) or 1, len(m["load"])
        shares = " ".join(f"{n / total:.2f}" for n in m["load"])
        lines.append(f"| {block} | {shares} | {max(m['load']) * experts / total:.2f} | {m['dropped']} | "
                     f"{m['aux']:.4f} |")
    return lines


def summarize(records: list[dict]) -> dict:
    first, last = records[0], records[-1]
    timed = records[1:] or [first]  # the first step (allocation, warm-up) is not the pace
    speeds = [r["tokens_per_s"] for r in timed]
    mem = next((r["mem"] for r in reversed(records) if r.get("mem")), {})
    evals = [r for r in records if "eval_loss" in r]
    out = {"first_loss": first["loss"], "last_loss": last["loss"],
           "loss_drop": 1 - last["loss"] / first["loss"], "steps": last["step"],
           "median_tokens_per_s": statistics.median(speeds),
           "median_step_time_s": statistics.median(r.get("step_time_s", 0.0) for r in timed),
           "mem": mem, "comm_per_step": last.get("comm", {}), "comm_ops_per_step": last.get("comm_ops", {})}
    if evals:
        out.update(eval_loss=evals[-1]["eval_loss"], eval_step=evals[-1]["step"])
    return out


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _identity_lines(run: dict, segments: list[dict]) -> list[str]:
    """Which run this is; from summary.json (absent for a run that did not finish: then less) and,
    for what the whole run took, segments.json."""
    if not run:
        return []
    ident, data, mesh = run.get("run", {}), run.get("data", {}), run.get("mesh", {})
    lines = []
    if ident:
        lines.append(f"- run: config {ident.get('config_hash')}, code {ident.get('git_commit') or 'not a git checkout'}, "
                     f"torch {ident.get('torch')}, Python {ident.get('python')}")
        lines.append(f"- layout: {ident.get('layout')} (mesh " + " x ".join(f"{k} {v}" for k, v in mesh.items()) + ")")
    if "model_params" in run:
        lines.append(f"- model: {run['model_params']:,} parameters")
    if data:
        held = f", {data['held_out_tokens']:,} held out" if data.get("held_out_tokens") else ""
        held += f" in {data['val_source']}" if data.get("val_source") else ""
        blend = f" blended with {data['blend']}" if data.get("blend") else ""
        lines.append(f"- data: {data.get('source')}{blend} ({data.get('train_tokens', 0):,} training tokens{held})")
    # What a step counts: tokens, or a recommender's samples (its summary's samples_seen); the
    # segments keep either under "tokens".
    unit = "samples" if "samples_seen" in run else "tokens"
    if segments:  # every launch of the run: the last one's summary covers only itself
        whole = totals(segments)
        wall = whole["wall_time_s"]
        lines.append(f"- {unit} seen: {whole['tokens']:,}; wall time {human_duration(wall)} ({wall:.1f} s) "
                     f"over {len(segments)} segment{'s' if len(segments) > 1 else ''}")
        if len(segments) > 1:
            lines += [f"  - steps {seg['first_step'] + 1}-{seg['last_step']}: {seg.get('layout')}, code "
                      f"{seg.get('git_commit') or 'not a git checkout'}, {human_duration(seg['wall_time_s'])} "
                      f"({seg['wall_time_s']:.1f} s)" for seg in segments]
    elif f"{unit}_seen" in run:
        wall = run.get("wall_time_s")
        lines.append(f"- {unit} seen: {run[f'{unit}_seen']:,}" +
                     (f"; wall time {human_duration(wall)} ({wall:.1f} s)" if wall is not None else ""))
    return lines


def _prediction_lines(predicted: dict | None, s: dict) -> list[str]:
    if not predicted:
        return []
    lines = ["", f"## Predicted (planner, profile '{predicted['hardware']}') vs measured", "",
             "| what | predicted | measured | measured / predicted |", "|---|---|---|---|"]

    def row(what: str, p: float, m: float, fmt) -> None:
        ratio = f"{m / p:.3g}" if p and m else "-"
        lines.append(f"| {what} | {fmt(p)} | {fmt(m) if m else '-'} | {ratio} |")

    row("step time", predicted["step_time_s"], s["median_step_time_s"], lambda v: f"{v * 1e3:.1f} ms")
    row("tokens/s", predicted["tokens_per_s"], s["median_tokens_per_s"], lambda v: f"{v:,.0f}")
    for key in MEM_KEYS:
        row(f"memory: {key}", predicted["mem"].get(key, 0), s["mem"].get(key, 0), human_bytes)
    lines.append("")
    lines.append("Measured: the median logged step after the first; memory on the worst rank (live tensors, saved "
                 "activations at their peak). The planner's profile is a nominal one; `bigtrain bench "
                 "--calibrate` measures this machine's.")
    return lines


def write_report(run_dir: Path) -> Path | None:
    """Write ``loss.png`` and ``report.md`` (and, with experts, ``expert_load.png``) into ``run_dir``;
    returns the report path."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        return None
    plot_loss(records, run_dir / "loss.png")
    if "samples_per_s" in records[-1]:  # a recommender's records: samples, AUC and log loss instead of tokens
        return _write_recommender_report(run_dir, records)
    s = summarize(records)
    run = _read_json(run_dir / "summary.json")
    held_out = (f"; held-out loss {s['eval_loss']:.4f} (after step {s['eval_step']})" if "eval_loss" in s else "")
    lines = [f"# Run report: {run_dir.name}", "", *_identity_lines(run, read_segments(run_dir)),
             f"- steps: {s['steps']}; loss {s['first_loss']:.4f} -> {s['last_loss']:.4f} "
             f"({100 * s['loss_drop']:.1f}% lower){held_out}",
             f"- median throughput: {s['median_tokens_per_s']:.0f} tokens/s", "",
             "![loss](loss.png)", *_prediction_lines(run.get("predicted"), s),
             "", "## Memory on the worst rank (measured)", "", "| what | bytes |", "|---|---|"]
    lines += [f"| {k} | {human_bytes(v)} ({v}) |" for k, v in s["mem"].items()]
    lines += ["", "## Traffic sent per rank in the last logged step (measured)", "",
              "| axis | collective | bytes |", "|---|---|---|"]
    for axis, ops in s["comm_ops_per_step"].items():
        lines += [f"| {axis} | {op} | {human_bytes(v)} ({v:.0f}) |" for op, v in ops.items()]
    if not s["comm_ops_per_step"]:
        lines.append("| - | none (one rank) | 0 |")
    load = expert_load(records)
    if load:
        plot_expert_load(load, run_dir / "expert_load.png")
        lines += _expert_load_lines(records, load)
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    (run_dir / "report.json").write_text(json.dumps({**s, "run": run}, indent=1))
    return path


def _write_recommender_report(run_dir: Path, records: list[dict]) -> Path:
    """A click model's report: its loss, held-out AUC and log loss over the logged steps, samples/s
    (a step logged without held-out metrics, one the NaN policy skipped, shows none)."""
    first, last = records[0], records[-1]
    speeds = [r["samples_per_s"] for r in records[1:] or records]
    evaluated = [r for r in records if "auc" in r]
    run = _read_json(run_dir / "summary.json")
    a, b = (evaluated[0], evaluated[-1]) if evaluated else (None, None)
    held_out = (f"- held-out AUC {a['auc']:.4f} -> {b['auc']:.4f}; log loss {a['log_loss']:.4f} -> "
                f"{b['log_loss']:.4f} (after step {b['step']})" if evaluated else "- no held-out metrics were logged")
    lines = [f"# Run report: {run_dir.name}", "", *_identity_lines(run, read_segments(run_dir)),
             f"- steps: {last['step']}; loss {first['loss']:.4f} -> {last['loss']:.4f}", held_out,
             f"- median throughput: {statistics.median(speeds):,.0f} samples/s", "", "![loss](loss.png)", "",
             "| step | loss | AUC | log loss | samples/s |", "|---|---|---|---|---|"]
    held = {r["step"]: f"{r['auc']:.4f} | {r['log_loss']:.4f}" for r in evaluated}
    lines += [f"| {r['step']} | {r['loss']:.4f} | {held.get(r['step'], '- | -')} | {r['samples_per_s']:,.0f} |"
              for r in records]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
