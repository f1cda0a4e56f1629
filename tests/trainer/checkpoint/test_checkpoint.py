"""Checkpoints: one safetensors file, atomic, never unpickled; resume picks the newest valid."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.checkpoint import store
from trainer.checkpoint.format import CheckpointError
from trainer.network.loss import DeepSupervisionLoss
from trainer.network.unet import PlainConvUNet

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
    store.save(path, model, sgd(model), scaler, {"epoch_next": epoch_next, "identity": identity})
    return path


def test_round_trip_gives_bit_identical_next_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, opt = tiny_net(), None
    opt = sgd(model)
    step(model, opt, 1)  # creates momentum buffers
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    path = tmp_path / "checkpoint_latest.safetensors"
    store.save(path, model, opt, scaler, {"epoch_next": 1, "history": {"train_loss": [0.5]}})
    tensors, meta = store.load(path)
    assert meta["epoch_next"] == 1 and meta["history"]["train_loss"] == [0.5]
    assert any(k.startswith("optim.state.") for k in tensors)
    assert tensors["rng.torch_cpu"].dtype == torch.uint8
    twin, twin_opt = tiny_net(), None
    twin_opt = sgd(twin)
    store.apply(tensors, meta, twin, twin_opt, scaler, restore_rng_state=True)
    step(model, opt, 2)
    step(twin, twin_opt, 2)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert not list(tmp_path.glob("*.tmp")), "temporary file left behind"


def test_resume_prefers_newest_epoch_then_final_latest_best(tmp_path: Path) -> None:
    write(tmp_path, "best", 3)
    write(tmp_path, "latest", 5)
    assert store.find_resume(tmp_path).kind == "latest"
    write(tmp_path, "final", 5)
    assert store.find_resume(tmp_path).kind == "final"


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
    assert store.find_resume(tmp_path).kind == expected
    with pytest.raises(CheckpointError):
        store.load(latest)


def test_no_valid_checkpoint_means_none(tmp_path: Path) -> None:
    assert store.find_resume(tmp_path) is None
    (tmp_path / "checkpoint_latest.safetensors").write_bytes(b"nonsense")
    assert store.find_resume(tmp_path) is None


def test_identity_mismatch_is_refused(tmp_path: Path) -> None:
    write(tmp_path, "latest", 2, identity={**IDENTITY, "configuration": "2d"})
    with pytest.raises(store.IdentityMismatch, match="configuration"):
        store.find_resume(tmp_path, IDENTITY)


def test_metadata_is_read_without_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = write(tmp_path, "latest", 7)
    code = (
        "import sys; from pathlib import Path; from trainer.checkpoint.store import read_metadata; "
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
    with pytest.raises(CheckpointError):
        store.read_metadata(latest)
    assert store.find_resume(tmp_path).kind == "best"  # skipped with a warning


def test_identity_that_is_not_an_object_is_a_mismatch(tmp_path: Path) -> None:
    write(tmp_path, "latest", 2, identity="nonsense")  # type: ignore[arg-type]
    with pytest.raises(store.IdentityMismatch):
        store.find_resume(tmp_path, IDENTITY)


# ---- checksums: every byte of the file is covered ----------------------------------------


def _header(path: Path) -> tuple[int, dict]:
    import json
    import struct

    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return length, json.loads(raw[8 : 8 + length])


def _flip(path: Path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def test_every_tensor_and_the_metadata_carry_a_sha256(tmp_path: Path) -> None:
    import hashlib
    import json

    path = write(tmp_path, "latest", 3)
    _, header = _header(path)
    meta = header.pop("__metadata__")
    assert hashlib.sha256(meta["nnui"].encode()).hexdigest() == meta["nnui_sha256"]
    sums = json.loads(meta["nnui"])["tensor_sha256"]
    assert sums.keys() == header.keys()
    for key, (dtype, shape, digest) in sums.items():
        assert [dtype, shape] == [header[key]["dtype"], header[key]["shape"]]
        assert len(digest) == 64
    assert store.read_metadata(path)["epoch_next"] == 3


def _offset_of(path: Path, where: str) -> int:
    length, header = _header(path)
    raw = path.read_bytes()
    if where == "length field":
        return 0
    if where == "metadata text":
        return raw.index(b"epoch_next", 8)
    if where == "tensor table":
        return raw.index(b'"shape"', 8) + 10  # inside a shape list
    if where == "header end":
        return 8 + length - 1  # a padding space or the closing brace
    name = {"weight bytes": "model.", "rng bytes": "rng.torch_cpu"}[where]
    key = next(k for k in header if k.startswith(name))
    begin, end = header[key]["data_offsets"]
    return 8 + length + (begin + end) // 2


@pytest.mark.parametrize(
    "where",
    ["length field", "metadata text", "tensor table", "header end", "weight bytes", "rng bytes"],
)
def test_one_flipped_bit_anywhere_is_refused_and_the_next_one_used(
    tmp_path: Path, caplog, where: str
) -> None:
    write(tmp_path, "best", 2)
    latest = write(tmp_path, "latest", 4)
    _flip(latest, _offset_of(latest, where))
    with pytest.raises(CheckpointError):
        store.load(latest)
    with pytest.raises(CheckpointError):
        store.read_metadata(latest)
    with caplog.at_level("WARNING"):
        assert store.find_resume(tmp_path).kind == "best"
        assert store.load_resume(tmp_path).info.kind == "best"
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert skipped and all("\n" not in m and "checkpoint_latest" in m for m in skipped)


def test_a_weight_flipped_to_nan_never_reaches_the_model(tmp_path: Path) -> None:
    """The exponent bits of one float32 set to all ones: NaN, refused by its checksum."""
    latest = write(tmp_path, "latest", 4)
    length, header = _header(latest)
    key = next(k for k in header if k.startswith("model.") and header[k]["dtype"] == "F32")
    offset = 8 + length + header[key]["data_offsets"][0]
    data = bytearray(latest.read_bytes())
    data[offset + 3] |= 0x7F
    data[offset + 2] |= 0x80
    data[offset] |= 0x01
    latest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        store.load(latest)
    assert store.load_resume(tmp_path) is None


def _rewrite(path: Path, change_tensors=None, change_meta=None, checksums: bool = True) -> None:
    """Re-save a checkpoint with changed content: with fresh checksums (a crafted, intact
    file) or without any (what an older nnui wrote)."""
    import json

    from safetensors.torch import load_file
    from safetensors.torch import save as save_bytes

    tensors = load_file(str(path))
    _, header = _header(path)
    meta = json.loads(header["__metadata__"]["nnui"])
    meta.pop("tensor_sha256")
    if change_tensors:
        change_tensors(tensors)
    if change_meta:
        change_meta(meta)
    if checksums:
        store.write_tensors(path, tensors, meta)
    else:
        path.write_bytes(save_bytes(tensors, metadata={"nnui": json.dumps(meta)}))


def test_older_checkpoints_without_checksums_load_with_one_warning(tmp_path: Path, caplog) -> None:
    latest = write(tmp_path, "latest", 4)
    _rewrite(latest, checksums=False)
    with caplog.at_level("WARNING"):
        assert store.find_resume(tmp_path).kind == "latest"
        tensors, meta = store.load(latest)
    assert meta["epoch_next"] == 4 and "rng.torch_cpu" in tensors
    warnings = [r.getMessage() for r in caplog.records if "no checksums" in r.getMessage()]
    assert len(warnings) == 1, warnings


def test_older_checkpoint_with_nan_weights_is_skipped(tmp_path: Path) -> None:
    write(tmp_path, "best", 2)
    latest = write(tmp_path, "latest", 4)

    def poison(tensors):
        key = next(k for k in tensors if k.startswith("model.") and tensors[k].is_floating_point())
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[0] = float("nan")

    _rewrite(latest, change_tensors=poison, checksums=False)
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        store.load(latest)
    found = store.load_resume(tmp_path)
    assert found.info.kind == "best"
    floats = [t for t in found.tensors.values() if t.is_floating_point()]
    assert all(bool(torch.isfinite(t).all()) for t in floats)


@pytest.mark.parametrize("thing", ["directory", "fifo", "symlink to /dev/zero", "dangling link"])
def test_something_else_in_a_checkpoints_place_is_skipped(tmp_path: Path, thing: str) -> None:
    import os

    write(tmp_path, "best", 2)
    latest = tmp_path / "checkpoint_latest.safetensors"
    if thing == "directory":
        latest.mkdir()
    elif thing == "fifo":
        os.mkfifo(latest)  # opening it would block forever
    elif thing == "symlink to /dev/zero":
        latest.symlink_to("/dev/zero")
    else:
        latest.symlink_to(tmp_path / "gone")
    with pytest.raises(CheckpointError):
        store.load(latest)
    assert store.find_resume(tmp_path).kind == "best"
    assert store.load_resume(tmp_path).info.kind == "best"


def _short_cpu_rng(tensors) -> None:
    tensors["rng.torch_cpu"] = tensors["rng.torch_cpu"][:10].clone()


def _numpy_rng_garbage(meta) -> None:
    meta["rng"]["numpy"] = ["MT19937", [1, 2, 3], 0, 0, 0.0]


def _python_rng_garbage(meta) -> None:
    meta["rng"]["python"] = [3, "abc", None]


@pytest.mark.parametrize(
    ("change_tensors", "change_meta", "reason"),
    [
        (_short_cpu_rng, None, "bad RNG state"),
        (None, _numpy_rng_garbage, "bad RNG state"),
        (None, _python_rng_garbage, "bad RNG state"),
        (lambda t: t.pop("rng.torch_cpu"), None, "bad RNG state"),
        (None, lambda m: m["scaler"].update(scale="big"), "malformed scaler"),
    ],
)
def test_intact_file_with_unusable_state_is_skipped_for_resume(
    tmp_path: Path, caplog, change_tensors, change_meta, reason: str
) -> None:
    write(tmp_path, "best", 2)
    latest = write(tmp_path, "latest", 4)
    _rewrite(latest, change_tensors, change_meta)
    with caplog.at_level("WARNING"):
        assert store.load_resume(tmp_path).info.kind == "best"
    assert any(reason in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("change_meta", "reason"),
    [
        (lambda m: m.update(epoch_next=50, config={"num_epochs": 10}), "beyond its own schedule"),
        (lambda m: m.update(epoch_next=-1), "is not an epoch"),
        (lambda m: m.update(epoch_next=1e400), "is not an epoch"),
        (lambda m: m.update(epoch_next="abc"), "is not an epoch"),
        (lambda m: m.update(history={"train_loss": [0.1]}), "history does not match"),
        (lambda m: m.update(optimizer=[]), "malformed optimizer"),
        (lambda m: m.update(format="other"), "not an nnui-checkpoint-v1"),
    ],
)
def test_intact_file_with_impossible_metadata_is_skipped(
    tmp_path: Path, caplog, change_meta, reason: str
) -> None:
    write(tmp_path, "best", 2)
    latest = write(tmp_path, "latest", 4)
    _rewrite(latest, change_meta=change_meta)
    with caplog.at_level("WARNING"):
        assert store.find_resume(tmp_path).kind == "best"
    assert any(reason in r.getMessage() for r in caplog.records), caplog.text


def test_newest_checkpoint_beyond_this_runs_schedule_is_refused_not_skipped(
    tmp_path: Path,
) -> None:
    """Falling back to an older file would overwrite the longer training: refuse instead."""
    write(tmp_path, "best", 2)
    write(tmp_path, "final", 8)
    with pytest.raises(store.BeyondSchedule, match="--epochs 8 or more"):
        store.find_resume(tmp_path, num_epochs=5)
    with pytest.raises(store.BeyondSchedule):
        store.load_resume(tmp_path, num_epochs=5)
    assert store.find_resume(tmp_path, num_epochs=8).kind == "final"


def test_weights_of_another_network_are_skipped_before_touching_the_model(tmp_path: Path) -> None:
    from trainer.checkpoint.fit import check_fits

    write(tmp_path, "best", 2)
    latest = tmp_path / "checkpoint_latest.safetensors"
    other = PlainConvUNet(1, 3, [4, 16], [[3, 3, 3]] * 2, [[1, 1, 1], [2, 2, 2]], [1, 1], [1], 3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    store.save(latest, other, sgd(other), scaler, {"epoch_next": 4, "identity": IDENTITY})
    model = tiny_net()
    optimizer = sgd(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def fits(name, tensors, meta):
        check_fits(name, tensors, meta, model, optimizer)

    found = store.load_resume(tmp_path, fits=fits)
    assert found.info.kind == "best"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_checkpoint_of_another_fold_is_refused_also_when_written_before_fold_was_stored(
    tmp_path: Path,
) -> None:
    expected = {**IDENTITY, "fold": "0"}
    write(tmp_path, "latest", 2, identity={**IDENTITY, "fold": "1"})
    with pytest.raises(store.IdentityMismatch, match="fold='1'"):
        store.find_resume(tmp_path, expected)
    # Older checkpoints have no fold in their identity, but their config records it.
    latest = tmp_path / "checkpoint_latest.safetensors"
    _rewrite(latest, change_meta=lambda m: m.update(identity=IDENTITY, config={"fold": "1"}))
    with pytest.raises(store.IdentityMismatch, match="fold='1'"):
        store.find_resume(tmp_path, expected)
    _rewrite(latest, change_meta=lambda m: m.update(config={"fold": "0"}))
    assert store.find_resume(tmp_path, expected).kind == "latest"


# ---- writes that fail, stale temporary files ---------------------------------------------


def _full_disk_after(num_bytes: int):
    import errno

    def write_some(handle, data):
        handle.write(data[:num_bytes])
        handle.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    return write_some


def test_full_disk_removes_the_partial_file_and_keeps_the_older_checkpoint(
    tmp_path: Path, monkeypatch
) -> None:
    from trainer.checkpoint import atomic
    from trainer.schema import atomic as schema_atomic

    latest = write(tmp_path, "latest", 2)
    before = latest.read_bytes()
    monkeypatch.setattr(schema_atomic, "_write_all", _full_disk_after(1000))
    with pytest.raises(atomic.CheckpointWriteError) as raised:
        write(tmp_path, "latest", 3)
    message = str(raised.value)
    assert "\n" not in message and "no space left on device" in message
    assert "checkpoint_latest.safetensors" in message and "--c" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_latest.safetensors"]
    assert latest.read_bytes() == before
    monkeypatch.undo()
    assert store.load_resume(tmp_path).info.epoch_next == 2


def test_stale_temporary_files_of_dead_writers_are_removed_and_nothing_else(
    tmp_path: Path,
) -> None:
    import os
    import subprocess
    import sys

    from trainer.checkpoint.atomic import remove_stale_tmp

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    alive, mine = os.getppid(), os.getpid()
    (tmp_path / "validation").mkdir()
    stale = [
        f".checkpoint_latest.safetensors.{dead}.tmp",
        f".checkpoint_final.safetensors.{mine}.tmp",
        f".status.json.{dead}.tmp",
        f".config.json.{dead}.tmp",
        f"validation/.summary.json.{dead}.tmp",
        f"validation/.case_001.npz.{dead}.tmp",
        f"validation/.case_001.nii.gz.{dead}.tmp",  # a segmentation of final validation
    ]
    kept = [
        f".checkpoint_best.safetensors.{alive}.tmp",  # its writer may still be at work
        f".checkpoint_latest.pth.{dead}.tmp",  # not an nnui name
        f".events.jsonl.{dead}.tmp",
        f"notes.{dead}.tmp",
        ".checkpoint_latest.safetensors.tmp",
        "checkpoint_latest.safetensors",
        f"validation/.case_001.txt.{dead}.tmp",
    ]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"partial")
    removed = remove_stale_tmp(tmp_path)
    assert sorted(removed) == sorted(stale)
    assert all((tmp_path / name).exists() for name in kept)
    assert not any((tmp_path / name).exists() for name in stale)
    assert remove_stale_tmp(tmp_path / "missing") == []


@pytest.mark.parametrize("value", ["abc", float("nan"), float("inf"), [1], True, 10**400])
def test_ema_that_is_not_a_number_is_refused(tmp_path: Path, value) -> None:
    write(tmp_path, "best", 2)
    latest = write(tmp_path, "latest", 4)
    _rewrite(latest, change_meta=lambda m: m.update(ema_fg_dice=value))
    assert store.find_resume(tmp_path).kind == "best"


def test_one_identity_comparison_reads_older_checkpoints_config_too() -> None:
    """nnui-predict and resume compare identities with the same function: a key an older
    checkpoint kept only in its config counts, and the first differing key is named."""
    older = {"identity": dict(IDENTITY), "config": {"fold": "0"}}
    assert store.identity_mismatch(older, {**IDENTITY, "fold": "0"}) is None
    assert store.identity_mismatch(older, {**IDENTITY, "fold": "2"}) == ("fold", "0")
    assert store.identity_mismatch({"identity": "garbage"}, {"fold": "0"}) == ("fold", None)
