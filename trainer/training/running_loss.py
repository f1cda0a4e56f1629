"""A cheap running training loss, a few points per epoch (`train_loss_running` events).

The loop already sums the step losses on the device; reading that sum costs a device sync,
so it is read only at the few log points, never per step. Each point is the mean loss of
the steps since the previous point, on rank 0's own batch share (no collective: under DDP
with uneven shares its cross-entropy term carries rank 0's weight b_0 W / G).
"""

from __future__ import annotations

from typing import Any

from trainer.schema.events import Kind
from trainer.training.events import RunRecorder

POINTS_PER_EPOCH = 4


def log_points(num_iterations: int, points_per_epoch: int = POINTS_PER_EPOCH) -> frozenset[int]:
    """The 1-based step counts at which the loss is read: evenly spaced, the last step included."""
    num_points = max(1, min(points_per_epoch, num_iterations))
    return frozenset(round(num_iterations * (k + 1) / num_points) for k in range(num_points))


class RunningLoss:
    """`hook(iteration, summed_loss)` for one epoch: records an event at each log point."""

    def __init__(self, recorder: RunRecorder, epoch: int, num_iterations: int) -> None:
        self.recorder = recorder
        self.epoch = epoch
        self.num_iterations = num_iterations
        self.points = log_points(num_iterations)
        self._sum_then = 0.0
        self._iteration_then = 0

    def __call__(self, iteration: int, summed_loss: Any) -> None:
        if iteration not in self.points:
            return
        summed = float(summed_loss)  # the one device-to-host read, at a log point only
        loss = (summed - self._sum_then) / (iteration - self._iteration_then)
        self._sum_then, self._iteration_then = summed, iteration
        self.recorder.event(
            Kind.TRAIN_LOSS_RUNNING,
            epoch=self.epoch,
            iteration=iteration,
            num_iterations=self.num_iterations,
            loss=loss,
        )


def epoch_hook(recorder: RunRecorder, epoch: int, num_iterations: int) -> RunningLoss | None:
    """The hook for one epoch, or None where nothing is recorded (ranks other than 0)."""
    return RunningLoss(recorder, epoch, num_iterations) if recorder.enabled else None
