"""Patch sampling, determinism, chunk-local reads, batched augmentation, worker hygiene."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import threading
import time
import zlib
from pathlib import Path

import blosc2
import numpy as np
import pytest
import torch

import trainer.data.augment as augment_module
from trainer.data.augment import AugmentConfig, augment_batch, read_size
from trainer.data.blosc_io import choose_layout, read_padded
from trainer.data.dataset import MissingCaseError, PreprocessedCases
from trainer.data.grid_sampling import centre_crop, spatial_transform
from trainer.data.loader import PatchLoader, augment_seed, default_augment_config
from trainer.data.patches import BatchSpec, load_patches
from trainer.data.raw import DataError
from trainer.data.sampling import batch_seed, forced_slots, plan_batch
from trainer.planning.plans import load_plans

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("batch_size", "share", "num_forced"),
    [
        (2, 0.33, 1),
        (1, 0.0, 0),
        (1, 1.0, 1),
        (3, 0.0, 0),
        (2, 0.5, 1),
        (10, 0.33, 3),
        (12, 0.33, 4),
        (3, 1.0, 3),
        (2, 0.0, 0),
        (4, 0.25, 1),
        (5, 0.5, 3),
    ],  # Python round: round(2.5) == 2, so slots 2, 3, 4 are forced
)
def test_forced_slot_counts(batch_size, share, num_forced):
    slots = forced_slots(batch_size, share)
    assert sum(slots) == num_forced
    assert slots == sorted(slots)  # the forced slots are the last ones


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_bad_share(share):
    with pytest.raises(ValueError, match="share"):
        forced_slots(2, share)


def _folder(demo_preprocessed, config):
    folder = demo_preprocessed.preprocessed / demo_preprocessed.dataset_name
    return folder / load_plans(folder).configuration(config).data_identifier


@pytest.mark.parametrize("config", ["3d_fullres", "2d"])
def test_forced_slots_really_contain_foreground(demo_preprocessed, config):
    cases = PreprocessedCases(_folder(demo_preprocessed, config))
    patch = (16, 32, 32) if config == "3d_fullres" else (32, 32)
    spec = BatchSpec(tuple(cases.case_ids), patch, 6, 0.5, 7, 0, "train")
    for k in range(10):
        _, seg, boxes = load_patches(cases, spec, k)
        assert [b.forced for b in boxes] == [False] * 3 + [True] * 3
        for j in range(3, 6):
            assert (seg[j] > 0).any(), (k, j)


def _one_case(shape, locations):
    props = {"shape_after_resampling": shape, "class_locations": {"1": locations}}
    return lambda case_id: props


@pytest.mark.parametrize(("read", "lo_yx"), [((30, 30), (-5, -5)), ((31, 31), (-6, -6))])
def test_random_boxes_follow_nnunets_range(read, lo_yx):
    # need = read - patch (10 or 11) unless the image is shorter; half of it may be
    # padding on each side, the odd voxel on the low side: corner in [(-need) // 2,
    # n + need // 2 + need % 2 - read].
    properties = _one_case((3, 30, 50), [[0, 28, 2]])
    rng = np.random.default_rng(0)
    lowers = [
        b.lower
        for _ in range(400)
        for b in plan_batch(rng, ["a"], 2, 0.0, (20, 20), properties, read)
    ]
    need = read[0] - 20
    for axis, n in ((1, 30), (2, 50)):
        hi = n + need // 2 + need % 2 - read[0]
        assert min(lo[axis] for lo in lowers) == lo_yx[axis - 1]
        assert max(lo[axis] for lo in lowers) == hi
    assert {lo[0] for lo in lowers} == {0, 1, 2}  # 2D: any slice
    assert all(
        b.size == (1, *read) for b in plan_batch(rng, ["a"], 2, 0.0, (20, 20), properties, read)
    )


def test_forced_boxes_centre_the_voxel_and_clip_at_the_low_end_only():
    # Voxel (0, 28, 2) of a 30 x 50 slice, box 30 x 30 for a 20 x 20 patch: y corner
    # 28 - 15 = 13 (the box runs 17 voxels past the image's end), x corner clipped up
    # from 2 - 15 to the lowest allowed -5.
    properties = _one_case((3, 30, 50), [[0, 28, 2]])
    rng = np.random.default_rng(1)
    boxes = plan_batch(rng, ["a"], 3, 1.0, (20, 20), properties, (30, 30))
    assert {b.lower for b in boxes} == {(0, 13, -5)}
    # Without a larger read (validation): same rule, need 0 -> voxel at patch // 2.
    plain = plan_batch(rng, ["a"], 1, 1.0, (20, 20), properties)
    assert plain[0].lower == (0, 18, 0) and plain[0].size == (1, 20, 20)


def test_boxes_of_a_short_image_are_centred():
    # An image shorter than the box: need = read - n, so random boxes have one corner
    # (the image in the middle), as nnU-Net's loader has.
    properties = _one_case((16, 24, 24), [[8, 12, 12]])
    rng = np.random.default_rng(0)
    boxes = plan_batch(rng, ["a"], 50, 0.0, (32, 32, 32), properties, (40, 40, 40))
    assert {b.lower for b in boxes} == {(-12, -8, -8)}


def _batches(cases, start, count, **kwargs):
    args = dict(
        patch_size=(16, 32, 32),
        batch_size=2,
        oversample_share=0.5,
        seed=3,
        rank=0,
        device=CPU,
        augment=True,
    )
    args.update(kwargs)
    with PatchLoader(cases, cases.case_ids, start_iteration=start, **args) as loader:
        out = [next(loader) for _ in range(count)]
        assert loader.iteration == start + count
    return out


def test_stream_is_resumable_and_worker_independent(demo_preprocessed):
    cases = PreprocessedCases(_folder(demo_preprocessed, "3d_fullres"))
    from_zero = _batches(cases, 0, 5, num_workers=2)
    resumed = _batches(cases, 3, 2, num_workers=0)
    in_processes = _batches(cases, 3, 1, num_workers=1, worker_mode="process")
    for a, b in zip(from_zero[3:], resumed, strict=True):
        assert a.iteration == b.iteration
        assert torch.equal(a.data, b.data) and torch.equal(a.target, b.target)
    assert torch.equal(from_zero[3].data, in_processes[0].data)
    other_rank = _batches(cases, 3, 1, num_workers=0, rank=1)[0]
    other_stream = _batches(cases, 3, 1, num_workers=0, stream="val")[0]
    assert not torch.equal(other_rank.data, from_zero[3].data)
    assert not torch.equal(other_stream.data, from_zero[3].data)


@pytest.mark.parametrize("config", ["3d_fullres", "2d"])
def test_centre_only_reads_give_the_full_reads_batches(demo_preprocessed, config):
    """CPU augmentation in the reading thread reads only what augmentation touches of each
    read and lies inside the image, into reused buffers; worker processes read the same
    parts into arrays of their own and the consumer augments them (the GPU path); a
    whole padded read augmented in one piece gives the same labels and images to float
    rounding: moved samples included."""
    cases = PreprocessedCases(_folder(demo_preprocessed, config))
    patch = (16, 32, 32) if config == "3d_fullres" else (32, 32)
    moving = AugmentConfig(p_rotation=0.5, p_scale=0.5, mask_channels=(True,))
    args = dict(patch_size=patch, batch_size=3, augment_config=moving)
    inline = _batches(cases, 0, 4, num_workers=0, **args)
    full = _batches(cases, 0, 4, num_workers=1, worker_mode="process", **args)
    for a, b in zip(inline, full, strict=True):
        assert a.data.shape == (3, 1, *patch) and a.data.dtype == torch.float32
        assert torch.equal(a.data, b.data) and torch.equal(a.target, b.target)
    spec = BatchSpec(tuple(sorted(cases.case_ids)), patch, 3, 0.5, 3, 0, "train",
                     read_size(patch, moving))  # fmt: skip
    for k, batch in enumerate(inline):
        data, seg, _ = load_patches(cases, spec, k)  # the whole read, zero-padded
        generator = torch.Generator().manual_seed(augment_seed(3, 0, "train", k))
        d, s = augment_batch(torch.from_numpy(data), torch.from_numpy(seg), generator, moving,
                             patch_size=patch, read_size=spec.read_size)  # fmt: skip
        assert torch.allclose(d, batch.data, atol=1e-5)
        assert float((s != batch.target).float().mean()) < 1e-3


def _per_sample_statistics(batches) -> dict[str, np.ndarray]:
    """Per sample: intensity mean and std, high-frequency energy (mean squared step along
    x: noise raises it, blur and low resolution lower it), foreground share."""
    data = torch.cat([b.data.float().cpu() for b in batches])
    target = torch.cat([b.target.cpu() for b in batches])
    flat = data.reshape(len(data), -1)
    steps = (data[..., 1:] - data[..., :-1]).square().reshape(len(data), -1)
    return {
        "mean": flat.mean(1).numpy(),
        "std": flat.std(1).numpy(),
        "high_frequency": steps.mean(1).numpy(),
        "foreground": (target > 0).reshape(len(data), -1).float().mean(1).numpy(),
    }


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_device_side_augmentation_draws_from_the_cpu_paths_distributions(demo_preprocessed, device):
    """The GPU path (worker processes read the parts, the consumer augments them on the
    training device, its noise from a generator there) against the CPU path (augmented in
    the reading thread), each with its own seed: per-sample statistics of 320 samples
    from the same distributions (two-sample KS tests; fixed seeds, so no flakes)."""
    stats = pytest.importorskip("scipy.stats")
    cases = PreprocessedCases(_folder(demo_preprocessed, "3d_fullres"))
    common = dict(patch_size=(16, 32, 32), batch_size=4, oversample_share=0.33, rank=0,
                  augment=True, mask_channels=(True,))  # fmt: skip
    runs = {}
    for side, seed, kwargs in (
        ("cpu", 1, dict(device=CPU, num_workers=0)),
        ("device", 2, dict(device=torch.device(device), num_workers=1, worker_mode="process")),
    ):
        with PatchLoader(cases, cases.case_ids, seed=seed, **common, **kwargs) as loader:
            assert loader._augment_in_load is (side == "cpu")  # the two paths under test
            runs[side] = _per_sample_statistics([next(loader) for _ in range(80)])
    for name in runs["cpu"]:
        result = stats.ks_2samp(runs["cpu"][name], runs["device"][name])
        assert result.pvalue > 1e-3, (name, result)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("worker_mode", ["thread", "process"])
def test_cpu_augmentation_for_a_device_gives_the_cpu_paths_batches_there(
    demo_preprocessed, device, worker_mode
):
    """--augment-on cpu: augmented on CPU (loader threads, or the consumer for worker
    processes) and moved to the training device: the very batches of a CPU run."""
    cases = PreprocessedCases(_folder(demo_preprocessed, "3d_fullres"))
    common = dict(patch_size=(16, 32, 32), batch_size=2, oversample_share=0.5, seed=4, rank=0,
                  augment=True, mask_channels=(True,))  # fmt: skip
    with PatchLoader(cases, cases.case_ids, device=CPU, num_workers=0, **common) as loader:
        expected = [next(loader) for _ in range(3)]
    with PatchLoader(cases, cases.case_ids, device=torch.device(device), num_workers=1,
                     worker_mode=worker_mode, augment_on="cpu", **common) as loader:  # fmt: skip
        got = [next(loader) for _ in range(3)]
    for a, b in zip(expected, got, strict=True):
        assert b.data.device.type == device and b.target.device.type == device
        assert torch.equal(a.data, b.data.cpu()) and torch.equal(a.target, b.target.cpu())
    with pytest.raises(ValueError, match="augment_on"):
        PatchLoader(cases, cases.case_ids, device=CPU, augment_on="gpu", **common)


def test_loader_counts_the_time_its_consumer_waited(demo_preprocessed):
    cases = PreprocessedCases(_folder(demo_preprocessed, "3d_fullres"))
    args = dict(patch_size=(16, 32, 32), batch_size=2, oversample_share=0.5, seed=3, rank=0,
                device=CPU, augment=False, num_workers=0)  # fmt: skip
    with PatchLoader(cases, cases.case_ids, **args) as loader:
        assert loader.wait_s == 0.0
        next(loader)
        inline = loader.wait_s
    assert inline > 0  # without workers every read is a wait


def test_2d_batches(demo_preprocessed):
    cases = PreprocessedCases(_folder(demo_preprocessed, "2d"))
    batch = _batches(cases, 0, 1, patch_size=(32, 32), batch_size=4, num_workers=1)[0]
    assert tuple(batch.data.shape) == (4, 1, 32, 32) and tuple(batch.target.shape) == (4, 1, 32, 32)


def test_loader_rejects_bad_arguments(demo_preprocessed):
    cases = PreprocessedCases(_folder(demo_preprocessed, "3d_fullres"))
    base = dict(
        patch_size=(16, 32, 32),
        batch_size=2,
        oversample_share=0.3,
        seed=0,
        rank=0,
        device=CPU,
        augment=False,
        num_workers=0,
    )
    for bad, match in [
        ({"stream": "test"}, "stream"),
        ({"oversample_share": 2.0}, "share"),
        ({"patch_size": (4,)}, "patch_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            PatchLoader(cases, cases.case_ids, **{**base, **bad})
    with pytest.raises(ValueError, match="not in"):
        PatchLoader(cases, ["nope"], **base)


@pytest.fixture
def copied_dataset(demo_preprocessed, tmp_path):
    """A private copy of the preprocessed demo dataset, safe to break."""
    source = demo_preprocessed.preprocessed / demo_preprocessed.dataset_name
    target = tmp_path / demo_preprocessed.dataset_name
    shutil.copytree(source, target)
    return target


@pytest.mark.parametrize(
    "file", ["demo_002.b2nd", "demo_002_seg.b2nd", "demo_002.json", "demo_005.b2nd"]
)
def test_a_deleted_case_file_is_reported_not_skipped(copied_dataset, file):
    folder = copied_dataset / load_plans(copied_dataset).configuration("3d_fullres").data_identifier
    case_id = file.split(".")[0].removesuffix("_seg")
    (folder / file).unlink()
    cases = PreprocessedCases(folder)
    assert cases.case_ids == [f"demo_{i:03d}" for i in range(6)]  # still expected
    assert cases.missing_case_ids() == [case_id]
    with pytest.raises(MissingCaseError, match=f"{case_id}.*rerun nnui-preprocess Dataset900"):
        cases.check_complete()
    load = cases.properties if file.endswith(".json") else cases.load_image
    if file.endswith("_seg.b2nd"):
        load = cases.load_seg
    with pytest.raises(DataError, match="rerun nnui-preprocess"):
        load(case_id)
    with pytest.raises(ValueError, match="rerun nnui-preprocess"):
        PatchLoader(cases, cases.case_ids, (16, 32, 32), 2, 0.3, 0, 0, CPU, False, num_workers=0)
    others = [c for c in cases.case_ids if c != case_id]  # the rest still loads
    PatchLoader(cases, others, (16, 32, 32), 2, 0.3, 0, 0, CPU, False, num_workers=0).close()


def test_expected_cases_fall_back_to_the_fingerprint_then_to_the_folder(copied_dataset):
    folder = copied_dataset / load_plans(copied_dataset).configuration("2d").data_identifier
    data = json.loads((copied_dataset / "nnuiPlans.json").read_text())
    for block in data["configurations"].values():  # plans from before `case_ids`
        del block["case_ids"]
    (copied_dataset / "nnuiPlans.json").write_text(json.dumps(data))
    (folder / "demo_001.json").unlink()
    assert PreprocessedCases(folder).missing_case_ids() == ["demo_001"]
    (copied_dataset / "nnui_fingerprint.json").unlink()  # nothing records the cases
    cases = PreprocessedCases(folder)
    assert "demo_001" not in cases.case_ids and cases.missing_case_ids() == []


def _sigusr1_ignored(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    mask = next(x for x in status.splitlines() if x.startswith("SigIgn:")).split()[1]
    return bool(int(mask, 16) & (1 << (signal.SIGUSR1 - 1)))


def test_worker_processes_ignore_sigusr1_and_are_stopped(demo_preprocessed):
    cases = PreprocessedCases(_folder(demo_preprocessed, "3d_fullres"))
    loader = PatchLoader(
        cases, cases.case_ids, (16, 32, 32), 2, 0.5, 0, 0, CPU, False,
        num_workers=2, worker_mode="process",
    )  # fmt: skip
    try:
        next(loader)
        pids = list(loader._executor._processes)
        assert len(pids) == 2
        # a worker that has not run its initializer yet may still be starting up
        deadline = time.monotonic() + 10
        while not all(_sigusr1_ignored(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_sigusr1_ignored(p) for p in pids), "SIGUSR1 not ignored in a loader worker"
    finally:
        loader.close()
    for pid in pids:
        gone = not os.path.exists(f"/proc/{pid}")
        assert gone or "zombie" in Path(f"/proc/{pid}/status").read_text()


# ---- chunk-local reads -----------------------------------------------------------------

_DECODED_BLOCKS = [0]


def _encode(src, dst, meta, schunk):
    packed = zlib.compress(src.tobytes(), 1)
    if len(packed) >= dst.size:
        return 0
    dst[: len(packed)] = np.frombuffer(packed, np.uint8)
    return len(packed)


def _decode(src, dst, meta, schunk):
    _DECODED_BLOCKS[0] += 1
    raw = zlib.decompress(src.tobytes())
    dst[: len(raw)] = np.frombuffer(raw, np.uint8)
    return len(raw)


COUNTING_CODEC = 211


@pytest.fixture(scope="module")
def counting_codec():
    if COUNTING_CODEC not in blosc2.ucodecs_registry:
        blosc2.register_codec("nnui_counting", COUNTING_CODEC, _encode, _decode)
    return COUNTING_CODEC


def _blocks_overlapping(shape, blocks, chunks, lower, size):
    """Blocks (within chunks) that intersect the in-bounds part of the box."""
    count = 1
    for n, b, c, lo, p in zip(shape, blocks, chunks, lower, size, strict=True):
        start, stop = max(lo, 0), min(lo + p, n)
        hits = 0
        for chunk_start in range(0, n, c):
            for block_start in range(chunk_start, min(chunk_start + c, n), b):
                block_stop = min(block_start + b, chunk_start + c, n)
                hits += block_start < stop and start < block_stop
        count *= hits
    return count


@pytest.mark.parametrize(
    ("patch", "lower"),
    [
        ((16, 32, 32), (0, 0, 0)),
        ((16, 32, 32), (5, 7, 30)),
        ((16, 32, 32), (-3, 20, -5)),
        ((32, 32), (4, -2, 10)),
        ((24, 48, 48), (9, 3, 11)),
    ],
)
def test_patch_read_decompresses_only_the_blocks_it_touches(counting_codec, patch, lower):
    shape = (1, 40, 70, 80)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 4, size=shape).astype(np.float32)  # compressible
    chunks, blocks = choose_layout(shape, patch, 4)
    array = blosc2.asarray(
        data,
        chunks=chunks,
        blocks=blocks,
        cparams={
            "codec": counting_codec,
            "nthreads": 1,
            "filters": [blosc2.Filter.NOFILTER],
            "filters_meta": [0],
            "splitmode": blosc2.SplitMode.NEVER_SPLIT,
        },
        dparams={"nthreads": 1},
    )
    size = (1, *patch) if len(patch) == 2 else patch
    _DECODED_BLOCKS[0] = 0
    out = read_padded(array, lower, size)
    decoded = _DECODED_BLOCKS[0]
    expected = _blocks_overlapping(shape[1:], blocks[1:], chunks[1:], lower, size)
    total = _blocks_overlapping(shape[1:], blocks[1:], chunks[1:], (0, 0, 0), shape[1:])
    assert decoded == expected < total
    # and the values are right, padding included
    padded = np.zeros((1, *[n + 2 * 64 for n in shape[1:]]), np.float32)
    padded[:, 64:-64, 64:-64, 64:-64] = data
    ref = padded[
        (slice(None), *[slice(lo + 64, lo + 64 + p) for lo, p in zip(lower, size, strict=True)])
    ]
    np.testing.assert_array_equal(out, ref)
    # a whole-array read (what a careless loader would do) decodes every block
    _DECODED_BLOCKS[0] = 0
    array[...]
    assert _DECODED_BLOCKS[0] == total


# ---- augmentation ----------------------------------------------------------------------

OFF = AugmentConfig(
    p_rotation=0,
    p_scale=0,
    p_mirror=0,
    p_noise=0,
    p_blur=0,
    p_brightness=0,
    p_contrast=0,
    p_low_res=0,
    p_gamma_inverted=0,
    p_gamma=0,
)


def _sample(ndim=3, b=3):
    gen = torch.Generator().manual_seed(0)
    shape = (b, 2, 8, 12, 10) if ndim == 3 else (b, 2, 12, 10)
    data = torch.randn(shape, generator=gen)
    seg = torch.randint(0, 3, (b, 1, *shape[2:]), generator=gen, dtype=torch.uint8)
    return data, seg


@pytest.mark.parametrize("ndim", [2, 3])
def test_augmentation_off_is_identity_and_mirroring_is_exact(ndim):
    data, seg = _sample(ndim)
    gen = torch.Generator().manual_seed(1)
    d, s = augment_batch(data, seg, gen, OFF)
    assert torch.equal(d, data) and torch.equal(s, seg)
    mirror = AugmentConfig(**{**OFF.__dict__, "p_mirror": 1.0})
    d, s = augment_batch(data, seg, gen, mirror)
    dims = tuple(range(2, 2 + ndim))
    assert torch.equal(d, data.flip(dims)) and torch.equal(s, seg.flip(dims))


@pytest.mark.parametrize("ndim", [2, 3])
def test_identity_spatial_transform_reproduces_input(ndim):
    data, seg = _sample(ndim)
    eye = torch.eye(ndim, dtype=torch.float64).repeat(data.shape[0], 1, 1)
    d, s = spatial_transform(data, seg, eye)
    torch.testing.assert_close(d, data, atol=1e-5, rtol=0)
    assert torch.equal(s, seg)


def test_full_augmentation_is_seeded_and_keeps_label_values():
    data, seg = _sample(3, b=8)
    strong = AugmentConfig(
        p_rotation=1, p_scale=1, p_noise=1, p_blur=1, p_brightness=1, p_contrast=1,
        p_low_res=1, p_gamma_inverted=1, p_gamma=1,
    )  # fmt: skip
    a = augment_batch(data, seg, torch.Generator().manual_seed(5), strong)
    b = augment_batch(data, seg, torch.Generator().manual_seed(5), strong)
    c = augment_batch(data, seg, torch.Generator().manual_seed(6), strong)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert set(a[1].unique().tolist()) <= {0, 1, 2} and a[1].dtype == torch.uint8
    assert torch.isfinite(a[0]).all() and a[0].shape == data.shape


ONLY = {k: 0.0 for k in OFF.__dict__ if k.startswith("p_")}


def _only(**on: float) -> AugmentConfig:
    return AugmentConfig(**{**OFF.__dict__, **ONLY, **on})


def test_blur_keeps_constants_and_smooths_noise():
    data, seg = _sample(3, b=2)
    blur = _only(p_blur=1, p_blur_per_channel=1)
    flat = torch.full_like(data, 3.0)
    d, _ = augment_batch(flat, seg, torch.Generator().manual_seed(0), blur)
    torch.testing.assert_close(d, flat)
    d, s = augment_batch(data, seg, torch.Generator().manual_seed(0), blur)
    assert torch.equal(s, seg)  # intensity transforms never touch labels
    assert d.std() < 0.8 * data.std()  # high frequencies damped
    torch.testing.assert_close(d.mean(), data.mean(), atol=0.05, rtol=0)


def test_low_resolution_loses_detail_but_keeps_smooth_images():
    data, seg = _sample(3, b=2)
    coarse = _only(p_low_res=1, p_low_res_per_channel=1)
    d, _ = augment_batch(data, seg, torch.Generator().manual_seed(0), coarse)
    assert d.shape == data.shape and not torch.allclose(d, data)
    ramp = torch.linspace(0, 1, 10).expand(2, 2, 8, 12, 10).contiguous()
    r, _ = augment_batch(ramp, seg, torch.Generator().manual_seed(0), coarse)
    assert (r - ramp).abs().max() < 0.2


def test_inverted_gamma_keeps_mean_and_std_and_differs_from_gamma():
    data, seg = _sample(3, b=2)
    inverted = _only(p_gamma_inverted=1)
    plain = _only(p_gamma=1)
    a, _ = augment_batch(data, seg, torch.Generator().manual_seed(3), inverted)
    b, _ = augment_batch(data, seg, torch.Generator().manual_seed(3), plain)
    dims = (2, 3, 4)
    torch.testing.assert_close(a.mean(dims), data.mean(dims), atol=1e-4, rtol=0)
    torch.testing.assert_close(a.std(dims), data.std(dims), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(a, b)


def test_noise_std_and_intensity_factors_are_drawn_as_nnunet_draws_them():
    """batchgeneratorsv2 (nnU-Net 2.8.1): the noise's std (not its variance) lies in
    noise_variance; brightness, contrast and gamma factors fall below 1 half the time
    (BGContrast), also for gamma's asymmetric (0.7, 1.5)."""
    data = torch.zeros(64, 1, 16, 16)
    seg = torch.zeros(64, 1, 16, 16, dtype=torch.uint8)
    d, _ = augment_batch(data, seg, torch.Generator().manual_seed(0), _only(p_noise=1))
    stds = d.flatten(1).std(1)
    assert stds.max() < 0.1 * 1.2 and stds.mean() > 0.03  # std uniform in (0, 0.1)
    draws = [augment_module._below_or_above_one(u / 1000, (0.7, 1.5)) for u in range(1000)]
    assert sum(g < 1 for g in draws) == 500 and min(draws) >= 0.7 and max(draws) < 1.5
    assert augment_module._below_or_above_one(0.3, (0.75, 1.25)) == pytest.approx(0.9)


