"""`bench/predict.py --real --stages all`: whole cases, from their raw files to segmentations
on disk, nnui vs nnUNetv2_predict (2.8.1) with the same weights, plan, fold and settings.

    python bench/predict.py --real --stages all --case brats|drive|ct [--cases N]
        [--tta on off] [--repeats 2] [--precision auto fp32] [--threads N] [--npp 3 --nps 3]
        [--weights CHECKPOINT [--plans nnUNetPlans.json]]

Cases (each planned by nnU-Net's own plan_experiment on the dataset's fingerprint):
- brats: BraTS-sized four-channel MR cases (bench/real_data.py, 155x240x240 at 1 mm, zero
  outside the brain), nnU-Net's 3d_fullres plan;
- drive: the real DRIVE test images (../shared/data/Dataset701_DRIVE, 565x584, three
  channels), nnU-Net's 2d plan (its fingerprint extracted from the 20 training images);
- ct: the 512x512x300 CT-like case of predict_real, nnU-Net's 3d_fullres plan.
nnui's plans carry nnU-Net's spacing, patch and network (predict_real.write_nnui_plans).

Weights: one seeded random initialisation of the plan's network (a prediction's cost does
not depend on the values), written as nnui's `model.*` tensors and, under nnU-Net's names,
as nnU-Net's checkpoint_final.pth (nnunet_random_checkpoint.py): both sides run one model,
so their segmentations are compared voxel by voxel. Random weights give near-tied logits,
where float rounding decides labels; `--weights` takes a trained nnui checkpoint
(`checkpoint_final.safetensors` of a model with the case's plan, e.g. a DRIVE 2d fold) in
their place, so the labels compare as a user's would (work folder /tmp/nnui-pwhole-CASE-trained),
with `--plans` the nnUNetPlans.json it was trained on (a plan other than plan_experiment's, e.g.
bench/accuracy.py's cut 64x64 DRIVE network).

Sides, each run a fresh process tree (CPU-seconds of every process, peak RSS/PSS sums):
- nnU-Net: `nnUNetv2_predict -device cpu` (`--device cuda`: on the GPU) with its background
  processes (-npp, -nps);
- nnui: the engine nnui-predict runs once it has checked its checkpoints
  (trainer.inference.engine.predict_cases: reading ahead, sliding windows, export thread),
  at each `--precision` (auto: bf16 autocast on CPUs with AMX; fp32: as nnU-Net on CPU).
Runs alternate A B A B; the report goes to stdout and bench/history.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

DRIVE_RAW = REPO.parent / "shared" / "data" / "Dataset701_DRIVE"
FOLD = "0"
STEP_SIZE = 0.5
GOAL = 0.5  # nnui's wall and CPU time at most half of nnU-Net's


@dataclass(frozen=True)
class Case:
    kind: str
    dataset_id: int
    dataset: str
    configuration: str


CASES = {
    "brats": Case("brats", 953, "Dataset953_BratsLike", "3d_fullres"),
    "drive": Case("drive", 701, "Dataset701_DRIVE", "2d"),
    "ct": Case("ct", 952, "Dataset952_CTLike", "3d_fullres"),
}


@dataclass
class WholeRun:
    side: str
    tta: bool
    repeat: int
    exit_code: int
    cases: int
    wall_s: float
    cpu_s: float
    peak_rss_bytes: int
    peak_pss_bytes: int


# ---- set-up (cached in the work folder) ---------------------------------------------------


def _fingerprint_mr(shape: tuple[int, ...], num_cases: int) -> dict:
    """nnU-Net's fingerprint keys for a BraTS-like cohort cropped to the brain."""
    props = {"max": 2000.0, "mean": 450.0, "median": 440.0, "min": 1.0,
             "percentile_00_5": 100.0, "percentile_99_5": 1100.0, "std": 150.0}  # fmt: skip
    return {
        "spacings": [[1.0, 1.0, 1.0]] * num_cases,
        "shapes_after_crop": [list(shape)] * num_cases,
        "foreground_intensity_properties_per_channel": {str(c): props for c in range(4)},
        "median_relative_size_after_cropping": 0.6,
    }


