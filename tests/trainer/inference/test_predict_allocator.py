"""nnui-predict as a program on CPU preloads the caching allocator as nnui-train does."""

from __future__ import annotations

import os

from trainer import allocator, cli, stop
from trainer.inference import predict


def test_re_executes_with_the_device_and_releases_a_held_stop(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "x")
    monkeypatch.delenv("OMP_WAIT_POLICY")  # restored (absent or not) after the test
    calls = []
    monkeypatch.setattr(
        allocator, "reexec_with_caching_allocator", lambda d, c: calls.append(("exec", d, c))
    )
    monkeypatch.setattr(allocator, "preloaded", lambda env=None: "tcmalloc_minimal")
    monkeypatch.setattr(stop, "release", lambda: calls.append(("release",)))
    cli.use_caching_allocator("cpu")
    assert calls == [("exec", "cpu", "auto"), ("release",)]
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # seen by the re-executed image


def test_openmp_wait_policy_is_passive_on_cpu_unless_the_user_set_one(monkeypatch):
    monkeypatch.setattr(allocator, "reexec_with_caching_allocator", lambda d, c: None)
    monkeypatch.setattr(allocator, "preloaded", lambda env=None: None)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cli.use_caching_allocator("cpu")
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    cli.use_caching_allocator("cuda")
    assert "OMP_WAIT_POLICY" not in os.environ


def test_a_call_from_python_never_re_executes(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(predict, "use_caching_allocator", lambda d: calls.append(d))
    missing = tmp_path / "missing"
    code = predict.main(["-i", str(missing), "-o", str(tmp_path / "out"), "-d", "1", "-c", "3d"])
    assert code == 2 and calls == []
