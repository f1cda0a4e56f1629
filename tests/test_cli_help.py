"""Every console script answers --help with exit 0 and a usage line (issue: foundation)."""

from __future__ import annotations

import subprocess
import sys

import pytest

COMMANDS = {
    "nnui": "app.main",
    "nnui-train": "trainer.run",
    "nnui-preprocess": "trainer.planning.preprocess",
    "nnui-demo-data": "trainer.demo",
}


@pytest.mark.parametrize(("script", "module"), sorted(COMMANDS.items()))
def test_help_exits_zero_with_usage(script: str, module: str) -> None:
    code = (
        f"import sys; from {module} import main; "
        f"sys.argv = [{script!r}, '--help']; sys.exit(main())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout.lower()
    assert "Traceback" not in result.stderr
