"""nnui's default planner equals nnU-Net 2.8.1's ExperimentPlanner, field for field.

Four generated raw datasets of different geometry (isotropic MR with two channels, CT with
5 mm slices along the last array axis so the transpose is not the identity, a 3-channel 2D
photo set, and a CT large enough for 3d_lowres) are planned by nnU-Net 2.8.1 (its own
fingerprint extractor and `plan_experiments`, run once in a subprocess with nnUNet_raw and
nnUNet_preprocessed in tmp) and by nnui (its own fingerprint and planner). The large CT
plans from a stored fingerprint (planning needs nothing else), so its arrays stay small.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.data.raw import open_raw_dataset
from trainer.planning.fingerprint import fingerprint_dataset
from trainer.planning.plans import ConfigurationPlan, Plans
from trainer.planning.presets import make_plans
from trainer.planning.resenc import PRESETS, plan_preset
from trainer.planning.rules import CASCADE, DEFAULT_NET, REFERENCE_BATCH, PlannerOptions
from trainer.planning.topology import feature_map_voxels

pytest.importorskip("nnunetv2", reason="make setup installs nnunetv2 (extra 'nnunet')")

# id -> (name, channel names, labels, cases: list of (shape zyx, spacing zyx), body fraction)
DATASETS = {
    961: ("IsoMR", {"0": "T1", "1": "T2"}, 3,
          [((40, 48, 44), (1.0, 1.0, 1.0)), ((44, 52, 48), (1.0, 1.0, 1.0)),
           ((42, 50, 46), (1.0, 1.0, 1.0)), ((38, 46, 50), (1.0, 1.0, 1.0))], 0.6),
    962: ("AnisoCT", {"0": "CT"}, 2,
          [((64, 72, 14), (0.8, 0.8, 5.0)), ((68, 64, 12), (0.75, 0.75, 5.0)),
           ((72, 68, 16), (0.8, 0.8, 4.0)), ((60, 70, 13), (0.7, 0.7, 5.0))], 1.0),
    963: ("Photo2D", {"0": "R", "1": "G", "2": "B"}, 2,
          [((1, 60, 64), (1.0, 1.0, 1.0)), ((1, 64, 70), (1.0, 1.0, 1.0)),
           ((1, 66, 62), (1.0, 1.0, 1.0)), ((1, 58, 68), (1.0, 1.0, 1.0))], 1.0),
    964: ("LargeCT", {"0": "CT"}, 3,
          [((8, 8, 8), (1.0, 0.7, 0.7))] * 4, 1.0),
}  # fmt: skip
# The large CT's fingerprint: whole-body scans nnU-Net plans a 3d_lowres for.
LARGE_CT_SHAPES = [[200, 320, 320], [180, 320, 300], [220, 300, 320], [200, 320, 320]]
LARGE_CT_SPACINGS = [[1.0, 0.7, 0.7], [1.25, 0.75, 0.75], [1.0, 0.8, 0.8], [1.0, 0.7, 0.7]]
# (dataset, nnU-Net planner, plans name, extra nnU-Net kwargs) beside each default plan
VARIANTS = [
    (961, "ExperimentPlanner", "nnUNetPlansGpu4", {"gpu_memory_target_in_gb": 4.0}),
    (962, "ExperimentPlanner", "nnUNetPlansSpacing", {"overwrite_target_spacing": [1.0, 1.0, 3.0]}),
    (962, "nnUNetPlannerResEncM", "nnUNetResEncUNetMPlans", {}),
    (964, "nnUNetPlannerResEncM", "nnUNetResEncUNetMPlans", {}),
]  # fmt: skip

NNUNET_SCRIPT = r"""
import json, multiprocessing, sys
# nnU-Net's fingerprint pool spawns workers that import torch again (~30 s on a busy
# machine); forked workers run the same analyze_case at once.
_context = multiprocessing.get_context
multiprocessing.get_context = lambda method=None: _context("fork")
from nnunetv2.experiment_planning.dataset_fingerprint import fingerprint_extractor
# Its intensity statistics sample 10^8 voxels (minutes here); the planner never reads them.
_init = fingerprint_extractor.DatasetFingerprintExtractor.__init__
def _few_samples(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.num_foreground_voxels_for_intensitystats = 10_000
fingerprint_extractor.DatasetFingerprintExtractor.__init__ = _few_samples
from nnunetv2.experiment_planning.plan_and_preprocess_api import (
    extract_fingerprints, plan_experiments)
from nnunetv2.experiment_planning.experiment_planners.default_experiment_planner import (
    ExperimentPlanner)
jobs = json.loads(sys.argv[1])
extract_fingerprints(jobs["extract"], num_processes=1, show_progress_bar=False, verbose=False)
out = {}
for dataset, planner, plans_name, kwargs in jobs["plans"]:
    plan_experiments([dataset], planner, overwrite_plans_name=plans_name, **kwargs)
    path = f"{jobs['pre']}/{jobs['names'][str(dataset)]}/{plans_name}.json"
    plans = json.load(open(path))
    estimates = {}
    for name, c in plans["configurations"].items():
        if "architecture" not in c:
            continue
        a = c["architecture"]
        estimates[name] = int(ExperimentPlanner.static_estimate_VRAM_usage(
            c["patch_size"], len(plans["foreground_intensity_properties_per_channel"]),
            jobs["classes"][str(dataset)], a["network_class_name"], a["arch_kwargs"],
            a["_kw_requires_import"]))
    out[f"{dataset}/{plans_name}"] = {"plans": plans, "estimates": estimates}
print("RESULT" + json.dumps(out))
"""


def make_raw_dataset(root: Path, dataset_id: int) -> str:
    """A raw dataset in nnU-Net's layout: a body (the nonzero region) and labelled blobs."""
    from trainer.data.image_io import write_nifti

    name, channels, num_labels, cases, body = DATASETS[dataset_id]
    folder = root / f"Dataset{dataset_id}_{name}"
    (folder / "imagesTr").mkdir(parents=True)
    (folder / "labelsTr").mkdir()
    rng = np.random.default_rng(dataset_id)
    for i, (shape, spacing) in enumerate(cases):
        grid = np.meshgrid(*[np.linspace(-1, 1, n) for n in shape], indexing="ij")
        radius = np.sqrt(sum(g**2 for g in grid[1:] if g.size)) if shape[0] == 1 else None
        radius = radius if radius is not None else np.sqrt(sum(g**2 for g in grid))
        inside = radius <= (body if body < 1 else 10.0)
        seg = np.zeros(shape, np.uint8)
        for label in range(1, num_labels):
            seg[inside & (np.abs(radius - 0.15 * label) < 0.08)] = label
        for c in range(len(channels)):
            image = (rng.normal(100 + 20 * c, 10, shape) + 50 * seg) * inside
            write_nifti(folder / "imagesTr" / f"case{i:02d}_{c:04d}.nii.gz",
                        image.astype(np.float32), spacing)  # fmt: skip
        write_nifti(folder / "labelsTr" / f"case{i:02d}.nii.gz", seg, spacing)
    labels = {"background": 0, **{f"c{v}": v for v in range(1, num_labels)}}
    dataset_json = {"channel_names": channels, "labels": labels, "numTraining": len(cases),
                    "file_ending": ".nii.gz", "name": name}  # fmt: skip
    (folder / "dataset.json").write_text(json.dumps(dataset_json))
    return folder.name


def large_ct_fingerprint() -> dict:
    props = {"mean": 50.0, "median": 45.0, "std": 80.0, "min": -1000.0, "max": 2000.0,
             "percentile_00_5": -900.0, "percentile_99_5": 1500.0}  # fmt: skip
    return {
        "spacings": LARGE_CT_SPACINGS,
        "shapes_after_crop": LARGE_CT_SHAPES,
        "median_relative_size_after_cropping": 0.9,
        "foreground_intensity_properties_per_channel": {"0": props},
    }


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict:
    """nnU-Net's plans (and its memory estimate per configuration) of every dataset and
    variant, and the raw root; one subprocess (nnunetv2 reads its paths on import)."""
    base = tmp_path_factory.mktemp("planner_vs_nnunet")
    raw, pre = base / "raw", base / "pre"
    names = {str(d): make_raw_dataset(raw, d) for d in DATASETS}
    (pre / names["964"]).mkdir(parents=True)
    fingerprint = {**large_ct_fingerprint(), "shapes_before_crop": LARGE_CT_SHAPES}
    (pre / names["964"] / "dataset_fingerprint.json").write_text(json.dumps(fingerprint))
    jobs = {
        "extract": [961, 962, 963],
        "plans": [[d, "ExperimentPlanner", "nnUNetPlans", {}] for d in DATASETS] + VARIANTS,
        "pre": str(pre), "names": names,
        "classes": {str(d): spec[2] for d, spec in DATASETS.items()},
    }  # fmt: skip
    env = {**os.environ, "nnUNet_raw": str(raw), "nnUNet_preprocessed": str(pre),
           "nnUNet_results": str(base / "res"), "nnUNet_compile": "f"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", NNUNET_SCRIPT, json.dumps(jobs)], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT", 1)[1])
    return {"raw": raw, "pre": pre, "names": names, "nnunet": result}


