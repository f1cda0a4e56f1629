"""A SIGUSR1 is recorded at the next training step (outside the handler), not an epoch later:
the console line, status `stopping`, and a `stop_heard` event the board reads."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import torch

from trainer import stop
from trainer.schema.events import Kind
from trainer.schema.status import State
from trainer.training.loop import StopNotice, Trainee, train_iterations


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def status(self, state=None, **changes) -> None:
        self.calls.append(("status", state))

    def event(self, kind, **fields) -> None:
        self.calls.append(("event", kind, fields))


def _trainee(steps_seen: list[int]) -> Trainee:
    model = torch.nn.Linear(2, 1)

    def loss_fn(outputs, target):
        return (outputs - target).pow(2).mean()

    def hook(step, total):
        steps_seen.append(step)
        if step == 2:  # the signal lands between steps 2 and 3
            os.kill(os.getpid(), signal.SIGUSR1)

    return Trainee(
        model=model, raw_model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        scaler=torch.amp.GradScaler("cpu", enabled=False), loss_fn=loss_fn,
        device=torch.device("cpu"), autocast_dtype=None, num_classes=2, step_hook=hook,
    )  # fmt: skip


def test_stop_is_recorded_at_the_next_step_once(caplog) -> None:
    stop.install()
    stop.clear()
    try:
        steps: list[int] = []
        trainee = _trainee(steps)
        recorder = Recorder()
        trainee.stop_notice = StopNotice(recorder)
        trainee.stop_notice.epoch = 4
        batch = SimpleNamespace(data=torch.ones(3, 2), target=torch.zeros(3, 1))
        with caplog.at_level("INFO", logger="trainer"):
            train_iterations(trainee, iter([batch] * 5), 5, grad_clip=12.0)
        assert steps == [1, 2, 3, 4, 5]  # the epoch goes on: the stop is at its end
        assert recorder.calls == [
            ("status", State.STOPPING),
            ("event", Kind.STOP_HEARD, {"epoch": 4}),
        ]  # once, although the flag stayed set for three more steps
        assert "SIGUSR1 received: stopping at the end of epoch 5" in caplog.text
    finally:
        stop.clear()
