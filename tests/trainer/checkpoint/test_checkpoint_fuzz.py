"""Fuzz: real checkpoint files, randomly damaged (bit flips, overwrites, truncations, garbage,
files of another kind) or rewritten with mutated content and fresh checksums (crafted).

The loader must then pick the newest undamaged checkpoint (or say none is valid), raise
nothing but its documented one-line refusals, and never hand over a non-finite tensor or
state that does not apply. Seeded: a failure names its seed and iteration."""

from __future__ import annotations

import json
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainer.checkpoint import store
from trainer.checkpoint.fit import check_fits
from trainer.checkpoint.format import CheckpointError
from trainer.network.loss import DeepSupervisionLoss
from trainer.network.unet import PlainConvUNet

NUM_EPOCHS = 6
IDENTITY = {"dataset_name": "Dataset001_X", "configuration": "3d_fullres",
            "plans_name": "nnUNetPlans", "plans_identity": "abc", "fold": "0"}  # fmt: skip
EPOCHS = {"final": 5, "latest": 4, "best": 2}  # newest first = the order resume prefers
ITERATIONS_PER_SEED = 40
REFUSALS = (CheckpointError, store.IdentityMismatch, store.BeyondSchedule)


def tiny_net() -> PlainConvUNet:
    return PlainConvUNet(
        1, 3, [4, 8], [[3, 3, 3]] * 2, [[1, 1, 1], [2, 2, 2]], [1, 1], [1], 3, recompute_norm=False
    )


def sgd(model: torch.nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.99, nesterov=True)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 4, 4, 4, generator=g)
    t = torch.randint(0, 3, (1, 1, 4, 4, 4), generator=g)
    optimizer.zero_grad()
    loss = DeepSupervisionLoss(1)(model(x), t)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, bytes]:
    """Three real checkpoints of one run (with momentum buffers, history, config)."""
    folder = tmp_path_factory.mktemp("originals")
    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    torch.manual_seed(0)
    model = tiny_net()
    optimizer = sgd(model)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    files = {}
    for kind, epoch_next in sorted(EPOCHS.items(), key=lambda item: item[1]):
        train_step(model, optimizer)
        meta = {
            "kind": kind, "epoch_next": epoch_next, "identity": IDENTITY,
            "config": {"num_epochs": NUM_EPOCHS, "fold": "0"},
            "history": {"train_loss": [0.5] * epoch_next, "lr": [0.01] * epoch_next},
        }  # fmt: skip
        path = folder / f"checkpoint_{kind}.safetensors"
        store.save(path, model, optimizer, scaler, meta)
        files[kind] = path.read_bytes()
    torch.set_rng_state(saved[0])
    np.random.set_state(saved[1])
    random.setstate(saved[2])
    return files


# ---- byte damage --------------------------------------------------------------------------