def test_augmentation_does_not_depend_on_the_thread_count():
    """Loader threads augment with one intra-op thread, a num_workers=0 loader with the
    trainer's: a resumed run must see the same batches either way (sizes above torch's
    parallel grain)."""
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(3, 1, 24, 48, 48, generator=gen)
    seg = torch.randint(0, 3, (3, 1, 24, 48, 48), generator=gen, dtype=torch.uint8)
    strong = AugmentConfig(
        p_rotation=1, p_scale=1, p_noise=1, p_blur=1, p_brightness=1, p_contrast=1,
        p_low_res=1, p_gamma_inverted=1, p_gamma=1,
    )  # fmt: skip
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(augment_batch(data, seg, torch.Generator().manual_seed(9), strong))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_cpu_loader_threads_augment_on_one_thread_and_leave_the_trainer_its_own(
    demo_preprocessed,
):
    cases = PreprocessedCases(_folder(demo_preprocessed, "3d_fullres"))
    threads = torch.get_num_threads()
    seen = {}

    def probe(*args, **kwargs):
        seen["threads"] = torch.get_num_threads()
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as comm:
            seen["name"] = comm.read().strip()
        return augment_batch(*args, **kwargs)

    import trainer.data.loader as loader_module

    original = loader_module.augment_batch
    loader_module.augment_batch = probe
    try:
        _batches(cases, 0, 1, num_workers=1)
    finally:
        loader_module.augment_batch = original
    assert seen == {"threads": 1, "name": "nnui-loader"}
    assert torch.get_num_threads() == threads