def _write_inputs(case: Case, raw: Path, count: int) -> tuple[dict, dict | None]:
    """The input folder `raw/<dataset>/imagesTs` of `count` cases; (dataset.json, the
    fingerprint to plan on, None: nnUNetv2_extract_fingerprint on imagesTr)."""
    from trainer.data.image_io import write_nifti

    folder = raw / case.dataset
    images = folder / "imagesTs"
    images.mkdir(parents=True, exist_ok=True)
    if case.kind == "drive":
        if not DRIVE_RAW.is_dir():
            raise RuntimeError(f"{DRIVE_RAW} is missing (the shared DRIVE dataset)")
        for sub in ("imagesTr", "labelsTr"):
            if not (folder / sub).exists():
                (folder / sub).symlink_to(DRIVE_RAW / sub)
        ids = sorted(
            {p.name[: -len("_0000.nii.gz")] for p in DRIVE_RAW.glob("imagesTs/*_0000.nii.gz")}
        )
        for case_id in ids[:count]:
            for channel in range(3):
                name = f"{case_id}_{channel:04d}.nii.gz"
                if not (images / name).exists():
                    (images / name).symlink_to(DRIVE_RAW / "imagesTs" / name)
        return json.loads((DRIVE_RAW / "dataset.json").read_text()), None
    if case.kind == "brats":
        from real_data import MR_LABELS, mr_like_case

        shape = None
        for i in range(count):
            image, _, spacing = mr_like_case(1, i)
            nonzero = [ax for ax in (image[0] > 0).nonzero()]
            shape = tuple(int(a.max() - a.min() + 1) for a in nonzero)
            for c in range(4):
                path = images / f"mr_{i:03d}_{c:04d}.nii.gz"
                if not path.is_file():
                    write_nifti(path, image[c], spacing)
        meta = {"channel_names": {"0": "FLAIR", "1": "T1", "2": "T1c", "3": "T2"},
                "labels": MR_LABELS, "numTraining": 400, "file_ending": ".nii.gz"}  # fmt: skip
        return meta, _fingerprint_mr(shape or (140, 180, 150), 400)
    from predict_real import CASE, ct_fingerprint, dataset_json
    from real_data import CT_SHAPE, ct_like_case

    path = images / f"{CASE}_0000.nii.gz"
    if not path.is_file():
        hu, spacing = ct_like_case(0, CT_SHAPE)
        write_nifti(path, hu, spacing)
    return dataset_json(), ct_fingerprint()


def _run(argv: list[str], env: dict, what: str) -> None:
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed: {(done.stderr or done.stdout).strip()[-400:]}")