def _header_len(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else 0


def flip_bits(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def flip_in_header(rng: random.Random, data: bytes) -> bytes:
    """The header is a small part of the file: aim at it on purpose."""
    out = bytearray(data)
    out[rng.randrange(8 + _header_len(data))] ^= 1 << rng.randrange(8)
    return bytes(out)


def overwrite(rng: random.Random, data: bytes) -> bytes:
    start = rng.randrange(len(data))
    chunk = rng.randbytes(rng.randint(1, 64))
    return data[:start] + chunk + data[start + len(chunk) :]


def truncate(rng: random.Random, data: bytes) -> bytes:
    return data[: rng.randrange(len(data))]


def append(rng: random.Random, data: bytes) -> bytes:
    return data + rng.randbytes(rng.randint(1, 32))


def garbage(rng: random.Random, data: bytes) -> bytes:
    size = rng.choice([0, 3, 8, 64, len(data)])
    head = struct.pack("<Q", rng.choice([0, 2, 10**6, 2**63])) if rng.random() < 0.5 else b""
    return (head + rng.randbytes(size))[: max(size, len(head))]


BYTE_DAMAGE: list[Callable[[random.Random, bytes], bytes]] = [
    flip_bits, flip_in_header, overwrite, truncate, append, garbage,
]  # fmt: skip


# ---- crafted content (fresh checksums: intact files with wrong content) ---------------------

VALUES: list[Any] = [None, -1, 0, 1, 10**30, 1e308, float("nan"), "abc", "", [], {}, True,
                     [[[]]], {"a": 1}, 3.5, [-1, 2], "0"]  # fmt: skip


def _paths(value: Any, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    found = [prefix] if prefix else []
    if depth > 4:
        return found
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key), depth + 1)
    elif isinstance(value, list):
        for index in sorted({0, len(value) - 1}) if value else []:
            found += _paths(value[index], (*prefix, index), depth + 1)
    return found


def mutate_meta(rng: random.Random, meta: dict[str, Any]) -> None:
    path = rng.choice(_paths(meta))
    parent = meta
    for step in path[:-1]:
        parent = parent[step]
    if isinstance(parent, dict) and rng.random() < 0.2:
        del parent[path[-1]]
    else:
        parent[path[-1]] = rng.choice(VALUES)


def mutate_tensors(rng: random.Random, tensors: dict[str, torch.Tensor]) -> None:
    key = rng.choice(sorted(tensors))
    tensor = tensors[key]
    action = rng.choice(["nan", "inf", "reshape", "dtype", "drop", "extra", "huge"])
    if action in ("nan", "inf", "huge") and tensor.is_floating_point() and tensor.numel():
        tensor = tensor.clone()
        tensor.view(-1)[rng.randrange(tensor.numel())] = {
            "nan": float("nan"), "inf": float("inf"), "huge": 1e30}[action]  # fmt: skip
        tensors[key] = tensor
    elif action == "reshape":
        tensors[key] = tensor.reshape(-1)[: max(tensor.numel() // 2, 1)].clone()
    elif action == "dtype":
        tensors[key] = tensor.to(torch.float64 if tensor.is_floating_point() else torch.int64)
    elif action == "drop":
        del tensors[key]
    else:
        tensors["model.extra"] = torch.zeros(3)


def craft(rng: random.Random, path: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    raw = path.read_bytes()
    meta = json.loads(json.loads(raw[8 : 8 + _header_len(raw)])["__metadata__"]["nnui"])
    meta.pop("tensor_sha256")
    if rng.random() < 0.6:
        mutate_meta(rng, meta)
    else:
        mutate_tensors(rng, tensors)
    store.write_tensors(path, tensors, meta)


def replace_by_other_kind(rng: random.Random, path: Path) -> None:
    path.unlink()
    choice = rng.choice(["dir", "link", "empty"])
    if choice == "dir":
        path.mkdir()
    elif choice == "link":
        path.symlink_to(path.with_name("nowhere"))
    else:
        path.write_bytes(b"")


# ---- the test -----------------------------------------------------------------------------


def damage(rng: random.Random, folder: Path, originals: dict[str, bytes]) -> set[str]:
    """Damage 1-3 of the files; returns the kinds whose content was crafted."""
    crafted = set()
    for kind in rng.sample(sorted(originals), rng.randint(1, 3)):
        path = folder / f"checkpoint_{kind}.safetensors"
        roll = rng.random()
        if roll < 0.25:
            craft(rng, path)
            crafted.add(kind)
        elif roll < 0.32:
            replace_by_other_kind(rng, path)
        else:
            path.write_bytes(rng.choice(BYTE_DAMAGE)(rng, originals[kind]))
    return crafted


def intact(folder: Path, kind: str, originals: dict[str, bytes]) -> bool:
    path = folder / f"checkpoint_{kind}.safetensors"
    return path.is_file() and not path.is_symlink() and path.read_bytes() == originals[kind]


def check_loader(folder: Path, originals: dict[str, bytes], crafted: set[str]) -> None:
    for path in folder.iterdir():
        for read in (store.read_metadata, store.load):
            try:
                read(path)
            except CheckpointError as error:
                assert "\n" not in str(error)
    model, scaler = tiny_net(), torch.amp.GradScaler("cpu", enabled=False)
    optimizer = sgd(model)

    def fits(name: str, tensors: dict, meta: dict) -> None:
        check_fits(name, tensors, meta, model, optimizer)

    try:
        store.find_resume(folder, IDENTITY, NUM_EPOCHS)
        found = store.load_resume(folder, IDENTITY, NUM_EPOCHS, fits)
    except REFUSALS as error:
        assert crafted, f"refused although nothing was crafted: {error}"
        assert "\n" not in str(error)
        return
    newest_intact = next((k for k in EPOCHS if intact(folder, k, originals)), None)
    if not crafted:
        assert (found.info.kind if found else None) == newest_intact
    if found is None:
        return
    kind = found.info.kind
    assert kind in crafted or intact(folder, kind, originals), f"damaged {kind} accepted"
    floats = [t for t in found.tensors.values() if t.is_floating_point()]
    assert all(bool(torch.isfinite(t).all()) for t in floats), "non-finite tensor returned"
    store.apply(found.tensors, found.info.metadata, model, optimizer, scaler, True)
    output = use(model, optimizer)
    if kind not in crafted:
        assert np.isfinite(output)


def use(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """What training does with restored state, cheaply: a forward pass and an optimizer
    step (momentum, settings) with zero gradients."""
    with torch.no_grad():
        output = model.eval()(torch.ones(1, 1, 4, 4, 4))
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    torch.rand(1)  # the restored RNG state works
    return float(output[0].sum())


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_damaged_checkpoints_never_crash_the_loader_nor_give_nan(
    tmp_path: Path, originals: dict[str, bytes], seed: int
) -> None:
    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    rng = random.Random(seed)
    try:
        for iteration in range(ITERATIONS_PER_SEED):
            folder = tmp_path / f"run{iteration}"
            folder.mkdir()
            for kind, data in originals.items():
                (folder / f"checkpoint_{kind}.safetensors").write_bytes(data)
            crafted = damage(rng, folder, originals)
            try:
                check_loader(folder, originals, crafted)
            except AssertionError as error:
                raise AssertionError(f"seed {seed} iteration {iteration}: {error}") from error
            shutil.rmtree(folder)
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])
