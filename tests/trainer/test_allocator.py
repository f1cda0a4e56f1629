"""CPU malloc choice: the re-exec with a caching allocator keeps pid, argv and a pending stop."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from trainer import allocator


@pytest.mark.parametrize(
    ("preload", "expected"),
    [
        ("", None),
        ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "tcmalloc_minimal"),
        ("libfoo.so libjemalloc.so.2", "jemalloc"),
        ("libasan.so", None),
    ],
)
def test_preloaded_allocator_is_read_from_ld_preload(preload: str, expected: str | None) -> None:
    assert allocator.preloaded({"LD_PRELOAD": preload}) == expected


def test_preload_env_puts_the_allocator_first_and_keeps_the_rest() -> None:
    env = allocator.preload_env({"LD_PRELOAD": "libfoo.so", "A": "1"}, "libtcmalloc.so.4")
    assert env == {"LD_PRELOAD": "libtcmalloc.so.4 libfoo.so", "A": "1"}
    assert allocator.preload_env({}, "libjemalloc.so.2")["LD_PRELOAD"] == "libjemalloc.so.2"


@pytest.mark.parametrize(
    ("device", "choice", "env"),
    [
        ("cuda", "auto", {}),
        ("cpu", "glibc", {}),
        ("cpu", "auto", {"LD_PRELOAD": "libjemalloc.so.2"}),
    ],
)
def test_no_reexec_off_cpu_when_asked_or_already_preloaded(monkeypatch, device, choice, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(allocator, "installed_allocator", lambda: "libtcmalloc_minimal.so.4")

    def refuse(*args):
        raise AssertionError("must not exec")

    monkeypatch.setattr(os, "execve", refuse)
    allocator.reexec_with_caching_allocator(device, choice)


def test_reexec_keeps_pid_and_a_stop_received_before_it(tmp_path) -> None:
    if allocator.installed_allocator() is None:
        pytest.skip("no tcmalloc/jemalloc installed (Debian: libtcmalloc-minimal4)")
    script = tmp_path / "probe.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, sys
            from trainer import allocator, stop
            stop.install()
            stop.release()
            if allocator.preloaded():
                print("after", os.getpid(), stop.requested(), allocator.preloaded(), sys.argv[1:])
                raise SystemExit(0)
            print("before", os.getpid(), flush=True)
            os.kill(os.getpid(), signal.SIGUSR1)  # a graceful stop asked during start-up
            allocator.reexec_with_caching_allocator("cpu", "auto")
            print("not re-executed")
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["PYTHONPATH"] = os.getcwd()
    done = subprocess.run(
        [sys.executable, str(script), "x", "--y"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.split("\n")[:2]
    pid = before.split()[1]
    assert after.split()[:3] == ["after", pid, "True"]
    assert after.endswith("['x', '--y']")