def setup(
    case: Case, work: Path, count: int, trained: Path | None = None, plans: Path | None = None
) -> dict:
    """Inputs, nnU-Net's plans and model folder, nnui's plans and weights (cached).
    `trained`: an nnui checkpoint to use instead of random weights; `plans`: the nnUNetPlans.json
    it was trained on, instead of nnU-Net's plan_experiment on the case's fingerprint."""
    from predict_real import write_nnui_plans

    stamp = work / "weights.json"  # which model this folder's plans and checkpoint hold
    identity = {"source": str(trained.resolve()) if trained else "random",
             "plans": str(plans.resolve()) if plans else "plan_experiment"}  # fmt: skip
    if stamp.is_file() and json.loads(stamp.read_text()) != identity:
        raise RuntimeError(f"{work} holds a model of other weights or plans: give another --work")

    raw, pre, results = work / "raw", work / "nnunet_pre", work / "nnunet_results"
    env = dict(os.environ, nnUNet_raw=str(raw), nnUNet_preprocessed=str(pre),
               nnUNet_results=str(results))  # fmt: skip
    meta, fingerprint = _write_inputs(case, raw, count)
    (raw / case.dataset / "dataset.json").write_text(json.dumps(meta, indent=1))
    tools = Path(sys.executable).parent
    plans_path = pre / case.dataset / "nnUNetPlans.json"
    if not plans_path.is_file():
        (pre / case.dataset).mkdir(parents=True, exist_ok=True)
        if fingerprint is None:
            _run([str(tools / "nnUNetv2_extract_fingerprint"), "-d", str(case.dataset_id),
                  "-np", "2"], env, "nnUNetv2_extract_fingerprint")  # fmt: skip
        else:
            fp = pre / case.dataset / "dataset_fingerprint.json"
            fp.write_text(json.dumps(fingerprint))
            example = raw / case.dataset / "imagesTr"  # the planner picks its reader from one
            example.mkdir(exist_ok=True)
            first = sorted((raw / case.dataset / "imagesTs").iterdir())[0]
            if not (example / first.name).exists():
                (example / first.name).symlink_to(first)
        if plans:
            shutil.copyfile(plans, plans_path)
        else:
            _run([str(tools / "nnUNetv2_plan_experiment"), "-d", str(case.dataset_id)], env,
                 "nnUNetv2_plan_experiment")  # fmt: skip
    shutil.copyfile(raw / case.dataset / "dataset.json", pre / case.dataset / "dataset.json")
    nnunet_plans = json.loads(plans_path.read_text())
    fingerprint = json.loads((pre / case.dataset / "dataset_fingerprint.json").read_text())
    nnui_plans = work / "nnui_pre" / case.dataset / "nnuiPlans.json"
    if not nnui_plans.is_file():
        write_nnui_plans(nnunet_plans, nnui_plans, fingerprint, meta, case.dataset,
                         case.configuration)  # fmt: skip
    weights = trained.resolve() if trained else work / "weights.safetensors"
    if not weights.is_file():
        _random_weights(nnui_plans.parent, case.configuration, weights)
    model = results / case.dataset / f"nnUNetTrainer__nnUNetPlans__{case.configuration}"
    if not (model / f"fold_{FOLD}" / "checkpoint_final.pth").is_file():
        _run([sys.executable, str(BENCH_DIR / "nnunet_random_checkpoint.py"), case.dataset,
              case.configuration, FOLD, str(weights)], env, "nnU-Net's checkpoint")  # fmt: skip
        stamp.write_text(json.dumps(identity))
    inputs = work / f"inputs_n{count}"  # the first `count` cases of imagesTs
    if not inputs.is_dir():
        inputs.mkdir()
        images = sorted((raw / case.dataset / "imagesTs").iterdir())
        ids = sorted({p.name.rsplit("_", 1)[0] for p in images})[:count]
        for path in images:
            if path.name.rsplit("_", 1)[0] in ids:
                (inputs / path.name).symlink_to(path.resolve())
    return {"env": env, "inputs": str(inputs),
            "nnui_plans": str(nnui_plans.parent), "weights": str(weights)}  # fmt: skip