def nnui_plans(planned: dict, dataset_id: int, options: PlannerOptions) -> Plans:
    name = planned["names"][str(dataset_id)]
    raw = open_raw_dataset(planned["raw"] / name)
    if dataset_id == 964:
        fingerprint = large_ct_fingerprint()
    else:
        fingerprint = fingerprint_dataset(raw, 1, lambda _: None, per_case=False)
    if options.planner in PRESETS:
        run = (fingerprint, raw.dataset_json, name, options.planner, None, None, options)
        return plan_preset(*run)
    return make_plans(options, fingerprint, raw.dataset_json, name, None, None)


def _close(a, b) -> bool:
    return len(a) == len(b) and bool(np.allclose(np.asarray(a, float), np.asarray(b, float),
                                                 rtol=1e-9, atol=1e-9))  # fmt: skip


def config_differences(
    theirs: dict, ours: ConfigurationPlan, estimate: int, num_classes: int, gb: float
) -> list[str]:
    """Every item-1 field of one configuration that differs, by name (`estimate`: nnU-Net's
    feature-map voxels of its plan; `gb`: the memory target it was planned for)."""
    arch = theirs["architecture"]["arch_kwargs"]
    ndim = len(theirs["patch_size"])
    net = ours.network
    blocks = arch.get("n_conv_per_stage", arch.get("n_blocks_per_stage"))
    pairs = {
        # the whole field: a 2d entry holds nnU-Net's two in-plane values, not three
        "spacing": (theirs["spacing"], ours.spacing),
        "median_image_size_in_voxels": (theirs["median_image_size_in_voxels"],
                                        ours.median_image_size),
        "patch_size": (theirs["patch_size"], ours.patch_size),
        "batch_size": ([theirs["batch_size"]], [ours.batch_size]),
        "strides": (arch["strides"], net.strides),
        "kernel_sizes": (arch["kernel_sizes"], net.kernel_sizes),
        "features_per_stage": (arch["features_per_stage"], net.features_per_stage),
        "n_stages": ([arch["n_stages"]], [net.num_stages]),
        "n_conv_per_stage": (blocks, net.n_conv_per_stage_encoder),
        "n_conv_per_stage_decoder": (arch["n_conv_per_stage_decoder"],
                                     net.n_conv_per_stage_decoder),
        "memory estimate (feature-map voxels)": (
            [estimate], [feature_map_voxels(net, ours.patch_size, num_classes)]),
    }  # fmt: skip
    out = [f for f, (a, b) in pairs.items() if not _close(np.ravel(a), np.ravel(b))]
    # nnU-Net's rule: `reference` feature-map voxels per REFERENCE_BATCH patches fill 8 GB
    # (the default planner's references; the presets scale theirs to the same 8 GB basis).
    reference = DEFAULT_NET.reference_2d if ndim == 2 else DEFAULT_NET.reference_3d
    expected_gb = estimate * theirs["batch_size"] / REFERENCE_BATCH[ndim] / reference * 8
    if ours.network.architecture == DEFAULT_NET.architecture and (
        ours.gpu_memory_gb is None or abs(ours.gpu_memory_gb - expected_gb) > 1e-3
    ):
        out.append("gpu_memory_estimate_gb")
    exact = {
        "normalization_schemes": (theirs["normalization_schemes"],
                                  list(ours.normalization_schemes)),
        "use_mask_for_norm": (theirs["use_mask_for_norm"], list(ours.use_mask_for_norm)),
        "batch_dice": (theirs["batch_dice"], ours.batch_dice),
        "next_stage": (_stages(theirs.get("next_stage")), ours.next_stage),
        "architecture": (theirs["architecture"]["network_class_name"].rsplit(".", 1)[1],
                         net.architecture),
        "data_identifier": (theirs["data_identifier"].replace("nnUNet", "nnui"),
                            ours.data_identifier),
    }  # fmt: skip
    for key in [k for k in theirs if k.startswith("resampling_fn_")]:
        exact[key] = (theirs[key], (ours.resampling or {}).get(key))
    return out + [f for f, (a, b) in exact.items() if a != b]


