"""Checkpoints: one safetensors file, atomic, never unpickled; resume picks the newest valid."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer import checkpoint
from trainer.loss import DeepSupervisionLoss
from trainer.model import PlainConvUNet

IDENTITY = {"dataset_name": "Dataset001_X", "configuration": "3d_fullres", "plans_identity": "abc"}


def tiny_net() -> PlainConvUNet:
    return PlainConvUNet(1, 3, [4, 8], [[3, 3, 3]] * 2, [[1, 1, 1], [2, 2, 2]], [1, 1], [1], 3)


def sgd(model: torch.nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.99, nesterov=True)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 1, 8, 8, 8, generator=g)
    t = torch.randint(0, 3, (2, 1, 8, 8, 8), generator=g)
    optimizer.zero_grad()
    DeepSupervisionLoss(1)(model(x), t).backward()
    optimizer.step()


def write(run_dir: Path, kind: str, epoch_next: int, identity: dict = IDENTITY) -> Path:
    torch.manual_seed(epoch_next)
    model = tiny_net()
    path = run_dir / f"checkpoint_{kind}.safetensors"
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    checkpoint.save(
        path, model, sgd(model), scaler, {"epoch_next": epoch_next, "identity": identity}
    )
    return path


def test_round_trip_gives_bit_identical_next_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, opt = tiny_net(), None
    opt = sgd(model)
    step(model, opt, 1)  # creates momentum buffers
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    path = tmp_path / "checkpoint_latest.safetensors"
    checkpoint.save(path, model, opt, scaler, {"epoch_next": 1, "history": {"train_loss": [0.5]}})
    tensors, meta = checkpoint.load(path)
    assert meta["epoch_next"] == 1 and meta["history"]["train_loss"] == [0.5]
    assert any(k.startswith("optim.state.") for k in tensors)
    assert tensors["rng.torch_cpu"].dtype == torch.uint8
    twin, twin_opt = tiny_net(), None
    twin_opt = sgd(twin)
    checkpoint.apply(tensors, meta, twin, twin_opt, scaler, restore_rng_state=True)
    step(model, opt, 2)
    step(twin, twin_opt, 2)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert not list(tmp_path.glob("*.tmp")), "temporary file left behind"


def test_resume_prefers_newest_epoch_then_final_latest_best(tmp_path: Path) -> None:
    write(tmp_path, "best", 3)
    write(tmp_path, "latest", 5)
    assert checkpoint.find_resume(tmp_path).kind == "latest"
    write(tmp_path, "final", 5)
    assert checkpoint.find_resume(tmp_path).kind == "final"


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda b: b[: len(b) - 7], "best"),  # truncated data
        (lambda b: b[:5], "best"),  # truncated inside the length field
        (lambda b: b"\x00" * 64, "best"),  # garbage
        (lambda b: b"", "best"),  # empty file
    ],
)
def test_corrupt_latest_falls_back_to_next_valid(tmp_path: Path, damage, expected: str) -> None:
    write(tmp_path, "best", 2)
    latest = write(tmp_path, "latest", 4)
    latest.write_bytes(damage(latest.read_bytes()))
    assert checkpoint.find_resume(tmp_path).kind == expected
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(latest)


def test_no_valid_checkpoint_means_none(tmp_path: Path) -> None:
    assert checkpoint.find_resume(tmp_path) is None
    (tmp_path / "checkpoint_latest.safetensors").write_bytes(b"nonsense")
    assert checkpoint.find_resume(tmp_path) is None


def test_identity_mismatch_is_refused(tmp_path: Path) -> None:
    write(tmp_path, "latest", 2, identity={**IDENTITY, "configuration": "2d"})
    with pytest.raises(checkpoint.IdentityMismatch, match="configuration"):
        checkpoint.find_resume(tmp_path, IDENTITY)


def test_metadata_is_read_without_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = write(tmp_path, "latest", 7)
    code = (
        "import sys; from pathlib import Path; from trainer.checkpoint import read_metadata; "
        f"m = read_metadata(Path({str(path)!r})); "
        "sys.exit(0 if m['epoch_next'] == 7 and 'torch' not in sys.modules else 1)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _safetensors_bytes(header: object) -> bytes:
    import json
    import struct

    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    "header",
    [
        {"model.w": {"dtype": "F32", "shape": [1]}},  # no data_offsets: KeyError
        {"model.w": {"data_offsets": 5}},  # not a list: TypeError
        {"model.w": {"data_offsets": []}},  # IndexError
        {"model.w": {"data_offsets": [0, "x"]}},  # ValueError
        {"model.w": [1, 2]},  # TypeError
        {"__metadata__": {"nnui": "[1, 2]"}},  # metadata not an object
        {"__metadata__": "text"},  # TypeError
    ],
)
def test_wrong_structure_header_is_a_checkpoint_error(tmp_path: Path, header) -> None:
    write(tmp_path, "best", 2)
    latest = tmp_path / "checkpoint_latest.safetensors"
    latest.write_bytes(_safetensors_bytes(header))
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.read_metadata(latest)
    assert checkpoint.find_resume(tmp_path).kind == "best"  # skipped with a warning


def test_identity_that_is_not_an_object_is_a_mismatch(tmp_path: Path) -> None:
    write(tmp_path, "latest", 2, identity="nonsense")  # type: ignore[arg-type]
    with pytest.raises(checkpoint.IdentityMismatch):
        checkpoint.find_resume(tmp_path, IDENTITY)
