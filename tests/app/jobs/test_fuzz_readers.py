"""Fuzz (seeded, deterministic): random and mutated event lines through every reader of a
run folder — the JSONL tail, JobTracker's views, the topology and stop planning (plan_stop,
the process tree's latest_topology, the supervisor's RunWatch). No exception escapes,
every valid record is read, every invalid line is counted exactly once."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from app.services.jobs.events import latest_topology
from app.services.jobs.registry import Job, ProcessRecord, Registry
from app.services.jobs.views import JobTracker
from app.services.machine.procs import ProcInfo, proc_info
from app.services.signals.proctree import process_tree
from app.services.signals.targets import plan_stop
from app.services.supervisor.main import RunWatch
from app.services.tail import JsonlTail
from trainer.schema.events import OPTIONAL_KEYS, REQUIRED_KEYS, Kind, encode_event, validate_event
from trainer.schema.tree import EVENTS_FILE

SEED = 16
NUM_CASES = 300
T0 = 1_700_000_000.0
HOST = socket.gethostname()
_ME = proc_info(os.getpid())
ME_ALIVE = ProcessRecord(_ME.pid, _ME.create_time, "supervisor", None, _ME.start_ticks)
WRONG_VALUES = [None, "abc", True, False, [], {}, -7, 0, 2**40, 1.5, "1", [None], [{"pid": -1}],
                [{"pid": 0}], "all", float("inf"), float("nan")]  # fmt: skip
HUGE_LITERALS = ["1e400", "-1e400", "1" + "0" * 400, "NaN", "Infinity", "-Infinity"]


def _valid_record(rng: random.Random, kind: Kind, t: float) -> dict:
    rank = {"global_rank": 0, "local_rank": 0, "host": HOST, "pid": rng.randint(2, 4_000_000),
            "device": "cpu", "batch_size": 2, "sigusr1_handler": True}  # fmt: skip
    fields = {
        Kind.RUN_STARTED: dict(num_epochs=rng.randint(1, 50), world_size=1, fold="0"),
        Kind.TOPOLOGY: dict(ranks=[rank]),
        Kind.EPOCH_ENDED: dict(epoch=rng.randint(0, 60), train_loss=rng.random(), lr=0.01,
                               val_loss=None, dice_per_class=[0.5, None], epoch_time_s=1.5),
        Kind.CHECKPOINT_SAVED: dict(checkpoint="latest", path="/x", epoch=3),
        Kind.STOP_REQUESTED: dict(epoch=rng.randint(-1, 9), ranks=[0]),
        Kind.STOP_HEARD: dict(epoch=rng.randint(0, 9)),
        Kind.STOPPED: dict(epoch=2, reason="SIGUSR1"),
        Kind.VALIDATION_STARTED: dict(epoch=9, num_cases=2),
        Kind.VALIDATION_FINISHED: dict(mean_fg_dice=0.7, dice_per_class=[0.7], num_cases=2),
        Kind.VALIDATION_CASE: dict(index=rng.randint(1, 9), num_cases=9),
        Kind.FINISHED: dict(epoch=9),
        Kind.FAILED: dict(message="boom", traceback=""),
        Kind.TRAIN_LOSS_RUNNING: dict(epoch=1, iteration=3, num_iterations=4, loss=0.5),
        Kind.PREDICTION_STARTED: dict(num_cases=rng.randint(0, 9), part_id=0, num_parts=1),
        Kind.CASE_PREDICTED: dict(case="c1", index=1, seconds=0.5, shape=[4, 5, 6]),
    }[kind]  # fmt: skip
    return json.loads(encode_event(kind, t=t, **fields))


def _wrong_value(rng: random.Random, record: dict) -> bytes:
    keys = [k for k in (*REQUIRED_KEYS[Kind(record["kind"])], *OPTIONAL_KEYS[Kind(record["kind"])],
                        "t", "kind") if k in record]  # fmt: skip
    key = rng.choice(keys)
    for value in rng.sample(WRONG_VALUES, len(WRONG_VALUES)):
        mutated = {**record, key: value}
        if validate_event(mutated) is not None:
            return json.dumps(mutated).encode()
    raise AssertionError(f"no wrong value for {key}")


def _drop_required(rng: random.Random, record: dict) -> bytes:
    dropped = rng.choice([*REQUIRED_KEYS[Kind(record["kind"])], "t", "kind"])
    return json.dumps({k: v for k, v in record.items() if k != dropped}).encode()


def _huge(rng: random.Random, record: dict) -> bytes:
    key = rng.choice(["t", *(k for k in ("epoch", "num_epochs", "train_loss") if k in record)])
    text = json.dumps({**record, key: "__HUGE__"})
    return text.replace('"__HUGE__"', rng.choice(HUGE_LITERALS)).encode()


def _bad_pid(rng: random.Random, record: dict) -> bytes:
    rank = {"global_rank": 0, "host": HOST, "pid": rng.choice([-1, 0, -(2**40), 2**63, "7", 1.5])}
    return json.dumps({**record, "kind": "topology", "ranks": [rank]}).encode()


def _not_utf8(rng: random.Random, record: dict) -> bytes:
    text = json.dumps({**record, "host": "__BYTES__"}).encode()
    return text.replace(b"__BYTES__", rng.choice([b"\xff\xfe", b"\xc3\x28", b"\x80abc"]))


def _garbage(rng: random.Random, record: dict) -> bytes:
    return b"\x00" + rng.randbytes(rng.randint(1, 300)).replace(b"\n", b" ")


def _shapes(rng: random.Random, record: dict) -> bytes:
    return rng.choice([b"[1, 2]", b"null", b'"x"', b"3", b"[" * 5000, b"{" * 3000, b"{}",
                       b'{"t": 1}', b'{"kind": "topology"}'])  # fmt: skip


MUTATIONS: list[Callable[[random.Random, dict], bytes]] = [
    _wrong_value, _drop_required, _huge, _bad_pid, _not_utf8, _garbage, _shapes,
]  # fmt: skip


def _case(rng: random.Random) -> tuple[bytes, set[float], int]:
    """(file bytes, t of every valid record, number of lines that must count as invalid)."""
    kinds = [Kind.RUN_STARTED, Kind.TOPOLOGY, *rng.choices(list(Kind), k=rng.randint(3, 25))]
    data, valid_t, num_invalid = b"", set(), 0
    for index, kind in enumerate(kinds):
        record = _valid_record(rng, kind, T0 + index)
        roll = rng.random()
        if roll < 0.3:
            data += rng.choice(MUTATIONS)(rng, record) + b"\n"
            num_invalid += 1
        elif roll < 0.4 and index + 1 < len(kinds):  # torn: the next (valid) line glues on
            line = json.dumps(record).encode()
            data += line[: rng.randint(1, len(line) - 2)]
            num_invalid += 1
            index_next = T0 + index + 0.5
            data += json.dumps(_valid_record(rng, rng.choice(list(Kind)), index_next)).encode()
            data += b"\n"
            valid_t.add(index_next)
        else:
            data += json.dumps(record).encode() + b"\n"
            valid_t.add(record["t"])
    return data, valid_t, num_invalid


def _other_users(rng: random.Random) -> Callable[[int], ProcInfo | None]:
    """A process table where every pid is gone or someone else's: nothing can be signalled."""
    uid = os.getuid() + 1

    def lookup(pid: int) -> ProcInfo | None:
        if pid % 3 == 0:
            return None
        return ProcInfo(pid, 1, uid, T0, "python", ["python"], True, "J", False, 1)

    return lookup