def test_rotation_by_90_degrees_in_plane_matches_rot90():
    data, seg = _sample(3, b=1)
    data, seg = data[:, :, :, :10, :10], seg[:, :, :, :10, :10]  # square in-plane
    quarter = torch.tensor([[[1.0, 0, 0], [0, 0, -1.0], [0, 1.0, 0]]], dtype=torch.float64)
    d, _s = spatial_transform(data, seg, quarter)
    expected = [torch.rot90(data, k, dims=(3, 4)) for k in (1, -1)]
    assert any(torch.allclose(d, e, atol=1e-5) for e in expected)


@pytest.mark.parametrize(
    ("patch", "degrees", "expected"),
    [  # nnU-Net 2.8.1's get_patch_size for the same patch and rotation range
        ((32, 40), 180, (47, 47)),
        ((17, 50), 180, (58, 58)),
        ((16, 32, 32), 30, (35, 51, 42)),
        ((64, 48, 32), 30, (93, 67, 70)),
    ],
)
def test_read_size_is_nnunets_initial_patch_size(patch, degrees, expected):
    assert read_size(patch, AugmentConfig(rotation_deg=degrees)) == expected
    assert read_size(patch, OFF) == patch  # nothing rotates or scales: read the patch
    in_plane = read_size((8, 64, 64), AugmentConfig(rotation_deg=180, in_plane_only=True))
    assert in_plane[0] == 8 and in_plane[1:] == (75, 75)


