"""Mixture of experts against dense on the `small` corpus (issue 15): 300 steps of the `small`
preset, a top-2 MoE with E = 8 against the dense model with the same active parameters, the final
loss compared and the curves drawn.

Each run is the CLI as a user types it (``benchmarks/learning.py``), one after another, one thread
each, the same data, seed and schedule; only ``model.*`` (and where listed ``optim.lr``) differs, as
in ``RUNS``. Two readings of "the same active parameters" are run: experts of half the dense ffn
(top-2 of 192 against small's dense 384) and experts of the whole dense ffn (top-2 of 384 against a
dense ffn of 768, Mixtral's framing). The figure is the mean training loss of the last ``--tail``
steps; the last step's loss is reported too. Exits 1 if no MoE beats its dense counterpart.

    PYTHONPATH=. .venv/bin/python benchmarks/quality_moe.py                        # ~2-5 min a run
    PYTHONPATH=. .venv/bin/python benchmarks/quality_moe.py --only dense moe-192
"""

from __future__ import annotations

import argparse
import sys

import common
import learning

MOE = ["--model.moe_experts=8", "--model.moe_top_k=2"]
# (label, dense counterpart's label or None for a dense run, CLI overrides)
RUNS = [
    ("dense", None, []),
    ("moe-192", "dense", MOE + ["--model.moe_ffn_hidden=192"]),
    ("moe-192-aux0.001", "dense", MOE + ["--model.moe_ffn_hidden=192", "--model.moe_aux_loss_coef=0.001"]),
    ("moe-192-sigmoid", "dense", MOE + ["--model.moe_ffn_hidden=192", "--model.moe_router=sigmoid-bias"]),
    ("moe-128-shared", "dense", MOE + ["--model.moe_ffn_hidden=128", "--model.moe_shared_expert=true"]),
    ("dense-lr2e-3", None, ["--optim.lr=2e-3"]),
    ("moe-192-lr2e-3", "dense-lr2e-3", MOE + ["--model.moe_ffn_hidden=192", "--optim.lr=2e-3"]),
    ("dense-lr5e-3", None, ["--optim.lr=5e-3"]),
    ("moe-192-lr5e-3", "dense-lr5e-3", MOE + ["--model.moe_ffn_hidden=192", "--optim.lr=5e-3"]),
    ("dense-768", None, ["--model.ffn_hidden=768"]),
    ("moe-384", "dense-768", MOE + ["--model.moe_ffn_hidden=384"]),
]


def plot(results: dict[str, dict], pairs: list[tuple[str, str]], path: str, window: int) -> None:
    """Left: the runs' curves; right: each MoE's loss minus its dense counterpart's (same batches),
    both smoothed over ``window`` steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, gaps) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in dict.fromkeys(x for pair in pairs for x in pair):
        r = results[label]
        curves.plot(range(1, len(r["losses"]) + 1), learning.smooth(r["losses"], window),
                    label=f"{label}: {r['tail_mean_loss']:.4f}")
    for dense, moe in pairs:
        diff = [m - d for m, d in zip(results[moe]["losses"], results[dense]["losses"])]
        gaps.plot(range(1, len(diff) + 1), learning.smooth(diff, window), label=f"{moe} - {dense}")
    gaps.axhline(0, color="black", linewidth=0.8)
    curves.set_ylim(top=min(4.0, curves.get_ylim()[1]))
    curves.set_title("small, 300 steps: top-2 of 8 experts vs dense")
    gaps.set_title("MoE minus dense (same batches; below 0: MoE lower)")
    for ax, ylabel in ((curves, "training loss"), (gaps, "loss difference")):
        ax.set_xlabel("step")
        ax.set_ylabel(f"{ylabel} (mean of {window} steps)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    learning.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    learning.add_arguments(p, "runs/quality-moe", [r[0] for r in RUNS], "docs/moe-small.png", 25)
    args = p.parse_args(argv)
    wanted = set(args.only or [r[0] for r in RUNS])
    wanted |= {dense for label, dense, _ in RUNS if label in wanted and dense}  # each MoE needs its dense
    results = {label: learning.train(label, flags, args.steps, args.out, args.threads, args.tail, rerun=args.rerun)
               for label, _, flags in RUNS if label in wanted}
    print(f"small preset, {args.steps} steps; loss = mean of the last {args.tail} steps' training losses")
    print(f"{'run':>18} {'against':>14} {'last-step loss':>15} {'tail loss':>10} {'vs dense':>9}")
    pairs = []
    for label, dense, _ in RUNS:
        if label not in results:
            continue
        r = results[label]
        over = r["tail_mean_loss"] / results[dense]["tail_mean_loss"] - 1 if dense else 0.0
        r["over_dense"] = over
        if dense:
            pairs.append((dense, label))
        print(f"{label:>18} {dense or '-':>14} {r['final_loss']:>15.4f} {r['tail_mean_loss']:>10.4f} {over:>+9.2%}")
    won = [b for a, b in pairs if results[b]["tail_mean_loss"] < results[a]["tail_mean_loss"]]
    if args.plot and pairs:
        # The two readings of "the same active parameters", at the preset's learning rate.
        shown = [pair for pair in (("dense", "moe-192"), ("dense-768", "moe-384")) if pair in pairs]
        plot(results, shown or pairs, args.plot, args.smooth)
        print(f"plot: {args.plot}")
    if args.json:
        common.write_json(args.json, {"args": vars(args), "runs": list(results.values()), "won": won})
    print(f"MoE lower than its dense counterpart: {', '.join(won) or 'none'}")
    return 0 if won else 1


if __name__ == "__main__":
    sys.exit(main())