# Every field of nnU-Net's configuration block is compared above, or is one nnui's code has
# fixed to nnU-Net's value (its preprocessor; the U-Net's operators, checked here).
COMPARED = {"spacing", "median_image_size_in_voxels", "patch_size", "batch_size", "architecture",
            "normalization_schemes", "use_mask_for_norm", "batch_dice", "next_stage",
            "data_identifier"}  # fmt: skip
FIXED = {"preprocessor_name": "DefaultPreprocessor"}
FIXED_ARCH = {
    "conv_op": "torch.nn.modules.conv.Conv{n}d", "conv_bias": True,
    "norm_op": "torch.nn.modules.instancenorm.InstanceNorm{n}d",
    "norm_op_kwargs": {"eps": 1e-05, "affine": True}, "dropout_op": None,
    "dropout_op_kwargs": None, "nonlin": "torch.nn.LeakyReLU",
    "nonlin_kwargs": {"inplace": True},
}  # fmt: skip
ARCH_COMPARED = {"n_stages", "features_per_stage", "kernel_sizes", "strides", "n_conv_per_stage",
                 "n_blocks_per_stage", "n_conv_per_stage_decoder"}  # fmt: skip


def unchecked_fields(block: dict) -> list[str]:
    """Fields of nnU-Net's block neither compared nor equal to nnui's fixed values."""
    known = COMPARED | set(FIXED)
    out = [k for k in block if k not in known and not k.startswith("resampling_fn_")]
    out += [k for k, v in FIXED.items() if block.get(k) != v]
    arch = block["architecture"]["arch_kwargs"]
    n = len(block["patch_size"])
    fixed = {k: v.format(n=n) if isinstance(v, str) else v for k, v in FIXED_ARCH.items()}
    out += [f"arch {k}" for k in arch if k not in ARCH_COMPARED | set(fixed)]
    out += [f"arch {k}" for k, v in fixed.items() if arch.get(k) != v]
    return out


