"""The end-of-run report: a loss-curve PNG and a short markdown summary of memory and traffic."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bigtrain.metrics import human_bytes, read_metrics


def plot_loss(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(records: list[dict]) -> dict:
    first, last = records[0], records[-1]
    speeds = [r["tokens_per_s"] for r in records[1:]] or [first["tokens_per_s"]]
    mem = next((r["mem"] for r in reversed(records) if r.get("mem")), {})
    return {"first_loss": first["loss"], "last_loss": last["loss"],
            "loss_drop": 1 - last["loss"] / first["loss"], "steps": last["step"] + 1,
            "median_tokens_per_s": statistics.median(speeds), "mem": mem, "comm_per_step": last.get("comm", {}),
            "comm_ops_per_step": last.get("comm_ops", {})}


def write_report(run_dir: Path) -> Path | None:
    """Write ``loss.png`` and ``report.md`` into ``run_dir``; returns the report path."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        return None
    plot_loss(records, run_dir / "loss.png")
    s = summarize(records)
    lines = [f"# Run report: {run_dir.name}", "",
             f"- steps: {s['steps']}; loss {s['first_loss']:.4f} -> {s['last_loss']:.4f} "
             f"({100 * s['loss_drop']:.1f}% lower)",
             f"- median throughput: {s['median_tokens_per_s']:.0f} tokens/s", "",
             "![loss](loss.png)", "", "## Memory on the worst rank (measured)", "",
             "| what | bytes |", "|---|---|"]
    lines += [f"| {k} | {human_bytes(v)} ({v}) |" for k, v in s["mem"].items()]
    lines += ["", "## Traffic sent per rank in the last logged step (measured)", "",
              "| axis | collective | bytes |", "|---|---|---|"]
    for axis, ops in s["comm_ops_per_step"].items():
        lines += [f"| {axis} | {op} | {human_bytes(v)} ({v:.0f}) |" for op, v in ops.items()]
    if not s["comm_ops_per_step"]:
        lines.append("| - | none (one rank) | 0 |")
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    (run_dir / "report.json").write_text(json.dumps(s, indent=1))
    return path
