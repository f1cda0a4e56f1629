"""pytest fixtures of the fake NVML library, imported by the test_nvml_fake*.py modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_nvml.scenario import (
    LOG_ENV,
    SCENARIO_ENV,
    FakeMachine,
    build_library,
    compiler,
    h200_box,
    other_user_process,
)


@pytest.fixture(scope="session")
def fake_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if compiler() is None:
        pytest.skip("no C compiler (cc or gcc) to build the fake NVML library")
    return build_library(tmp_path_factory.mktemp("fake-nvml"))


@pytest.fixture
def machine(fake_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeMachine:
    """An 8 x H200 box; the test rewrites machine.write(...) to change it."""
    fake = FakeMachine(fake_library, tmp_path)
    monkeypatch.setenv(SCENARIO_ENV, str(fake.scenario_path))
    monkeypatch.setenv(LOG_ENV, str(fake.log))
    fake.write(h200_box())
    return fake


@pytest.fixture
def other_user() -> Iterator[tuple[int, str]]:
    """(pid, user name) of a live process of another user."""
    proc, pid, user = other_user_process()
    if not pid:
        pytest.skip("no process of another user here (not root, and pid 1 is ours)")
    try:
        yield pid, user
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