def plans_differences(theirs: dict, estimates: dict, ours: Plans, gb: float = 8.0) -> list[str]:
    out = []
    expected = set(theirs["configurations"])
    have = {*ours.configurations, *ours.cascades}
    if have != expected:
        out.append(f"configurations {sorted(have)} != nnU-Net's {sorted(expected)}")
    for key in ("transpose_forward", "transpose_backward"):
        if list(getattr(ours, key) or (0, 1, 2)) != theirs[key]:
            out.append(key)
    for key in ("original_median_spacing_after_transp", "original_median_shape_after_transp"):
        if not _close(list(getattr(ours, key) or ()), theirs[key]):
            out.append(f"{key}: nnU-Net {theirs[key]}, nnui {getattr(ours, key)}")
    for name, block in theirs["configurations"].items():
        if name == CASCADE:
            if ours.cascades.get(name) != block:
                out.append(f"{name}: entry")
            continue
        if name not in ours.configurations:
            continue
        fields = config_differences(block, ours.configurations[name], estimates[name],
                                    ours.num_classes, gb)  # fmt: skip
        out += [f"{name}: {f}" for f in fields + unchecked_fields(block)]
    return out


@pytest.mark.parametrize("dataset_id", sorted(DATASETS))
def test_default_plans_equal_nnunets(planned, dataset_id):
    result = planned["nnunet"][f"{dataset_id}/nnUNetPlans"]
    ours = nnui_plans(planned, dataset_id, PlannerOptions())
    assert plans_differences(result["plans"], result["estimates"], ours) == []
    assert ours.plans_name == "nnuiPlans"


