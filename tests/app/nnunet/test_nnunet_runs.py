"""Watch-only nnU-Net runs: the text-log parser (a real nnU-Net 2.8.1 log), incremental
reading, EMA and ETA, discovery from a fake process table, the views, and `nnui status` /
`nnui stop` with a stand-in process and (slow) with a real stock `nnUNetv2_train`."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_trainer import wait_until

from app.services.jobs.registry import Registry
from app.services.jobs.views import JobTracker, watch_only_view
from app.services.machine.gpus import GpuProcess, GpuSnapshot, MachineSnapshot
from app.services.machine.procs import ProcRow, process_start_ticks, read_sigcgt_usr1
from app.services.nnunet.log import (
    DEFAULT_NUM_EPOCHS,
    DebugCache,
    TrainingLog,
    eta_s,
    median_epoch_s,
    merge_history,
    parse_dice_list,
    read_schedule,
    sorted_logs,
)
from app.services.nnunet.runs import (
    live_log,
    parse_train_argv,
    restart_command,
    stop_refusal,
    train_processes,
    watch_only_runs,
)
from trainer.schema.nnunet import NNUNET_EXT_DIR

ROOT = Path(__file__).resolve().parents[3]
DATA = Path(__file__).resolve().parents[2] / "data" / "nnunet_fold_0"
FAKE_NNUNET = Path(__file__).resolve().parents[2] / "fake_nnunet" / "nnUNetv2_train"
FIRST_LOG = "training_log_2026_12_1_15_53_55.txt"
SECOND_LOG = "training_log_2026_12_1_15_54_47.txt"
PYTHON = "/usr/bin/python3"
TRAIN = ("/venv/bin/nnUNetv2_train",)


# ---- the parser on a real nnU-Net log ---------------------------------------------------


def test_real_log_gives_every_epoch_value() -> None:
    log = TrainingLog(DATA / FIRST_LOG)
    assert log.poll()
    assert sorted(log.epochs) == [0, 1]
    first = log.epochs[0]
    assert (first.lr, first.train_loss, first.val_loss) == (0.01, 1.3503, 1.2323)
    assert first.dice_per_class == (0.169, 0.0074)
    assert first.epoch_time_s == 9.75
    assert first.best_ema == pytest.approx(0.0882, abs=1e-6)
    assert log.epochs[1].lr == 0.00772
    assert log.phase == "training" and log.num_unparsed == 0


def test_continued_run_merges_its_logs_and_the_ema_is_nnunets() -> None:
    logs = [TrainingLog(p) for p in sorted_logs(DATA)]
    assert [p.path.name for p in logs] == [FIRST_LOG, SECOND_LOG]
    for log in logs:
        log.poll()
    stats = merge_history(logs)
    assert [s.epoch for s in stats] == [0, 1, 2, 3]
    # nnU-Net's printed "New best EMA" values (every epoch was a new best here)
    assert [round(s.ema_fg_dice, 4) for s in stats] == [0.0882, 0.0958, 0.1078, 0.1246]
    assert stats[1].mean_fg_dice == pytest.approx((0.3243 + 0.0044) / 2)
    assert stats[1].period_s is None  # the restart between epoch 1 and 2 is no epoch time
    assert stats[0].period_s == pytest.approx(13.179, abs=1e-3)  # start to next start
    assert logs[-1].phase == "done" and logs[-1].final_dice == pytest.approx(0.35666537)


def _line(message: str, t: str = "2026-12-01 10:00:00.000001") -> str:
    return f"{t}: {message} \n"  # nnU-Net ends every argument with a space


def _epoch_lines(epoch: int, dice: str, start: str, best: float | None = None) -> str:
    text = _line("", start) + _line(f"Epoch {epoch}", start)
    text += _line("Current learning rate: 0.00991") + _line("train_loss -0.5")
    text += _line("val_loss nan") + _line(f"Pseudo dice {dice}") + _line("Epoch time: 10.0 s")
    if best is not None:
        text += _line(f"Yayy! New best EMA pseudo Dice: {best}")
    return text


def test_ema_without_new_best_lines_follows_nnunets_formula(tmp_path: Path) -> None:
    path = tmp_path / "training_log_2026_12_1_10_00_00.txt"
    path.write_text(
        _epoch_lines(0, "[0.5, 0.3]", "2026-12-01 10:00:00.000000")
        + _epoch_lines(1, "[0.1, nan]", "2026-12-01 10:00:12.000000")  # numpy < 2, nan class
        + _epoch_lines(2, "[np.float32(nan), np.float32(nan)]", "2026-12-01 10:00:25.0")
    )
    log = TrainingLog(path)
    log.poll()
    stats = merge_history([log])
    assert stats[0].ema_fg_dice == pytest.approx(0.4)
    assert stats[1].mean_fg_dice == pytest.approx(0.1)  # nanmean, as nnU-Net
    assert stats[1].ema_fg_dice == pytest.approx(0.9 * 0.4 + 0.1 * 0.1)
    assert math.isnan(stats[2].mean_fg_dice) and math.isnan(stats[2].ema_fg_dice)
    assert math.isnan(stats[0].val_loss) and stats[0].train_loss == -0.5
    assert [s.period_s for s in stats] == [12.0, 13.0, None]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[np.float32(0.169), np.float32(0.0074)]", (0.169, 0.0074)),
        ("[np.float64(0.5)]", (0.5,)),
        ("[0.25, 0.75]", (0.25, 0.75)),
        ("[]", ()),
        ("[0.2, oops]", None),
        ("0.2", None),
    ],
)
def test_dice_list_formats(text: str, expected: tuple | None) -> None:
    assert parse_dice_list(text) == expected


def test_incremental_reading_waits_for_the_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "training_log_2026_12_1_10_00_00.txt"
    whole = _epoch_lines(0, "[0.5, 0.3]", "2026-12-01 10:00:00.000000")
    cut = whole.index("Epoch time: 10") + len("Epoch time: 1")
    path.write_text(whole[:cut])  # nnU-Net writes a line in several write() calls
    log = TrainingLog(path)
    log.poll()
    assert log.epochs[0].val_loss is not None and log.epochs[0].epoch_time_s is None
    assert merge_history([log]) == []  # an epoch is finished by its "Epoch time" line
    offset = log.offset
    with path.open("a") as handle:
        handle.write(whole[cut:])
    assert log.poll()
    assert log.epochs[0].epoch_time_s == 10.0
    assert log.offset == offset + len(whole[cut:].encode())  # only the appended bytes
    assert not log.poll()  # nothing new


def test_a_log_replaced_by_a_shorter_one_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "training_log_2026_12_1_10_00_00.txt"
    path.write_text(_epoch_lines(0, "[0.5]", "2026-12-01 10:00:00.0") * 1)
    log = TrainingLog(path)
    log.poll()
    path.write_text(_line("Epoch 7"))
    log.poll()
    assert log.reset and list(log.epochs) == [7]


# ---- schedule and ETA -------------------------------------------------------------------


def test_num_epochs_from_debug_json_only_for_its_own_log(tmp_path: Path) -> None:
    shutil.copytree(DATA, tmp_path / "fold_0")
    fold = tmp_path / "fold_0"
    own = read_schedule(fold, fold / SECOND_LOG, "nnUNetTrainer", DebugCache())
    assert (own.num_epochs, own.source, own.iterations_per_epoch) == (4, "debug.json", 2)
    other = read_schedule(fold, fold / FIRST_LOG, "nnUNetTrainer", DebugCache())
    assert (other.num_epochs, other.source) == (DEFAULT_NUM_EPOCHS, "default")
    named = read_schedule(fold, fold / FIRST_LOG, "nnUNetTrainer_250epochs", DebugCache())
    assert (named.num_epochs, named.source) == (250, "trainer name")
    (fold / "debug.json").write_text("{not json")
    broken = read_schedule(fold, fold / SECOND_LOG, "nnUNetTrainer", DebugCache())
    assert broken.source == "default"


def test_eta_is_the_remaining_epochs_times_the_median_epoch(tmp_path: Path) -> None:
    path = tmp_path / "training_log_2026_12_1_10_00_00.txt"
    starts = ["10:00:00", "10:00:10", "10:00:20", "10:01:20", "10:01:30"]  # one slow epoch
    path.write_text(
        "".join(_epoch_lines(e, "[0.5]", f"2026-12-01 {t}.0") for e, t in enumerate(starts))
    )
    log = TrainingLog(path)
    log.poll()
    stats = merge_history([log])
    assert median_epoch_s(stats) == 10.0  # periods 10, 10, 60, 10 and the last epoch's 10.0
    assert eta_s(stats, 1000) == pytest.approx((1000 - 5) * 10.0)
    assert eta_s(stats, 5) == 0
    assert eta_s([], 1000) is None


# ---- argv and discovery with a fake process table ----------------------------------------


@pytest.mark.parametrize(
    ("cmdline", "expected"),
    [
        ((PYTHON, *TRAIN, "900", "2d", "0"), ("900", "2d", "0", "nnUNetTrainer", "nnUNetPlans")),
        (
            ("python3.11", "-u", "-m", "nnunetv2.run.run_training", "Dataset004_Hippo",
             "3d_fullres", "all", "-tr=nnUNetTrainerNoMirroring", "-p", "nnUNetResEncUNetLPlans"),
            ("Dataset004_Hippo", "3d_fullres", "all", "nnUNetTrainerNoMirroring",
             "nnUNetResEncUNetLPlans"),
        ),
        (
            (PYTHON, "/x/nnunetv2/run/run_training.py", "4", "2d", "1", "--c"),
            ("4", "2d", "1", "nnUNetTrainer", "nnUNetPlans"),
        ),
        (("nnUNetv2_train", "4", "2d", "1"), ("4", "2d", "1", "nnUNetTrainer", "nnUNetPlans")),
        (("srun", "nnUNetv2_train", "4", "2d", "0"), None),  # its child is the training
        (("bash", "-c", "nnUNetv2_train 4 2d 0"), None),
        ((PYTHON, *TRAIN, "4", "2d"), None),  # no fold
        ((PYTHON, *TRAIN, "4", "2d", "0", "-tr"), None),
        ((PYTHON, "/x/run_training.py", "4", "2d", "0"), None),  # not nnU-Net's
        ((PYTHON, "-m", "trainer.nnunet_engine", "4", "2d", "0"), None),
    ],
)  # fmt: skip
def test_train_argv(cmdline: tuple[str, ...], expected: tuple | None) -> None:
    args = parse_train_argv(cmdline)
    got = None if args is None else (args.dataset, args.configuration, args.fold, args.trainer,
                                     args.plans)  # fmt: skip
    assert got == expected


_BOOT_WALL_S = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def _ticks(wall_s: float) -> int:
    return int((wall_s - _BOOT_WALL_S) * os.sysconf("SC_CLK_TCK"))


def _fold(results: Path, folder: str = "nnUNetTrainer__nnUNetPlans__2d", fold: str = "0",
          dataset: str = "Dataset900_NnuiDemo", mtime: float | None = None) -> Path:  # fmt: skip
    path = results / dataset / folder / f"fold_{fold}"
    path.mkdir(parents=True)
    for name in (FIRST_LOG, SECOND_LOG):
        shutil.copy(DATA / name, path / name)
    if mtime is not None:
        os.utime(path / SECOND_LOG, (mtime, mtime))
    return path


def _row(
    pid: int,
    args: tuple[str, ...],
    started: float,
    uid: int | None = None,
    environ: dict | None = None,
    ppid: int = 1,
    handler: bool | None = False,
) -> ProcRow:
    return ProcRow(pid=pid, ppid=ppid, uid=os.getuid() if uid is None else uid,
                   start_ticks=_ticks(started), cmdline=(PYTHON, *TRAIN, *args),
                   environ=environ, sigcgt_usr1=handler)  # fmt: skip


def test_a_region_runs_dice_is_named_by_its_regions(tmp_path: Path) -> None:
    """The dataset.json nnU-Net copies beside its folds names the per-class pseudo Dice:
    regions by name in nnU-Net's order (the board's curves and `nnui status` show them)."""
    results = tmp_path / "results"
    fold = _fold(results)
    labels = {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing": 3}
    (fold.parent / "dataset.json").write_text(json.dumps({"labels": labels}))
    rows = [_row(100, ("900", "2d", "0"), time.time() - 60,
                 environ={"nnUNet_results": str(results)})]  # fmt: skip
    (run,) = watch_only_runs([results], procs=rows)
    assert run.class_names == ("whole tumor", "tumor core", "enhancing")
    assert watch_only_view(run).class_names == run.class_names
    (fold.parent / "dataset.json").write_text("{not json")
    (run,) = watch_only_runs([results], procs=rows)
    assert run.class_names == ()


def test_discovery_matches_processes_to_their_fold_folders(tmp_path: Path) -> None:
    results, elsewhere = tmp_path / "results", tmp_path / "other"
    now = time.time()
    mine = _fold(results, fold="0")
    colleague = _fold(results, fold="1")
    _fold(results, fold="2", mtime=now - 3600)  # its log stopped before the process began
    nnui_job = _fold(results, fold="3")
    res_enc = _fold(results, folder="nnUNetTrainer__nnUNetResEncUNetLPlans__3d_fullres")
    env = {"nnUNet_results": str(results), "CUDA_VISIBLE_DEVICES": "2,3"}
    rows = [
        _row(100, ("900", "2d", "0"), now - 60, environ=env),
        _row(101, ("900", "2d", "0"), now - 59, environ=env, ppid=100),  # its DA worker
        _row(200, ("900", "2d", "1", "-device", "cuda"), now - 60, uid=12345),  # unreadable
        _row(300, ("900", "2d", "2"), now - 60, environ=env),
        _row(400, ("900", "2d", "3"), now - 60, environ={**env, "NNUI_JOB_ID": "j1"}),
        _row(500, ("900", "2d", "0"), now - 60, environ={"nnUNet_results": str(elsewhere)}),
        _row(600, ("Dataset900_NnuiDemo", "3d_fullres", "0", "-p", "nnUNetResEncUNetLPlans"),
             now - 60, environ={**env, "CUDA_VISIBLE_DEVICES": "1"}),
        ProcRow(700, 1, os.getuid(), _ticks(now), ("srun", "nnUNetv2_train", "900", "2d", "0")),
    ]  # fmt: skip
    runs = {r.pid: r for r in watch_only_runs([results], procs=rows)}
    assert sorted(runs) == [100, 200, 600]
    assert runs[100].fold_dir == str(mine) and runs[200].fold_dir == str(colleague)
    assert runs[600].fold_dir == str(res_enc) and runs[600].gpus == ("1",)
    assert runs[100].pids == (100, 101)
    assert runs[100].gpus == ("2",) and runs[100].gpu_source == "CUDA_VISIBLE_DEVICES"
    assert runs[200].gpus == () and not runs[200].environ_readable
    assert runs[100].run_id == "nnunet:100" and runs[100].watch_only
    run = runs[100]
    assert (run.epoch, run.current_epoch, run.phase) == (4, 3, "done")
    assert run.log_path == str(mine / SECOND_LOG) and run.dataset == "Dataset900_NnuiDemo"
    assert run.dice_per_class == (0.5416, 0.0099) and run.train_loss == 0.8992
    assert run.ema_fg_dice == pytest.approx(0.1246, abs=1e-6)
    assert run.num_epochs == DEFAULT_NUM_EPOCHS and run.eta_s is not None
    # nnui's own active job folders are left out too (its events say more than the log)
    again = watch_only_runs([results], procs=rows, exclude_dirs=[str(colleague)])
    assert sorted(r.pid for r in again) == [100, 600]
    assert str(nnui_job) not in {r.fold_dir for r in again}


def test_the_newer_of_two_processes_gets_a_shared_fold_folder(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _fold(results)
    now = time.time()
    env = {"nnUNet_results": str(results)}
    rows = [_row(10, ("900", "2d", "0"), now - 90, environ=env),
            _row(11, ("900", "2d", "0", "--c"), now - 30, environ=env)]  # fmt: skip
    assert [r.pid for r in watch_only_runs([results], procs=rows)] == [11]


def test_log_not_written_since_the_start_is_not_live(tmp_path: Path) -> None:
    fold = _fold(tmp_path, mtime=time.time() - 100)
    assert live_log(fold, time.time() - 50) is None
    assert live_log(fold, time.time() - 200) == fold / SECOND_LOG
    assert live_log(tmp_path, time.time()) is None  # no logs


def test_gpu_from_nvml_process_lists(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _fold(results)
    rows = [_row(100, ("900", "2d", "0"), time.time() - 60, uid=12345),
            _row(101, ("900", "2d", "0"), time.time() - 60, uid=12345, ppid=100)]  # fmt: skip
    gpu = GpuSnapshot(5, "H100", "GPU-1", None, None, None, None, None,
                      (GpuProcess(101, "bob", 1 << 30, "python", False),))  # fmt: skip
    snapshot = MachineSnapshot((gpu,), simulated=False, driver_problem=None, taken_at=0.0)
    (run,) = watch_only_runs([results], procs=rows, snapshot=snapshot)
    assert (run.gpus, run.gpu_source) == (("5",), "nvml")


def test_train_processes_fold_forked_workers_into_their_parent() -> None:
    now = time.time()
    rows = [_row(10, ("4", "2d", "0"), now), _row(11, ("4", "2d", "0"), now, ppid=10),
            _row(12, ("4", "2d", "1"), now, ppid=10)]  # fmt: skip
    found = {p.row.pid: p.pids for p in train_processes(rows)}
    assert found == {10: (10, 11, 12), 12: (12,)}  # a different argv below it is its own run


# ---- views and stop refusal --------------------------------------------------------------


def test_tracker_gives_watch_only_job_views(tmp_path: Path) -> None:
    results = tmp_path / "results"
    fold = _fold(results)
    rows = [_row(100, ("900", "2d", "0"), time.time() - 60,
                 environ={"nnUNet_results": str(results)})]  # fmt: skip
    tracker = JobTracker(Registry(tmp_path / "state"))
    tracker.refresh()
    (view,) = tracker.refresh_watch_only([results], procs=rows)
    assert view.watch_only and view.watch is not None and view.job.job_id == "nnunet:100"
    assert view.state == "running" and view.epoch == 4 and view.num_epochs == 1000
    assert [p.epoch for p in view.history] == [0, 1, 2, 3]
    assert view.job.run_dir == str(fold) and view.job.console_path == str(fold / SECOND_LOG)
    assert view.console_tail[-1].rstrip().endswith("Mean Validation Dice:  0.35666537208159843")
    assert tracker.views == []  # the registry's jobs stay apart


def test_stop_refusal_says_why_and_how_to_restart(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _fold(results, folder="nnUNetTrainerNoMirroring__nnUNetResEncUNetLPlans__3d_fullres")
    rows = [_row(100, ("900", "3d_fullres", "0", "-tr", "nnUNetTrainerNoMirroring", "-p",
                       "nnUNetResEncUNetLPlans", "-num_gpus", "2"), time.time() - 60)]  # fmt: skip
    (run,) = watch_only_runs([results], procs=rows)
    refusal = stop_refusal(run, sigcgt_mask=0x4002)  # SIGINT and SIGTERM caught, not USR1
    assert "no SIGUSR1 handler (SigCgt 0000000000004002 in /proc/100/status lacks bit 0x200)" in (
        refusal.reason
    )
    assert restart_command(run) == (
        f"nnUNet_extTrainer={NNUNET_EXT_DIR} nnUNetv2_train 900 3d_fullres 0 -tr "
        "nnUNetTrainerNoMirroring_nnui -p nnUNetResEncUNetLPlans -num_gpus 2 --c"
    )
    assert any(restart_command(run) in hint for hint in refusal.hints)
    assert any("--engine nnunet" in hint for hint in refusal.hints)
    caught = stop_refusal(run, sigcgt_mask=0x200)
    assert "never signals it" in caught.reason and "kill -USR1 100" in caught.hints[0]


# ---- the CLI with a stand-in nnUNetv2_train (fast) ---------------------------------------


def _nnui(env: dict, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.main", *args], env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _end(pids: list[int], expected_cmdline: list[str]) -> None:
    """SIGTERM, then SIGKILL, to the pids still running with the cmdline we started."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    cmdline = [a.decode() for a in handle.read().split(b"\0") if a]
            except OSError:
                continue
            if cmdline == expected_cmdline:
                os.kill(pid, sig)
        if wait_until(lambda: all(not _running(p) for p in pids), timeout_s=15):
            return


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.parametrize("handler", [False, True])
def test_status_lists_and_stop_refuses_a_hand_started_run(tmp_path: Path, handler: bool) -> None:
    ready = tmp_path / "ready"
    env = {**os.environ, "NNUI_STATE_DIR": str(tmp_path / "state"),
           "nnUNet_results": str(tmp_path / "results"), "FAKE_NNUNET_READY": str(ready),
           "FAKE_NNUNET_HANDLER": "1" if handler else "0"}  # fmt: skip
    env.pop("NNUI_JOB_ID", None)
    argv = [sys.executable, str(FAKE_NNUNET), "900", "2d", "0", "-device", "cpu"]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = [process.pid]
    try:
        assert wait_until(lambda: ready.exists() and ready.read_text().endswith("\n"), 30)
        pids = [int(p) for p in ready.read_text().split()]
        ticks = process_start_ticks(process.pid)
        result = _nnui(env, "status", "--json")
        assert result.returncode == 0, result.stderr
        (row,) = json.loads(result.stdout)
        assert row["watch_only"] is True and row["id"] == f"nnunet:{process.pid}"
        assert row["pids"] == sorted(pids) and row["epoch"] == 2 and row["num_epochs"] == 1000
        assert row["dice_per_class"] == [0.4, 0.2] and row["sigusr1_handler"] is handler
        assert row["class_names"] == []  # the fake run folder has no dataset.json
        assert row["eta_s"] == pytest.approx((1000 - 2) * (13 + 12.5) / 2)  # median epoch
        table = _nnui(env, "status").stdout
        assert "watch-only" in table and f"nnunet:{process.pid}" in table

        stop = _nnui(env, "stop", f"nnunet:{process.pid}", "--yes")
        assert stop.returncode == 1, stop.stderr
        assert stop.stderr.startswith(f"error: refused to stop nnunet:{process.pid}: watch-only")
        if handler:
            assert f"kill -USR1 {process.pid}" in stop.stderr
        else:
            assert "no SIGUSR1 handler" in stop.stderr
            assert "-tr nnUNetTrainer_nnui -device cpu --c" in stop.stderr
        bare = _nnui(env, "stop", str(process.pid))  # a bare pid is refused the same way
        assert bare.returncode == 1 and "watch-only" in bare.stderr
        kill = _nnui(env, "kill", f"nnunet:{process.pid}", "--yes")  # never ended by nnui
        assert (
            kill.returncode == 1 and "watch-only" in kill.stderr and "nothing sent" in kill.stderr
        )
        assert process.poll() is None and process_start_ticks(process.pid) == ticks
        assert read_sigcgt_usr1(process.pid) is handler
    finally:
        _end(pids, argv)
        process.wait(timeout=10)
    unknown = _nnui(env, "stop", f"nnunet:{process.pid}")
    assert unknown.returncode == 2 and "no watch-only nnU-Net run" in unknown.stderr
    assert _nnui(env, "status").stdout.splitlines()[0] == "no jobs"