def test_default_rotation_ranges_are_nnunets():
    assert default_augment_config((32, 40)).rotation_deg == 180
    assert default_augment_config((32, 64)).rotation_deg == 15
    assert default_augment_config((16, 32, 32)).rotation_deg == 30
    # dummy 2D by the patch's shape (tests/trainer/data/test_fidelity_augment.py: against nnU-Net)
    assert default_augment_config((8, 64, 64)).rotation_deg == 180


def test_rotation_cuts_the_patch_from_the_centre_of_the_read():
    gen = torch.Generator().manual_seed(0)
    data = torch.randn((1, 2, 48, 48), generator=gen)
    seg = torch.randint(0, 3, (1, 1, 48, 48), generator=gen, dtype=torch.uint8)
    quarter = torch.tensor([[[0.0, -1.0], [1.0, 0.0]]], dtype=torch.float64)
    d, s = spatial_transform(data, seg, quarter, (32, 40))
    # Output (y, x) samples the read at centre + M (offset): (43 - x, y + 8).
    rows, cols = 43 - torch.arange(40), torch.arange(32) + 8
    # float32 grid coordinates (of the input cut to the touched box): ~1e-5 off at most
    torch.testing.assert_close(
        d, data[:, :, rows][:, :, :, cols].transpose(2, 3), atol=3e-5, rtol=0
    )
    assert torch.equal(s, seg[:, :, rows][:, :, :, cols].transpose(2, 3))