def test_the_geometries_cover_what_the_issue_names(planned):
    """2D data: no 3d_fullres; the thick last axis moves first; the large CT has 3d_lowres
    and the cascade entry, with batch Dice on its 3d_fullres."""
    plans = {d: planned["nnunet"][f"{d}/nnUNetPlans"]["plans"] for d in DATASETS}
    assert set(plans[963]["configurations"]) == {"2d"}
    assert plans[962]["transpose_forward"] == [2, 0, 1]
    assert set(plans[964]["configurations"]) == {"2d", "3d_fullres", "3d_lowres", CASCADE}
    assert plans[964]["configurations"]["3d_fullres"]["batch_dice"] is True
    assert plans[961]["configurations"]["3d_fullres"]["use_mask_for_norm"] == [True, True]


@pytest.mark.parametrize(("dataset_id", "planner", "plans_name", "kwargs"), VARIANTS)
def test_flags_and_presets_equal_nnunets(planned, dataset_id, planner, plans_name, kwargs):
    """-gpu_memory_target, -overwrite_target_spacing, -overwrite_plans_name and the
    residual-encoder presets (with the transpose and 3d_lowres) plan what nnU-Net plans."""
    result = planned["nnunet"][f"{dataset_id}/{plans_name}"]
    spacing = kwargs.get("overwrite_target_spacing")
    options = PlannerOptions(
        planner,
        plans_name.replace("nnUNet", "nnui"),
        kwargs.get("gpu_memory_target_in_gb"),
        tuple(spacing) if spacing else None,
    )
    ours = nnui_plans(planned, dataset_id, options)
    gb = kwargs.get("gpu_memory_target_in_gb", 8.0)
    assert plans_differences(result["plans"], result["estimates"], ours, gb) == []


# ---- the transpose through preprocessing and back; nnui-preprocess's flags ---------------

TRANSPOSED = ("Transposed", {"0": "CT"}, 2, [((40, 36, 8), (0.8, 0.8, 5.0))] * 3, 1.0)


@pytest.fixture(scope="module")
def transposed_raw(tmp_path_factory) -> Path:
    """CT whose thick axis is the last array axis, at one spacing (nothing is resampled)."""
    root = tmp_path_factory.mktemp("transposed_raw")
    DATASETS[965] = TRANSPOSED
    try:
        make_raw_dataset(root, 965)
    finally:
        del DATASETS[965]
    return root


def _preprocess(raw: Path, pre: Path, *flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "trainer.planning.preprocess", "965", "--raw", str(raw),
            "--preprocessed", str(pre), "-np", "1", *flags]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    return subprocess.run(argv, env=env, capture_output=True, text=True)


