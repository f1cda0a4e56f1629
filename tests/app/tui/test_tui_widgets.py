"""Widgets render what they are given: tables of inputs -> text (no app needed)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from app.screens.confirm import stop_text
from app.services.jobs.curves import series
from app.services.jobs.words import human_duration
from app.services.machine.gpus import GpuProcess, GpuSnapshot, MachineSnapshot
from app.services.signals.proctree import label_tree
from app.widgets.curves import epoch_ticks
from app.widgets.formatting import bar
from app.widgets.gpu_panel import NO_DRIVER_BANNER, GpuPanel, gpu_lines, sparkline
from app.widgets.job_cells import row_cells
from app.widgets.process_tree import tree_text


def Gpu(**changes) -> GpuSnapshot:
    """The service's own snapshot type (widgets are typed by it), with test defaults."""
    reading = dict(index=0, name="NVIDIA H100 80GB HBM3",
                   uuid="GPU-8f3a1c2d-1111-2222-3333-444455556666",
                   memory_used_bytes=40 * 2**30, memory_total_bytes=80 * 2**30,
                   utilization_percent=87, temperature_c=61, power_w=312.4,
                   processes=())  # fmt: skip
    return GpuSnapshot(**{**reading, **changes})


def Machine(**changes) -> MachineSnapshot:
    fields = dict(gpus=(), simulated=False, driver_problem=None, taken_at=0.0)
    return MachineSnapshot(**{**fields, **changes})


GPU_CASES = [
    (Gpu(), ["GPU 0", "[8f3a1c2d]", "40.0/80.0 GiB", "87%", "61°C", "312 W", "idle"]),
    (
        Gpu(memory_used_bytes=None, utilization_percent=None, temperature_c=None, power_w=None),
        ["n/a/80.0 GiB", "UTL ············ n/a", "temp n/a", "power n/a"],
    ),
    (
        Gpu(
            processes=(
                GpuProcess(11, "alice", 2**30, "python", True),
                GpuProcess(22, "bob", None, None, False),
            )
        ),
        ["pid 11", "alice (you)", "1024 MiB", "pid 22", "bob (other user)", "n/a"],
    ),
]


@pytest.mark.parametrize(("gpu", "fragments"), GPU_CASES)
def test_gpu_card_text(gpu, fragments) -> None:
    text = gpu_lines(gpu).plain
    for fragment in fragments:
        assert fragment in text


BANNER_CASES = [
    (Machine(simulated=True, gpus=(Gpu(),)), ["SIMULATED", "1 simulated GPUs"]),
    (Machine(driver_problem="No NVIDIA driver found"), [NO_DRIVER_BANNER, "CPU slots: 3"]),
    (Machine(), ["No GPUs visible", "CPU slots: 3"]),
    (Machine(gpus=(Gpu(),)), []),
]


@pytest.mark.parametrize(("machine", "fragments"), BANNER_CASES)
def test_gpu_banner(machine, fragments) -> None:
    text = GpuPanel(cpu_slots=3).banner_for(machine).plain
    assert all(f in text for f in fragments)
    assert bool(text) == bool(fragments)


def test_sparkline_has_a_fixed_scale() -> None:
    assert sparkline([0, 50, 100], width=4) == " ▁▄█"
    assert len(sparkline(list(range(100)))) == 24


@dataclass
class Job:
    job_id: str = "j1"
    dataset: str = "Dataset004_Hippocampus"
    configuration: str = "3d_fullres"
    fold: str = "0"
    mode: str = "single"
    gpus: list = field(default_factory=lambda: ["0"])
    simulated: bool = False
    after: str | None = None
    queued_stop: bool = False
    processes: list = field(default_factory=list)
    waiting_reason: str | None = None
    retries: int = 0
    restarts: list = field(default_factory=list)


@dataclass
class View:
    job: Job = field(default_factory=Job)
    state: str = "running"
    epoch: int | None = 5
    num_epochs: int | None = 10
    train_loss: float | None = 0.5
    val_loss: float | None = 0.6
    mean_dice: float | None = 0.7
    ema_dice: float | None = 0.65
    it_per_s: float | None = 8.25
    eta_s: float | None = 3725
    alerts: tuple = ()
    exit_code: int | None = None
    topology: dict | None = None
    console_tail: tuple = ()


ROW_CASES = [
    (View(), {"state": "running", "epoch": "5/10 ███···", "eta": "1 h 2 min", "its": "8.25"}),
    (View(state="failed", exit_code=3, eta_s=None), {"state": "failed (exit 3)", "eta": ""}),
    (View(train_loss=float("nan"), alerts=("NaN loss at epoch 4",)), {"train": "NaN"}),
    (View(epoch=None, num_epochs=None, train_loss=None), {"epoch": "n/a", "train": "n/a"}),
    (View(job=Job(gpus=["0", "1"], mode="torchrun")), {"where": "0,1 (torchrun)"}),
    (View(job=Job(gpus=[])), {"where": "cpu", "dataset": "004_Hippocampus 3d_fullres"}),
    (View(state="queued", job=Job(after="j0")), {"state": "queued (after fold 3)"}),
    (View(state="queued", job=Job(waiting_reason="GPU 1: 37 GiB used by user bob (pid 4411)")),
     {"state": "queued", "alerts": "waiting: GPU 1: 37 GiB used by user bob (pid 4411) "}),
    (View(job=Job(retries=3, restarts=["exit 137 (SIGKILL)"])),
     {"alerts": "restarts 1/3: exit 137 (SIGKILL) "}),
]  # fmt: skip


