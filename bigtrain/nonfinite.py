"""The NaN policy: a step with a non-finite loss or gradient norm is skipped; a run whose steps keep
failing stops with exit code 3.

The engines skip: the trainer all-reduces the loss before the optimizer step and folds "the loss is
not finite" into the overflow flag that the gradient norm's reduction carries, so every rank of
every layout skips or applies the update together (weights and optimizer state untouched, AdamW's
step count included). This module classifies what the ranks then all see (the same loss, norm, loss
scale and skip) and counts:

- a skipped step whose loss is not finite is bad: the forward pass overflowed, which no loss scale
  can fix;
- a skipped step with a finite loss and a non-finite gradient norm is bad in fp32 and bf16. In fp16
  it is the dynamic loss scaler's overflow, which halves the scale: early calibration, not counted,
  as long as the scale was above its minimum (1). At the minimum the scaler has nothing left to try,
  and each further overflow is bad (DeepSpeed stops at its minimum scale too; we allow
  ``max_bad_steps`` of them). From the default scale of 2^16 a run that overflows on every step
  therefore stops after 16 + ``max_bad_steps`` steps.
- an applied step ends a streak. ``train.max_bad_steps`` consecutive bad steps stop the run, and
  so does a run that ends while a streak lasts, whatever its length (exit 3 too: its last steps
  trained nothing, and the NaN must not end as a success).

Checkpoints are not written while a streak lasts: the newest checkpoint is the state after the last
applied step (and :meth:`Trainer.save` refuses non-finite state outright).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EXIT_CODE = 3


class NonFiniteStop(RuntimeError):
    """``train.max_bad_steps`` consecutive steps were not finite, or the run's last steps were: the
    run stopped (exit code 3)."""

    exit_code = EXIT_CODE
    recorded = False  # written to stopped.json, where the launcher reads the code (Trainer._record)

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def _value(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else str(x)


@dataclass
class BadSteps:
    """Consecutive bad steps of a run (see the module's rules)."""

    max_bad_steps: int
    min_loss_scale: float | None = None  # fp16's floor; None without a loss scaler
    streak: int = 0
    first_bad: int | None = None  # the step that began the current streak
    last_bad: tuple[int, str] = (0, "")  # the streak's last step, and what was not finite in it

    def observe(self, step: int, loss: float, grad_norm: float, skipped: bool,
                scale_before: float | None = None, scale_after: float | None = None) -> str | None:
        """Count one finished step; a line saying why it was skipped (None for an applied step).
        Raises NonFiniteStop when the streak reaches ``max_bad_steps``."""
        if not skipped:
            self.streak, self.first_bad = 0, None
            return None
        what = self.what_was_not_finite(loss, grad_norm)
        scaler_can_back_off = (self.min_loss_scale is not None and scale_before is not None
                               and scale_before > self.min_loss_scale)
        if math.isfinite(loss) and scaler_can_back_off:
            return (f"step {step}: fp16 gradients overflowed at loss scale {scale_before:g}; step skipped, scale "
                    f"now {scale_after:g}")
        self.streak += 1
        self.last_bad = (step, what)
        if self.first_bad is None:
            self.first_bad = step
        if self.streak >= self.max_bad_steps:
            since = f" (steps {self.first_bad}-{step})" if self.streak > 1 else ""
            raise NonFiniteStop(f"stopped at step {step}: {what}; {self.streak} consecutive steps were not "
                                f"finite{since}, train.max_bad_steps = {self.max_bad_steps}", step)
        at_floor = " at the minimum loss scale" if self.min_loss_scale is not None and math.isfinite(loss) else ""
        return (f"step {step}: {what}{at_floor}; step skipped, weights and optimizer state unchanged "
                f"({self.streak} of train.max_bad_steps = {self.max_bad_steps} in a row)")

    def ended_on_bad_steps(self) -> NonFiniteStop | None:
        """At the end of a run: a stop (exit 3) when its last steps were bad, whatever their number
        (fewer than ``max_bad_steps`` would otherwise end with exit 0, a NaN loss and no checkpoint
        of the last steps); None when the last step was applied."""
        if not self.streak:
            return None
        last, what = self.last_bad
        steps = f"step {last} was" if self.streak == 1 else f"{self.streak} steps ({self.first_bad}-{last}) were"
        return NonFiniteStop(f"stopped at the end of the run (step {last}): {what}; its last {steps} not "
                             f"finite (the run ended before train.max_bad_steps = {self.max_bad_steps} of them in a "
                             f"row)", last)

    @staticmethod
    def what_was_not_finite(loss: float, grad_norm: float) -> str:
        if not math.isfinite(loss):
            return f"the loss was {_value(loss)} (gradient norm {_value(grad_norm)})"
        if not math.isfinite(grad_norm):
            return f"the gradient norm was {_value(grad_norm)} (loss {_value(loss)})"
        return "a rank reported non-finite values"  # every rank shares loss and norm: not expected