def test_data_is_stored_transposed_and_predictions_come_back_in_raw_geometry(
    transposed_raw, tmp_path
):
    from trainer.data.blosc_io import open_array
    from trainer.data.image_io import read_image
    from trainer.inference.cases import InputCase
    from trainer.inference.export import raw_shape, to_raw_geometry
    from trainer.inference.prepare import prepare_case
    from trainer.planning.plans import load_plans

    done = _preprocess(transposed_raw, tmp_path, "-c", "3d_fullres")
    assert done.returncode == 0, done.stderr
    dataset = tmp_path / "Dataset965_Transposed"
    plans = load_plans(dataset)
    assert plans.transpose == ((2, 0, 1), (1, 2, 0))
    config = plans.configuration("3d_fullres")
    assert config.spacing == pytest.approx((5.0, 0.8, 0.8))
    folder = transposed_raw / "Dataset965_Transposed"
    label, _ = read_image(folder / "labelsTr" / "case00.nii.gz")
    stored = open_array(dataset / config.data_identifier / "case00_seg.b2nd")[:][0]
    assert stored.shape == (8, 40, 36)
    assert np.array_equal(stored, label.transpose(2, 0, 1))
    properties = json.loads((dataset / config.data_identifier / "case00.json").read_text())
    assert raw_shape(properties) == [40, 36, 8]
    one_hot = np.stack([stored == v for v in (0, 1)]).astype(np.float32)
    back = to_raw_geometry(one_hot, properties, [0, 1], keep_probabilities=True)
    assert np.array_equal(back.segmentation, label)
    assert back.probabilities.shape == (2, 40, 36, 8)
    # A case read at prediction time is prepared in the same (transposed) order.
    image_files = (folder / "imagesTr" / "case00_0000.nii.gz",)
    prepared = prepare_case(InputCase("case00", image_files, ".nii.gz"), plans, config)
    assert prepared.properties["transpose_forward"] == [2, 0, 1]
    stored_image = open_array(dataset / config.data_identifier / "case00.b2nd")[:]
    assert np.allclose(prepared.data, stored_image, atol=1e-5)


def test_cpu_planner_and_plans_name_flags_write_their_own_files(transposed_raw, tmp_path):
    done = _preprocess(transposed_raw, tmp_path, "-pl", "nnuiCPUPlanner")
    assert done.returncode == 0, done.stderr
    dataset = tmp_path / "Dataset965_Transposed"
    cpu = json.loads((dataset / "nnuiCPUPlans.json").read_text())
    assert cpu["plans_name"] == "nnuiCPUPlans" and "transpose_forward" not in cpu
    assert set(cpu["configurations"]) == {"2d", "3d_fullres"}
    assert any((dataset / "nnuiCPUPlans_3d_fullres").glob("*.b2nd"))
    assert not (dataset / "nnuiPlans.json").exists()
    flags = ("-overwrite_plans_name", "nnuiBigPlans", "-gpu_memory_target", "24",
             "-overwrite_target_spacing", "1", "1.5", "4")  # fmt: skip
    done = _preprocess(transposed_raw, tmp_path, *flags)
    assert done.returncode == 0, done.stderr
    big = json.loads((dataset / "nnuiBigPlans.json").read_text())
    assert big["plans_name"] == "nnuiBigPlans"
    assert big["configurations"]["3d_fullres"]["spacing"] == [4.0, 1.0, 1.5]  # transposed
    assert big["configurations"]["3d_fullres"]["data_identifier"] == "nnuiBigPlans_3d_fullres"


