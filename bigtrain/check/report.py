"""What ``bigtrain check`` found: each difference over its bound (:class:`Finding`) and the report of
a check (:class:`CheckReport`), its text as the command prints it and its record as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from bigtrain.check.compare import Tolerance


@dataclass
class Finding:
    kind: str  # loss | grad_norm | skipped | forward | gradient | weight | missing | extra | replayed | resumed
    name: str  # the module or parameter ('' for loss, grad_norm, skipped)
    error: float  # relative difference (inf when not comparable)
    ranks: list[int] = field(default_factory=list)
    detail: str = ""

    def line(self) -> str:
        where = f" on ranks {self.ranks}" if self.ranks else ""
        what = {"loss": "loss", "grad_norm": "gradient norm", "skipped": "skipped step",
                "forward": f"module {self.name} output", "gradient": f"parameter {self.name} gradient",
                "weight": f"parameter {self.name} updated value",
                "missing": f"parameter {self.name}", "extra": f"parameter {self.name}",
                "replayed": f"{self.name} after the reference's replay of the optimizer step",
                "resumed": f"{self.name} as the resumed layout loaded it"}[self.kind]
        size = f": relative difference {self.error:.3e}" if self.error != float("inf") else ""
        return f"{what}{where}{size}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class CheckReport:
    agree: bool
    steps: int  # steps compared
    tolerance: Tolerance
    losses: list[tuple[float, float]]  # (layout, reference) per step
    first_step: int | None = None  # updates done before the first step that differs (text() prints it + 1)
    findings: list[Finding] = field(default_factory=list)  # beyond bounds at first_step
    worst: dict[str, float] = field(default_factory=dict)  # largest difference of each kind, over all steps
    start: int = 0  # the first step compared (a resumed run's step after its checkpoint)
    # Single tensors over the bound that the float64 reference showed within fp32's own rounding
    # (bigtrain/check/exact.py): reported, not a divergence.
    within_rounding: list[Finding] = field(default_factory=list)
    # Whether its updates were judged along the replays' chain (updates_explained): a run resumed
    # from the checkpoint it ends with continues that chain (check_layout's ``saved_anchored``).
    anchored: bool = False
    # With check_layout's ``save``: the full (weights, optimizer state) of the checkpoint it wrote.
    saved: tuple[dict, dict] | None = field(default=None, repr=False)
    # Where the check stopped at fp16's overflow boundary (bigtrain/check/fp16_boundary.py): why, at
    # first_step, which is then no divergence (agree stays True) and the last step compared.
    boundary: str = ""
    precision: str = "fp32"  # precision.mode: whose own rounding ``within_rounding`` is

    def first(self, kind: str) -> Finding | None:
        return next((f for f in self.findings if f.kind == kind), None)

    def text(self) -> str:
        # Printed as the trainer counts (step k is the k-th update: train's console, metrics.jsonl and
        # checkpoint step_k); first_step and start count the updates done before, as the trainer's step.
        lines = [f"step {i}: loss {a:.6f} (reference {b:.6f})"
                 for i, (a, b) in enumerate(self.losses, self.start + 1)]
        worst = ", ".join(f"{kind} {err:.1e}" for kind, err in self.worst.items() if err != float("inf"))
        if self.agree and self.boundary:
            lines.append(f"agree: {self.steps - 1} steps within {self.tolerance.text()} (largest: {worst}); "
                         f"stopped at step {self.first_step + 1}, {self.boundary}")
            lines += [f"  at step {self.first_step + 1}: {f.line()}" for f in self.findings if f.kind != "weight"]
            return "\n".join(lines)
        if self.agree:
            lines.append(f"agree: {self.steps} steps within {self.tolerance.text()} (largest: {worst})")
            lines += [f"  within {self.precision}'s own rounding: {f.line()}" for f in self.within_rounding]
            return "\n".join(lines)
        lines.append(f"DIFFER from step {self.first_step + 1} (bounds: {self.tolerance.text()}):")
        for kind, title in (("forward", "first module whose forward output differs"),
                            ("gradient", "first parameter whose gradient differs"),
                            ("weight", "first parameter whose updated value differs")):
            found = self.first(kind)
            count = sum(f.kind == kind for f in self.findings)
            lines.append(f"  {title}: " + (f"{found.line()}" + (f" [{count} in all]" if count > 1 else "")
                                            if found else "none"))
        for f in self.findings:
            if f.kind in ("loss", "grad_norm", "skipped", "missing", "extra", "replayed", "resumed") \
                    or f.error == float("inf"):
                lines.append(f"  {f.line()}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)