def _random_weights(plans_dir: Path, configuration: str, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from trainer.network.build import build_network
    from trainer.planning.plans import load_plans

    plans = load_plans(plans_dir)
    cplan = plans.configuration(configuration)
    torch.manual_seed(0)
    net = build_network(cplan.network, plans.num_input_channels, plans.num_classes, cplan.ndim,
                        deep_supervision=False, recompute_norm=False)  # fmt: skip
    save_file({f"model.{k}": v.contiguous() for k, v in net.state_dict().items()}, str(out))


# ---- one side's run (a fresh process) -----------------------------------------------------


def nnui_main(argv: list[str]) -> int:
    """Child: nnui's engine over the input folder, as nnui-predict runs it."""
    inputs, out, plans_dir, configuration, weights, precision, tta, threads, device_name = argv
    import torch
    from safetensors.torch import load_file

    from trainer.inference.cases import list_input_cases
    from trainer.inference.engine import PredictSettings, build_models, predict_cases
    from trainer.planning.plans import load_plans

    torch.set_num_threads(int(threads))
    device = torch.device(device_name)
    plans = load_plans(Path(plans_dir))
    cplan = plans.configuration(configuration)
    models = build_models(plans, cplan, [load_file(weights)], device)
    cases = list_input_cases(Path(inputs), plans.num_input_channels)
    settings = PredictSettings(Path(out), STEP_SIZE, tta == "on", precision=precision)
    Path(out).mkdir(parents=True, exist_ok=True)
    done = predict_cases(cases, plans, cplan, models, device, settings, print)
    return 0 if done == len(cases) else 1


def side_argv(side: str, case: Case, paths: dict, a, tta: bool, out: Path) -> list[str]:
    if side == "nnU-Net":
        # fmt: off
        argv = [str(Path(sys.executable).parent / "nnUNetv2_predict"), "-i", paths["inputs"],
                "-o", str(out), "-d", str(case.dataset_id), "-c", case.configuration,
                "-f", FOLD, "-tr", "nnUNetTrainer", "-p", "nnUNetPlans", "-device", a.device,
                "-step_size", str(STEP_SIZE), "-npp", str(a.npp), "-nps", str(a.nps),
                "--disable_progress_bar"]
        # fmt: on
        return argv if tta else [*argv, "--disable_tta"]
    precision = side.removeprefix("nnui").strip() or "auto"
    return [sys.executable, str(Path(__file__)), "--nnui", paths["inputs"], str(out),
            paths["nnui_plans"], case.configuration, paths["weights"], precision,
            "on" if tta else "off", str(a.threads), a.device]  # fmt: skip


def measure(side: str, case: Case, paths: dict, a, tta: bool, repeat: int) -> WholeRun:
    from _common import run_tree

    out = _out(a, side, tta, repeat)
    shutil.rmtree(out, ignore_errors=True)
    env = dict(paths["env"], PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(a.threads),
               MKL_NUM_THREADS=str(a.threads))  # fmt: skip
    argv = side_argv(side, case, paths, a, tta, out)
    tree, _ = run_tree(argv, a.work / "logs" / f"{out.name}.log", env=env, cwd=REPO)
    written = len(list(out.glob("*.nii.gz"))) if out.is_dir() else 0
    return WholeRun(side, tta, repeat, tree.exit_code or int(written != a.cases), written,
                    tree.wall_s, tree.cpu_s, tree.peak_rss_bytes, tree.peak_pss_bytes)  # fmt: skip


def labels_equal(a_dir: Path, b_dir: Path) -> float:
    """The share of voxels where two folders' segmentations agree."""
    import nibabel as nib
    import numpy as np

    same = total = 0
    for path in sorted(a_dir.glob("*.nii.gz")):
        x = np.asarray(nib.load(str(path)).dataobj)
        y = np.asarray(nib.load(str(b_dir / path.name)).dataobj)
        same, total = same + int((x == y).sum()), total + x.size
    return same / total if total else float("nan")


def foreground_share(folder: Path) -> float:
    import nibabel as nib
    import numpy as np

    fg = total = 0
    for path in sorted(folder.glob("*.nii.gz")):
        x = np.asarray(nib.load(str(path)).dataobj)
        fg, total = fg + int((x > 0).sum()), total + x.size
    return fg / total if total else float("nan")


# ---- the benchmark (parent) ---------------------------------------------------------------


def _out(a, side: str, tta: bool, repeat: int = 0) -> Path:
    tag = side.replace(" ", "_").replace("-", "").lower()
    return a.work / "out" / f"{tag}_{'tta' if tta else 'notta'}_{repeat}"


def report(a, case: Case, runs: list[WholeRun], info: dict) -> list[str]:
    from _common import GIB, median_or_nan, ratio

    sides = [f"nnui{'' if p == 'auto' else ' ' + p}" for p in a.precision]
    figures = (("wall s", lambda r: r.wall_s), ("CPU-s", lambda r: r.cpu_s),
               ("peak RSS GiB", lambda r: r.peak_rss_bytes / GIB),
               ("peak PSS GiB", lambda r: r.peak_pss_bytes / GIB))  # fmt: skip
    lines = [f"whole cases, {case.kind}: {info}"]
    for tta in a.tta:
        lines.append(f" mirroring {'on' if tta else 'off'}:")

        def med(side: str, figure, tta: bool = tta) -> float:
            ok = [r for r in runs if r.side == side and r.tta == tta and r.exit_code == 0]
            return median_or_nan([figure(r) for r in ok])

        base = {label: med("nnU-Net", f) for label, f in figures}
        for side in sides:
            mine = {label: med(side, f) for label, f in figures}
            ratios = {label: ratio(mine[label], base[label]) for label in mine}
            parts = [f"{k} {mine[k]:.2f} vs {base[k]:.2f} ({ratios[k]:.2f}x)" for k in mine]
            met = "met" if max(ratios["wall s"], ratios["CPU-s"]) <= GOAL else "missed"
            agree = labels_equal(_out(a, "nnU-Net", tta), _out(a, side, tta))
            lines.append(f"  {side} vs nnU-Net: {'; '.join(parts)}")
            lines.append(f"    goal <= {GOAL}x wall and CPU: {met}; labels equal "
                         f"{100 * agree:.3f} % of voxels")  # fmt: skip
        fg = foreground_share(_out(a, "nnU-Net", tta))
        lines.append(f"  (nnU-Net's segmentations: {100 * fg:.1f} % foreground voxels)")
    return lines


def whole_main(argv: list[str]) -> int:
    from _common import machine_line

    p = argparse.ArgumentParser(prog="bench/predict.py --real --stages all")
    p.add_argument("--case", choices=sorted(CASES), required=True)
    p.add_argument("--work", type=Path, default=None, help="default /tmp/nnui-pwhole-CASE")
    p.add_argument("--cases", type=int, default=None, help="cases per run (brats 2, drive 4, ct 1)")
    p.add_argument("--tta", nargs="+", default=["off", "on"], choices=("on", "off"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--precision", nargs="+", default=["auto"], choices=("auto", "fp32", "bf16"))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--npp", type=int, default=3, help="nnU-Net's preprocessing processes")
    p.add_argument("--nps", type=int, default=3, help="nnU-Net's export processes")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument(
        "--weights",
        type=Path,
        default=None,
        help="a trained nnui checkpoint of the case's plan (default: random)",
    )
    p.add_argument("--plans", type=Path, default=None,
                   help="the nnUNetPlans.json the --weights were trained on")  # fmt: skip
    p.add_argument("--stages", nargs="+", default=["all"])  # what predict.py --real passed on
    a = p.parse_args(argv)
    case = CASES[a.case]
    a.cases = a.cases or {"brats": 2, "drive": 4, "ct": 1}[case.kind]
    default_work = f"/tmp/nnui-pwhole-{case.kind}{'-trained' if a.weights else ''}"
    a.work = (a.work or Path(default_work)).absolute()
    a.tta = [t == "on" for t in dict.fromkeys(a.tta)]
    if a.cases < 1 or a.repeats < 1 or a.threads < 1:
        print("error: need --cases, --repeats and --threads >= 1", file=sys.stderr)
        return 2
    for flag, path in (("--weights", a.weights), ("--plans", a.plans)):
        if path and not path.is_file():
            print(f"error: {flag} {path}: no such file", file=sys.stderr)
            return 2
    (a.work / "logs").mkdir(parents=True, exist_ok=True)
    machine = machine_line()
    print(machine, flush=True)
    try:
        paths = setup(case, a.work, a.cases, a.weights, a.plans)
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sides = ["nnU-Net", *[f"nnui{'' if p == 'auto' else ' ' + p}" for p in a.precision]]
    runs = []
    for tta in a.tta:
        for repeat in range(a.repeats):  # A B A B: the machine's drift hits every side
            for side in sides:
                r = measure(side, case, paths, a, tta, repeat)
                print(f"  {json.dumps(asdict(r))}", flush=True)
                runs.append(r)
    plans = json.loads((a.work / "nnunet_pre" / case.dataset / "nnUNetPlans.json").read_text())
    conf = plans["configurations"][case.configuration]
    info = {"patch": conf["patch_size"], "spacing": conf["spacing"], "cases": a.cases,
            "threads": a.threads, "npp/nps": [a.npp, a.nps]}  # fmt: skip
    lines = report(a, case, runs, info)
    print("\n".join(lines))
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = f"python bench/predict.py --real {' '.join(argv)}"
    raw = [json.dumps(asdict(r)) for r in runs]
    text = [f"\n## predict whole cases {stamp}\n", f"- machine: {machine}",
            f"- command: `{command}`", "", "```", *lines, "```", "", "raw runs:", "", "```",
            *raw, "```", ""]  # fmt: skip
    with open(BENCH_DIR / "history.md", "a") as handle:
        handle.write("\n".join(text))
    return 0 if all(r.exit_code == 0 for r in runs) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--nnui"]:
        raise SystemExit(nnui_main(sys.argv[2:]))
    raise SystemExit(whole_main(sys.argv[1:]))