@pytest.mark.parametrize(("view", "expected"), ROW_CASES)
def test_job_row_cells(view, expected) -> None:
    cells = row_cells(view, selected=False, after_fold="3")
    plain = {k: getattr(v, "plain", v) for k, v in cells.items()}
    for key, value in expected.items():
        assert plain[key] == value
    if view.alerts:
        assert "NaN loss" in plain["alerts"]


def test_formatting() -> None:
    seconds = (None, 5, 30.8, 65, 3599, 3600 * 2 + 600, 7200)
    assert [human_duration(s) for s in seconds] == [
        "n/a", "5 s", "31 s", "1 min", "1 h", "2 h 10 min", "2 h",
    ]  # fmt: skip
    assert bar(0.5, 4) == "██··" and bar(None, 3) == "···"


def test_epoch_ticks_and_series() -> None:
    assert epoch_ticks([]) == []
    assert epoch_ticks([0, 1, 2]) == [0, 1, 2]
    ticks = epoch_ticks(list(range(100)))
    assert len(ticks) <= 11 and ticks[0] == 0 and ticks[-1] == 99

    @dataclass
    class Point:
        epoch: int
        train_loss: float

    assert series([Point(0, 1.0), Point(1, float("nan")), Point(2, 0.5)], "train_loss") == (
        [1, 3],  # epochs done: the first epoch ends at 1
        [1.0, 0.5],
    )


@dataclass
class Info:
    pid: int
    ppid: int
    name: str
    cmdline: list


@dataclass
class Record:
    pid: int
    role: str


def test_process_tree_labels_roles() -> None:
    job = Job(mode="torchrun", processes=[Record(10, "supervisor"), Record(11, "trainer")])
    procs = [
        Info(10, 1, "python", ["python", "-m", "app.services.supervisor"]),
        Info(11, 10, "python", ["python", "-m", "torch.distributed.run", "-m", "trainer"]),
        Info(12, 11, "python", ["python", "-m", "trainer"]),
        Info(13, 11, "python", ["python", "-m", "trainer"]),
        Info(14, 12, "pt_data_worker", ["python"]),
    ]
    topology = {"ranks": [
        {"pid": 12, "global_rank": 0, "device": "cuda:0"},
        {"pid": 13, "global_rank": 1, "device": "cuda:1"},
    ]}  # fmt: skip
    roles = {n.pid: n.label for n in label_tree(job, procs, topology)}
    assert roles == {
        10: "supervisor",
        11: "torchrun",
        12: "rank 0 (cuda:0)",
        13: "rank 1 (cuda:1)",
        14: "loader worker",
    }
    lines = tree_text(label_tree(job, procs, topology)).plain.splitlines()
    assert lines[0].startswith("10") and "└ 14" in lines[3]


@dataclass(frozen=True)
class Target:
    pid: int
    rank: int
    local_rank: int
    host: str
    device: str


@dataclass(frozen=True)
class Plan:
    ok: bool
    targets: tuple
    reason: str | None
    epoch: int | None
    queued: bool


@dataclass(frozen=True)
class Choice:
    view: View
    plan: Plan | None
    note: str | None = None


STOP_CASES = [
    (
        Plan(
            True,
            (Target(101, 0, 0, "box", "cuda:0"), Target(102, 1, 1, "box", "cuda:1")),
            None,
            5,
            False,
        ),
        ["pid 101", "rank 0 (local 0)", "pid 102", "cuda:1", "running epoch (epoch 6/10)"],
    ),
    (
        Plan(False, (), "pid 101 is not nnui's", None, False),
        ["Nothing will be sent: pid 101 is not"],
    ),
    (Plan(False, (), "no topology yet", None, True), ["Queued: no topology yet"]),
]


@pytest.mark.parametrize(("plan", "fragments"), STOP_CASES)
def test_stop_dialog_text(plan, fragments) -> None:
    text = stop_text([Choice(View(), plan)]).plain
    for fragment in fragments:
        assert fragment in text


def test_tui_modules_import_no_heavy_packages() -> None:
    import subprocess
    import sys

    code = (
        "import sys, app.tui, app.screens.dashboard, app.screens.job_detail, "
        "app.screens.launch, app.screens.confirm, app.screens.help; "
        "bad = [m for m in ('torch', 'numpy', 'blosc2', 'safetensors') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dice_curves_are_named_by_the_run_s_classes() -> None:
    """A region-based run records its class (region) names: the per-class Dice series carry
    them; without names (or with a count that does not match) they stay `class N`."""
    from app.services.jobs.curves import EpochPoint
    from app.widgets.curves import PLOTS, plan_plot

    point = EpochPoint(0, 0.5, 0.6, 0.7, 0.7, 0.01, 2.0, 10.0, (0.9, 0.6, 0.4))
    fields = next(f for plot_id, *_, f in PLOTS if any(x == "dice_class" for _, x in f))
    names = ("whole tumor", "tumor core", "enhancing tumor")

    def series_names(class_names) -> list[str]:
        planned = plan_plot(fields, {"fold 0": [point]}, {}, 0.0, class_names)
        return [drawn.series for drawn, field in planned if field.startswith("dice_class")]

    assert series_names(names) == list(names)
    assert series_names(()) == ["class 1", "class 2", "class 3"]
    assert series_names(names[:2]) == series_names(())  # a count that does not match