def _job(tmp: Path) -> Job:
    return Job("J", T0 - 10, "Dataset004_Demo", "3d_fullres", "0", "single", "cpu", [], False,
               [], {}, str(tmp), str(tmp / "console.log"), processes=[ME_ALIVE],
               queued_stop=True)  # fmt: skip


def _read_everything(registry: Registry, tracker: JobTracker, watch: RunWatch, lookup) -> None:
    (view,) = tracker.refresh()
    plan = plan_stop(view.job, view.topology, view.epoch, proc_lookup=lookup)
    assert not plan.ok
    watch.step()


@pytest.fixture
def no_signals(monkeypatch: pytest.MonkeyPatch) -> list:
    sent: list = []
    monkeypatch.setattr(os, "kill", lambda *a: sent.append(a))
    monkeypatch.setattr(signal, "pidfd_send_signal", lambda *a: sent.append(a))
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # 300 registries: durability is not tested
    return sent


def test_readers_survive_random_and_mutated_events(tmp_path: Path, no_signals: list) -> None:
    rng = random.Random(SEED)
    for number in range(NUM_CASES):
        folder = tmp_path / f"case{number}"
        folder.mkdir()
        data, valid_t, num_invalid = _case(rng)
        registry = Registry(folder / "state")
        registry.add(_job(folder))
        tracker, lookup = JobTracker(registry), _other_users(rng)
        watch = RunWatch(registry, "J", proc_lookup=lookup)
        with open(folder / EVENTS_FILE, "ab") as handle:
            offset = 0
            while offset < len(data):  # written in random pieces, read between them
                step = rng.randint(len(data) // 4, len(data))
                handle.write(data[offset : offset + step])
                handle.flush()
                offset += step
                _read_everything(registry, tracker, watch, lookup)
        (view,) = tracker.refresh()
        events = tracker._runs["J"].events.tail  # consumed as read: a fresh reader keeps them
        whole = JsonlTail(folder / EVENTS_FILE)
        whole.poll()
        while whole.more:
            whole.poll()
        assert {r["t"] for r in whole.records} == valid_t, number
        assert view.num_invalid_events == num_invalid, (number, list(events.invalid_samples))
        assert latest_topology(view.job) == view.topology
        process_tree(view.job, None, proc_lookup=lookup, children=lambda pid: [])
    assert no_signals == []


# ---- image files (trainer.data.image_io): every broken file is one ImageReadError ---------

IMAGE_MUTATIONS = 30


def _valid_images(folder: Path) -> list[Path]:
    """One tiny valid file per format (a 3D TIFF with its spacing file)."""
    import numpy as np
    import SimpleITK as sitk
    import tifffile
    from PIL import Image

    from trainer.data.image_io import write_nifti

    volume = np.arange(4 * 5 * 6, dtype=np.float32).reshape(4, 5, 6)
    write_nifti(folder / "a_0000.nii.gz", volume, (2.0, 1.0, 1.0))
    for ending in (".nrrd", ".mha", ".gipl"):
        sitk.WriteImage(sitk.GetImageFromArray(volume), str(folder / f"a_0000{ending}"), True)
    rgb = (volume[0, :, :, None] * [1, 2, 3]).astype(np.uint8)
    Image.fromarray(rgb).save(folder / "a_0000.png")
    Image.fromarray(rgb).save(folder / "a_0000.bmp")
    tifffile.imwrite(folder / "a_0000.tif", volume, photometric="minisblack")
    (folder / "a.json").write_text('{"spacing": [2.0, 1.0, 1.0]}')
    np.save(folder / "a_0000.npy", volume)
    return sorted(p for p in folder.iterdir() if p.suffix != ".json")


def test_image_readers_turn_every_broken_file_into_one_read_error(tmp_path: Path) -> None:
    from trainer.data.image_io import ImageReadError, image_header, read_case, read_labels

    rng = random.Random(SEED)
    for valid in _valid_images(tmp_path):
        original = valid.read_bytes()
        read_case([valid])  # the unbroken file reads
        for number in range(IMAGE_MUTATIONS):
            data = bytearray(original)
            if number % 3 == 0:
                data = data[: rng.randrange(len(data))]
            else:
                for _ in range(rng.randint(1, 8)):
                    data[rng.randrange(len(data))] = rng.randrange(256)
            valid.write_bytes(bytes(data))
            for read in (image_header, lambda p: read_case([p]), read_labels):
                try:
                    read(valid)
                except ImageReadError as error:
                    assert "\n" not in str(error), (valid.name, number, str(error))
        valid.write_bytes(original)