def test_rotated_corners_hold_image_not_fill():
    ones = torch.ones((1, 1, 47, 47))
    seg = torch.ones((1, 1, 47, 47), dtype=torch.uint8)
    angle = math.radians(10)
    c, s_ = math.cos(angle), math.sin(angle)
    rot = torch.tensor([[[c, -s_], [s_, c]]], dtype=torch.float64)
    d, s = spatial_transform(ones, seg, rot, (32, 40))
    assert d.shape[2:] == (32, 40) and torch.allclose(d, torch.ones_like(d), atol=1e-5)
    assert bool((s == 1).all())
    # Rotating the network patch itself (no larger read) fills its corners.
    d_same, _ = spatial_transform(ones[:, :, :32, :40], seg[:, :, :32, :40], rot)
    assert float(d_same.min()) < 0.5


def test_labels_resample_by_indicator_with_background_outside():
    seg = torch.zeros((1, 1, 30, 30), dtype=torch.uint8)
    seg[0, 0, 3:27, 3:27] = 2
    seg[0, 0, 10:14, 12:20] = 5
    eye = torch.eye(2, dtype=torch.float64)[None]
    _, s = spatial_transform(torch.zeros((1, 1, 30, 30)), seg, eye, (20, 20))
    assert torch.equal(s, centre_crop(seg, (20, 20))) and torch.equal(s, seg[:, :, 5:25, 5:25])
    # Zoomed out 2x: the label keeps its pixel-edge boundary, the fill is background.
    full = torch.ones((1, 1, 20, 20), dtype=torch.uint8)
    _, z = spatial_transform(torch.zeros((1, 1, 20, 20)), full, 2 * eye)
    expected = torch.zeros_like(full)
    expected[0, 0, 5:15, 5:15] = 1
    assert torch.equal(z, expected)


