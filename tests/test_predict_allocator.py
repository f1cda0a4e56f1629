"""nnui-predict as a program on CPU preloads the caching allocator as nnui-train does."""

from __future__ import annotations

from trainer import allocator, predict, stop
from trainer.inference import cli


def test_re_executes_with_the_device_and_releases_a_held_stop(monkeypatch):
    calls = []
    monkeypatch.setattr(
        allocator, "reexec_with_caching_allocator", lambda d, c: calls.append(("exec", d, c))
    )
    monkeypatch.setattr(allocator, "preloaded", lambda env=None: "tcmalloc_minimal")
    monkeypatch.setattr(stop, "release", lambda: calls.append(("release",)))
    cli.use_caching_allocator("cpu")
    assert calls == [("exec", "cpu", "auto"), ("release",)]


def test_a_call_from_python_never_re_executes(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(predict, "use_caching_allocator", lambda d: calls.append(d))
    missing = tmp_path / "missing"
    code = predict.main(["-i", str(missing), "-o", str(tmp_path / "out"), "-d", "1", "-c", "3d"])
    assert code == 2 and calls == []