def test_a_plan_that_cannot_fit_the_memory_target_is_one_line_and_changes_nothing(
    transposed_raw, tmp_path
):
    assert _preprocess(transposed_raw, tmp_path, "-c", "2d").returncode == 0
    dataset = tmp_path / "Dataset965_Transposed"
    before = {p: p.read_bytes() for p in dataset.rglob("*") if p.is_file()}
    done = _preprocess(transposed_raw, tmp_path, "-gpu_memory_target", "0.0000001")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no ")
    assert "-gpu_memory_target 1e-07 GB" in lines[0]
    after = {p: p.read_bytes() for p in dataset.rglob("*") if p.is_file()}
    assert after == before


def test_gpu_sized_plans_on_a_cpu_print_the_expected_time_per_epoch(
    transposed_raw, tmp_path, capsys
):
    from trainer.planning.cpu import cpu_epoch_note
    from trainer.planning.plans import load_plans
    from trainer.run import resolve_config
    from trainer.training.train_args import build_parser

    flags = ("-c", "3d_fullres", "--patch-size", "8", "64", "64", "--batch-size", "16")
    assert _preprocess(transposed_raw, tmp_path / "pre", *flags).returncode == 0
    cplan = load_plans(tmp_path / "pre" / "Dataset965_Transposed").configuration("3d_fullres")
    note = cpu_epoch_note(cplan, 2, 250, 4)
    assert note.startswith("note: 3d_fullres (patch [8, 64, 64], batch 16) is sized for a GPU")
    assert "epoch of 250 iterations takes about" in note
    small = cpu_epoch_note(replace_batch(cplan, 2), 2, 250, 4)
    assert small is None  # CPU-sized: nothing to say
    argv = ["965", "3d_fullres", "0", "-device", "cpu", "--preprocessed", str(tmp_path / "pre"),
            "--raw", str(transposed_raw), "--results", str(tmp_path / "res")]  # fmt: skip
    resolve_config(build_parser().parse_args(argv), argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if "sized for a GPU" in line]
    assert len(lines) == 1 and "nnui-preprocess -pl nnuiCPUPlanner" in lines[0]


def replace_batch(cplan: ConfigurationPlan, batch: int) -> ConfigurationPlan:
    from dataclasses import replace

    return replace(cplan, batch_size=batch)


def test_3d_lowres_is_preprocessed_and_the_cascade_entry_kept(transposed_raw, tmp_path):
    """A small memory target makes this small CT 'large': 3d_lowres data at its coarser
    spacing, the cascade entry in the plans file as nnU-Net writes it, and trainable
    (resolved from 3d_fullres, with 3d_lowres as its previous stage: trainer.data.cascade)."""
    from trainer.planning.plans import load_plans

    done = _preprocess(transposed_raw, tmp_path, "-gpu_memory_target", "0.003")
    assert done.returncode == 0, done.stderr
    dataset = tmp_path / "Dataset965_Transposed"
    raw = json.loads((dataset / "nnuiPlans.json").read_text())
    assert raw["configurations"][CASCADE] == {
        "inherits_from": "3d_fullres", "previous_stage": "3d_lowres"
    }  # fmt: skip
    plans = load_plans(dataset)
    assert set(plans.configurations) == {"2d", "3d_fullres", "3d_lowres", CASCADE}
    cascade = plans.configuration(CASCADE)
    assert cascade.previous_stage == "3d_lowres"
    assert cascade.data_identifier == plans.configuration("3d_fullres").data_identifier
    lowres = plans.configuration("3d_lowres")
    assert lowres.next_stage == (CASCADE,) and plans.configuration("3d_fullres").batch_dice
    properties = json.loads((dataset / lowres.data_identifier / "case00.json").read_text())
    assert properties["spacing_after_resampling"] == pytest.approx(lowres.spacing)
    expected = [round(n * s / t) for n, s, t in zip([8, 40, 36], [5.0, 0.8, 0.8],
                                                    lowres.spacing, strict=True)]  # fmt: skip
    assert properties["shape_after_resampling"] == expected