def test_augment_batch_returns_the_centre_of_the_read():
    data, seg = _sample(2, b=3)  # (3, 2, 12, 10)
    d, s = augment_batch(data, seg, torch.Generator().manual_seed(0), OFF, patch_size=(8, 6))
    assert torch.equal(d, data[:, :, 2:10, 2:8]) and torch.equal(s, seg[:, :, 2:10, 2:8])
    strong = AugmentConfig(p_rotation=1, p_scale=1, p_noise=1, p_gamma=1)
    d, s = augment_batch(data, seg, torch.Generator().manual_seed(0), strong, patch_size=(8, 6))
    assert d.shape == (3, 2, 8, 6) and s.shape == (3, 1, 8, 6)


def test_augmented_stream_reads_the_larger_box(demo_preprocessed):
    cases = PreprocessedCases(_folder(demo_preprocessed, "3d_fullres"))
    (batch,) = _batches(cases, 0, 1, num_workers=0)
    assert batch.data.shape[2:] == (16, 32, 32) and batch.target.shape[2:] == (16, 32, 32)
    with PatchLoader(cases, cases.case_ids, (16, 32, 32), 2, 0.5, 3, 0, CPU, augment=True,
                     num_workers=0) as loader:  # fmt: skip
        assert loader.spec.read_size == read_size((16, 32, 32), loader.augment_config)
    with PatchLoader(cases, cases.case_ids, (16, 32, 32), 2, 0.5, 3, 0, CPU, augment=False,
                     num_workers=0) as loader:  # fmt: skip
        assert loader.spec.read_size is None


