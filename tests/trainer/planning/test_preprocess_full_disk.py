"""A full disk during preprocessing is one line and exit 2, and leaves no completion marker."""

from __future__ import annotations

import errno

from trainer.planning import preprocess
from trainer.schema.tree import plans_file_name


def test_a_full_disk_is_one_error_line(demo_raw, tmp_path, capsys, monkeypatch):
    from trainer.data import blosc_io

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(blosc_io, "write_array", full)
    argv = ["900", "-c", "2d", "-np", "1", "--raw", str(demo_raw), "--preprocessed", str(tmp_path)]
    assert preprocess.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: No space left on device: "), err
    assert not (tmp_path / "Dataset900_NnuiDemo" / plans_file_name("nnuiPlans")).exists()
