"""nnui-train's OpenMP wait setting on CPU: set before torch, never over the user's."""

from __future__ import annotations

import pytest

from trainer.training import openmp


def test_cpu_training_limits_spinning() -> None:
    env: dict[str, str] = {}
    assert openmp.limit_spinning("cpu", env)
    assert env == {"GOMP_SPINCOUNT": openmp.SPIN_COUNT}


@pytest.mark.parametrize(
    ("device", "env"),
    [
        ("cuda", {}),
        ("mps", {}),
        ("cpu", {"OMP_WAIT_POLICY": "ACTIVE"}),
        ("cpu", {"GOMP_SPINCOUNT": "1"}),
    ],
)
def test_other_devices_and_the_users_choice_are_left_alone(device, env) -> None:
    before = dict(env)
    assert not openmp.limit_spinning(device, env)
    assert env == before