def test_batch_seed_depends_on_all_four_numbers():
    base = batch_seed(1, 0, "train", 5).generate_state(2)
    for other in [(2, 0, "train", 5), (1, 1, "train", 5), (1, 0, "val", 5), (1, 0, "train", 6)]:
        assert not np.array_equal(batch_seed(*other).generate_state(2), base)


@pytest.mark.parametrize("ndim", [2, 3])
def test_air_around_the_body_stays_zero_in_masked_channels(ndim):
    """nnU-Net sets the voxels outside the body of use_mask_for_norm channels back to 0
    after its intensity transforms; the network never sees painted air there."""
    data, seg = _sample(ndim, b=2)
    inside = torch.zeros(seg.shape, dtype=torch.bool)
    inside[(..., *[slice(2, -2)] * ndim)] = True
    data = data.masked_fill(~inside.expand_as(data), 0.0)  # what preprocessing writes
    seg = seg.masked_fill(~inside, 0)
    before = data.clone()
    painted = _only(p_noise=1, p_brightness=1, p_gamma=1, noise_variance=(0.5, 0.5))
    masked = AugmentConfig(**{**painted.__dict__, "mask_channels": (True, False)})
    free, _ = augment_batch(data, seg, torch.Generator().manual_seed(3), painted)
    kept, labels = augment_batch(data, seg, torch.Generator().manual_seed(3), masked)
    air = ~inside[:, 0]
    assert (free[:, 0][air] != 0).any()  # without the mask, noise reaches the air
    assert (kept[:, 0][air] == 0).all()  # masked channel: exactly zero outside
    assert (kept[:, 1][air] != 0).any()  # the other channel is not masked
    assert torch.equal(kept[:, 0][~air], free[:, 0][~air])  # inside: same draws, same values
    assert torch.equal(labels, seg) and torch.equal(data, before)  # inputs untouched