# ---- a real stock nnUNetv2_train (slow) --------------------------------------------------

VENV_BIN = Path(sys.executable).parent


@pytest.mark.slow
@pytest.mark.skipif(not (VENV_BIN / "nnUNetv2_train").exists(), reason="nnunetv2 not installed")
def test_real_stock_nnunet_run_is_watch_only_and_never_stopped(tmp_path: Path) -> None:
    from trainer.demo import make_demo_dataset

    roots = {name: tmp_path / name for name in ("raw", "preprocessed", "results")}
    make_demo_dataset(roots["raw"], num_cases=6, seed=0, shape_scale=0.4)
    env = {**os.environ, "nnUNet_raw": str(roots["raw"]),
           "nnUNet_preprocessed": str(roots["preprocessed"]),
           "nnUNet_results": str(roots["results"]), "NNUI_STATE_DIR": str(tmp_path / "state"),
           "OMP_NUM_THREADS": "1", "nnUNet_n_proc_DA": "1"}  # fmt: skip
    env.pop("NNUI_JOB_ID", None)
    plan = subprocess.run(
        [str(VENV_BIN / "nnUNetv2_plan_and_preprocess"), "-d", "900", "-c", "2d", "-np", "1"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-2000:]
    argv = [sys.executable, str(VENV_BIN / "nnUNetv2_train"), "900", "2d", "0", "-tr",
            "nnUNetTrainer", "-device", "cpu"]  # fmt: skip
    console = (tmp_path / "train.log").open("w")
    process = subprocess.Popen(argv, env=env, stdout=console, stderr=subprocess.STDOUT,
                               start_new_session=True)  # fmt: skip
    fold = roots["results"] / "Dataset900_NnuiDemo" / "nnUNetTrainer__nnUNetPlans__2d" / "fold_0"
    pids = [process.pid]
    try:

        def epoch_started() -> bool:
            return any("Epoch 0" in p.read_text() for p in fold.glob("training_log_*.txt"))

        assert wait_until(lambda: epoch_started() or process.poll() is not None, 600, 0.5)
        assert process.poll() is None, (tmp_path / "train.log").read_text()[-2000:]
        ticks = process_start_ticks(process.pid)
        result = _nnui(env, "status", "--json")
        assert result.returncode == 0, result.stderr
        (row,) = json.loads(result.stdout)
        pids = row["pids"]
        assert row["watch_only"] is True and row["pid"] == process.pid
        assert row["state"] == "running" and row["phase"] == "training" and row["epoch"] == 0
        assert row["trainer"] == "nnUNetTrainer" and row["run_dir"] == str(fold)
        assert row["num_epochs"] == 1000 and row["num_epochs_source"] == "debug.json"
        assert row["sigusr1_handler"] is False  # stock nnU-Net: no handler (SigCgt)
        assert len(pids) >= 2  # its data-augmentation worker(s)

        stop = _nnui(env, "stop", f"nnunet:{process.pid}", "--yes")
        assert stop.returncode == 1, stop.stderr
        assert "no SIGUSR1 handler" in stop.stderr and "nnUNetTrainer_nnui" in stop.stderr
        assert process.poll() is None and process_start_ticks(process.pid) == ticks
    finally:
        descendants = [p for p in pids if p != process.pid]
        _end([process.pid, *descendants], argv)
        process.wait(timeout=30)
        console.close()
