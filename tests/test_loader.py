"""Patch sampling, determinism, chunk-local reads, batched augmentation, worker hygiene."""

from __future__ import annotations

import json
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
from trainer.data.augment import AugmentConfig, augment_batch, spatial_transform
from trainer.data.blosc_io import choose_layout, read_padded
from trainer.data.dataset import MissingCaseError, PreprocessedCases
from trainer.data.loader import PatchLoader
from trainer.data.patches import BatchSpec, load_patches
from trainer.data.raw import DataError
from trainer.data.sampling import batch_seed, forced_slots, plan_batch
from trainer.plans import load_plans

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


def test_plan_batch_boxes_stay_within_padding_rules(demo_preprocessed):
    cases = PreprocessedCases(_folder(demo_preprocessed, "3d_fullres"))
    rng = np.random.default_rng(0)
    for _ in range(50):
        for box in plan_batch(rng, cases.case_ids, 4, 0.5, (16, 32, 32), cases.properties):
            shape = cases.properties(box.case_id)["shape_after_resampling"]
            for lo, n, p in zip(box.lower, shape, box.size, strict=True):
                assert min(0, n - p) <= lo <= max(0, n - p)


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
