"""The end-of-run report: a loss-curve PNG and a short markdown summary of memory and traffic; for a
mixture of experts, each MoE block's expert load over the steps (a PNG) and at the last step (a table)."""

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
    speeds = [r["tokens_per_s"] for r in records[1:]] or [first["tokens_per_s"]]
    mem = next((r["mem"] for r in reversed(records) if r.get("mem")), {})
    return {"first_loss": first["loss"], "last_loss": last["loss"],
            "loss_drop": 1 - last["loss"] / first["loss"], "steps": last["step"] + 1,
            "median_tokens_per_s": statistics.median(speeds), "mem": mem, "comm_per_step": last.get("comm", {}),
            "comm_ops_per_step": last.get("comm_ops", {})}


def write_report(run_dir: Path) -> Path | None:
    """Write ``loss.png`` and ``report.md`` (and, with experts, ``expert_load.png``) into ``run_dir``;
    returns the report path."""
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
    load = expert_load(records)
    if load:
        plot_expert_load(load, run_dir / "expert_load.png")
        lines += _expert_load_lines(records, load)
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    (run_dir / "report.json").write_text(json.dumps(s, indent=1))
    return path