def test_asking_for_a_configuration_the_planner_does_not_make_is_one_line(tmp_path):
    make_raw_dataset(tmp_path / "raw", 963)  # 2D photos: no 3d configuration
    argv = [sys.executable, "-m", "trainer.planning.preprocess", "963", "-c", "3d_fullres", "--raw",
            str(tmp_path / "raw"), "--preprocessed", str(tmp_path / "pre"), "-np", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: nnU-Net's planner makes no 3d_fullres for Dataset963_Photo2D (it makes: 2d; "
        "no 3d for 2D data, a 3d_lowres only for large images)"
    ]
    assert not (tmp_path / "pre" / "Dataset963_Photo2D" / "nnuiPlans.json").exists()


def test_training_on_transposed_data_validates_in_the_raw_geometry(transposed_raw, tmp_path):
    """nnui-train's final validation writes each prediction in the raw image's axis order,
    shape and spacing (the stored data is transposed)."""
    from trainer.data.image_io import read_image

    flags = ("-c", "3d_fullres", "--patch-size", "8", "32", "32", "--batch-size", "2")
    assert _preprocess(transposed_raw, tmp_path / "pre", *flags).returncode == 0
    argv = [sys.executable, "-m", "trainer", "965", "3d_fullres", "0", "-device", "cpu",
            "--epochs", "1", "--iterations-per-epoch", "1", "--val-iterations", "1",
            "--raw", str(transposed_raw), "--preprocessed", str(tmp_path / "pre"),
            "--results", str(tmp_path / "res")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    fold = tmp_path / "res" / "Dataset965_Transposed" / "nnuiTrainer__nnuiPlans__3d_fullres"
    predictions = sorted((fold / "fold_0" / "validation").glob("*.nii.gz"))
    assert predictions
    for path in predictions:
        label = transposed_raw / "Dataset965_Transposed" / "labelsTr" / path.name
        seg, spacing = read_image(path)
        raw, raw_spacing = read_image(label)
        assert seg.shape == raw.shape == (40, 36, 8)
        assert spacing == pytest.approx(raw_spacing)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("-gpu_memory_target", "0"), "error: -gpu_memory_target 0: must be > 0 (GB)"),
        (("-pl", "nnuiCPUPlanner", "-overwrite_target_spacing", "1", "0", "1"),
         "error: -overwrite_target_spacing 1 0 1: three spacings > 0 (z y x, mm)"),
    ],
)  # fmt: skip
def test_unusable_planner_flags_are_one_line(transposed_raw, tmp_path, flags, message):
    done = _preprocess(transposed_raw, tmp_path, *flags)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [message]
    assert not (tmp_path / "Dataset965_Transposed").exists()


def test_a_preset_writes_its_3d_lowres_on_data_of_its_own(transposed_raw, tmp_path):
    """-pl nnUNetPlannerResEncM: 2d/3d_fullres on the default plans' data, its 3d_lowres
    (and the cascade entry) as nnU-Net's preset plans file has them, on its own data."""
    flags = ("-pl", "nnUNetPlannerResEncM", "-gpu_memory_target", "0.003")
    done = _preprocess(transposed_raw, tmp_path, *flags)
    assert done.returncode == 0, done.stderr
    dataset = tmp_path / "Dataset965_Transposed"
    preset = json.loads((dataset / "nnuiResEncUNetMPlans.json").read_text())
    configs = preset["configurations"]
    assert set(configs) == {"2d", "3d_fullres", "3d_lowres", CASCADE}
    assert configs["3d_fullres"]["data_identifier"] == "nnuiPlans_3d_fullres"
    assert configs["3d_lowres"]["data_identifier"] == "nnuiResEncUNetMPlans_3d_lowres"
    assert len(list((dataset / "nnuiResEncUNetMPlans_3d_lowres").glob("*_seg.b2nd"))) == 3
    assert preset["transpose_forward"] == [2, 0, 1]


def _stages(value) -> tuple[str, ...]:
    """nnU-Net writes one next stage as a name (nnui's plans hold a tuple of names)."""
    if not value:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)
