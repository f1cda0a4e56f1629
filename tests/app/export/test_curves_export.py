"""Curves a TensorBoard user will not miss: distinct colours and a legend per overlaid fold,
per-class Dice, smoothing, the running training loss, and `nnui export` (CSV + PNG)."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.main import main
from app.services.export import curves as curve_export
from app.services.export import png as png_plot
from app.services.jobs.curves import EpochPoint, RunningPoint, distinct_colours, smooth
from app.services.jobs.registry import Job, Registry
from app.services.jobs.views import JobTracker
from trainer.schema.events import encode_event
from trainer.training.running_loss import RunningLoss, log_points

NOW = time.time()


def epoch_line(t: float, n: int, dice: list[float | None]) -> str:
    return encode_event(
        "epoch_ended", t=t, epoch=n, train_loss=1.0 / (n + 1), val_loss=None,
        dice_per_class=dice, mean_fg_dice=0.5, ema_fg_dice=0.4 + n / 100, lr=0.01 * (1 - n / 10),
        epoch_time_s=2.5, iterations_per_s=10.0, data_wait_s=0.125, nan_loss=True,
    )  # fmt: skip


def add_job(registry: Registry, tmp: Path, job_id: str, fold: str = "0", **changes) -> Job:
    folder = (
        tmp / "results" / "Dataset004_Demo" / "nnuiTrainer__nnuiPlans__3d_fullres" / f"fold_{fold}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    values = dict(
        job_id=job_id, created_at=NOW - 100, dataset="Dataset004_Demo",
        configuration="3d_fullres", fold=fold, mode="single", device="cpu", gpus=[],
        simulated=False, argv=[], env={}, run_dir=str(folder),
        console_path=str(folder / "console.log"), exit_code=0, ended_at=NOW - 10,
    )  # fmt: skip
    values.update(changes)
    job = Job(**values)
    registry.add(job)
    return job


def write(job: Job, *lines: str) -> None:
    with open(Path(job.run_dir) / "events.jsonl", "a") as handle:
        handle.write("".join(lines))


# ---- smoothing, colours ----------------------------------------------------------------


def test_smoothing_is_a_debiased_ema_and_zero_is_identity() -> None:
    assert smooth([1.0, 2.0, 3.0], 0.0) == [1.0, 2.0, 3.0]
    got = smooth([1.0, 0.0], 0.6)
    # first point: (0.4*1)/0.4 = 1; second: (0.6*0.4 + 0)/(0.6*0.4 + 0.4) = 0.375
    assert got == pytest.approx([1.0, 0.375])
    with pytest.raises(ValueError):
        smooth([1.0], 1.0)


def test_distinct_colours_stay_distinct_beyond_the_palette() -> None:
    colours = distinct_colours(25)
    assert len(set(colours)) == 25 and (255, 255, 255) not in colours


# ---- the running loss (trainer side, no torch needed) -------------------------------------


class Recorder:
    enabled = True

    def __init__(self) -> None:
        self.events: list[dict] = []

    def event(self, kind: str, **fields) -> None:
        self.events.append({"kind": kind, **fields})


class DeviceSum:
    """A stand-in for the on-device sum: counts the reads (each would be a device sync)."""

    def __init__(self) -> None:
        self.value, self.reads = 0.0, 0

    def __float__(self) -> float:
        self.reads += 1
        return self.value


def test_running_loss_reads_the_device_only_at_its_few_points() -> None:
    assert log_points(250) == {62, 125, 188, 250} and log_points(2) == {1, 2}
    recorder, total = Recorder(), DeviceSum()
    hook = RunningLoss(recorder, epoch=3, num_iterations=8)
    losses = [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.5, 0.5]
    for step, loss in enumerate(losses, start=1):
        total.value += loss
        hook(step, total)
    assert total.reads == 4  # not 8: one read per log point
    assert [(e["iteration"], e["loss"]) for e in recorder.events] == [
        (2, 1.0), (4, 0.5), (6, 0.25), (8, 0.5)]  # fmt: skip
    assert all(e["kind"] == "train_loss_running" and e["epoch"] == 3 for e in recorder.events)


def test_the_jobs_reader_keeps_running_points_and_per_class_dice(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "j1")
    write(
        job,
        encode_event("run_started", t=NOW - 90, num_epochs=4),
        encode_event(
            "train_loss_running", t=NOW - 89, epoch=0, iteration=1, num_iterations=2, loss=0.9
        ),
        encode_event("mystery_kind_v2", t=NOW - 89, whatever=1),  # unknown kinds: ignored
        encode_event(
            "train_loss_running", t=NOW - 88, epoch=0, iteration=2, num_iterations=2, loss=None
        ),
        epoch_line(NOW - 87, 0, [0.5, None]),
    )
    (view,) = JobTracker(registry).refresh()
    assert next((p.x, p.loss) for p in view.running_loss) == (0.5, 0.9)
    assert view.running_loss[1].x == 1.0  # the epoch's end sits where its epoch_ended is
    assert view.history[0].dice_per_class[0] == 0.5 and view.history[0].dice_per_class[1] != 0.5


# ---- CSV and PNG -------------------------------------------------------------------------


def decode_png(data: bytes) -> tuple[int, int, set[tuple[int, int, int]], dict[str, str]]:
    """(width, height, colours, text chunks) of a PNG, read back by Pillow (matplotlib's)."""
    image_module = pytest.importorskip("PIL.Image")
    assert data[:8] == png_plot.PNG_SIGNATURE
    image = image_module.open(io.BytesIO(data))
    image.load()
    text = {k: v for k, v in image.info.items() if isinstance(v, str)}
    rgb = image.convert("RGB")
    colours = {rgb.getpixel((x, y)) for y in range(rgb.height) for x in range(rgb.width)}
    return rgb.width, rgb.height, colours, text


def test_export_writes_csv_rows_equal_to_the_events_and_a_png(tmp_path: Path, monkeypatch,
                                                              capsys) -> None:  # fmt: skip
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("NNUI_STATE_DIR", str(tmp_path / "state"))
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "0101-000000-f0-abc")
    lines = [encode_event("run_started", t=NOW - 90, num_epochs=4)]
    lines += [epoch_line(NOW - 80 + n, n, [0.1 * n, None if n == 1 else 0.2]) for n in range(3)]
    lines += [encode_event("train_loss_running", t=NOW - 70, epoch=2, iteration=5,
                           num_iterations=10, loss=0.7)]  # fmt: skip
    write(job, *lines)
    out = tmp_path / "out"
    assert main(["export", "abc", "-o", str(out)]) == 0
    rows = list(csv.DictReader(io.StringIO((out / f"{job.job_id}_curves.csv").read_text())))
    events = curve_export.read_curves(job).epochs
    assert len(rows) == 3 and len(events) == 3
    for row, event in zip(rows, events, strict=True):
        assert int(row["epoch"]) == event["epoch"] and float(row["t"]) == event["t"]
        for key in ("train_loss", "mean_fg_dice", "ema_fg_dice", "lr", "epoch_time_s",
                    "iterations_per_s", "data_wait_s"):  # fmt: skip
            assert float(row[key]) == event[key], key
        assert row["val_loss"] == "" and row["nan_loss"] == "true"
        dice = [None if v == "" else float(v) for v in (row["dice_class_1"], row["dice_class_2"])]
        assert dice == event["dice_per_class"]
    width, height, colours, text = decode_png((out / f"{job.job_id}_curves.png").read_bytes())
    assert (width, height) == (960, 3 * 280)
    assert set(distinct_colours(4)) <= colours  # Dice: mean, EMA, class 1, class 2
    assert "class 2" in text["Comment"] and "x (epoch) 1..3" in text["Comment"]  # epochs done
    printed = capsys.readouterr().out
    assert "loss: x (epoch)" in printed and "#1f77b4 train" in printed


def test_a_region_runs_png_names_each_dice_series_by_its_region(tmp_path: Path) -> None:
    """run_started's class_names (a BraTS-style dataset's regions) label the Dice series;
    a run without them (or with a count that does not match) keeps "class N"."""
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "0101-000000-f0-reg")
    names = ["whole tumor", "tumor core", "enhancing tumor"]
    write(job, encode_event("run_started", t=NOW - 90, num_epochs=4, class_names=names),
          *[epoch_line(NOW - 80 + n, n, [0.1, 0.2, 0.3]) for n in range(2)])  # fmt: skip
    curves = curve_export.read_curves(job)
    assert curves.class_names == tuple(names)
    dice = curve_export.panels(curves)[1]
    assert [series.label for series in dice.series][2:] == names
    unnamed = curve_export.JobCurves(curves.epochs, curves.running, ("only one",))
    labels = [series.label for series in curve_export.panels(unnamed)[1].series][2:]
    assert labels == ["class 1", "class 2", "class 3"]


def test_export_errors_are_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("NNUI_STATE_DIR", str(tmp_path / "state"))
    registry = Registry(tmp_path / "state")
    add_job(registry, tmp_path, "0101-000000-f0-abc")
    assert main(["export", "nope"]) == 2
    assert main(["export", "abc", "-o", str(tmp_path)]) == 3  # no epoch yet: nothing to do
    (tmp_path / "file").write_text("x")
    write(registry.get("0101-000000-f0-abc"), epoch_line(NOW - 50, 0, [0.5]))
    assert main(["export", "abc", "-o", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert err.count("error: ") == 2 and "Traceback" not in err


def test_png_draws_every_series_colour_at_the_size_asked() -> None:
    pytest.importorskip("matplotlib")
    red, blue = (200, 0, 0), (0, 0, 200)
    panel = png_plot.Panel("p", (png_plot.Series("a", red, (0.0, 1.0, 2.0), (1.0, 0.5, 0.2)),
                                 png_plot.Series("b", blue, (0.0,), (0.3,))))  # fmt: skip
    image, lines = png_plot.render([panel], width_px=300, panel_height_px=200)
    width, height, colours, text = decode_png(image)
    assert (width, height) == (300, 200) and {red, blue} <= colours
    # y: 0.2..1 padded by 4 % of its span on both sides
    assert lines == ["p: x (epoch) 0..2, y 0.168..1.032; #c80000 a, #0000c8 b"]
    assert text["Comment"] == lines[0] and text["Title"] == "nnui curves"


def test_the_png_renderer_is_imported_only_when_a_png_is_drawn() -> None:
    """The TUI and every other command start without matplotlib (and its numpy)."""
    code = ("import sys, app.main, app.services.export.curves; "
            "print(sorted(m for m in ('matplotlib', 'numpy') if m in sys.modules))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).resolve().parents[3])  # fmt: skip
    assert done.stdout.strip() == "[]"


def test_without_matplotlib_export_writes_the_csv_and_says_how_to_get_the_png(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("NNUI_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "0101-000000-f0-abc")
    write(job, epoch_line(NOW - 50, 0, [0.5]))
    assert main(["export", "abc", "-o", str(tmp_path / "out")]) == 1
    assert (tmp_path / "out" / f"{job.job_id}_curves.csv").is_file()
    assert not (tmp_path / "out" / f"{job.job_id}_curves.png").exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'nnui[plot]'" in err and "Traceback" not in err


# ---- the TUI panel ---------------------------------------------------------------------


def history(num: int, offset: float = 0.0) -> tuple[EpochPoint, ...]:
    return tuple(EpochPoint(e, 1 / (e + 1) + offset, 1.0, 0.1 * e, 0.05 * e, 0.01, 2.0, 5.0,
                            (0.1 * e, 0.2 * e)) for e in range(num))  # fmt: skip


async def test_overlaid_folds_get_distinct_colours_a_legend_and_smoothing() -> None:
    from textual.app import App

    from app.widgets.curves import CurvesPanel

    class Host(App):
        def compose(self):
            yield CurvesPanel(id="curves")

    app = Host()
    async with app.run_test(size=(160, 50)) as pilot:
        panel = app.query_one(CurvesPanel)
        folds = {f"fold {f}": history(5, f / 10) for f in range(5)}
        running = {"fold 0": tuple(RunningPoint(0, i, 2, 0.5 * i) for i in (1, 2))}
        assert panel.show(folds, running)
        await pilot.pause()
        loss = panel.drawn["plot-loss"]
        fold_colour = {d.label.rsplit(" ", 1)[0]: d.colour for d in loss if d.series == "train"}
        assert len(set(fold_colour.values())) == 5  # one colour per fold
        assert {d.series for d in panel.drawn["plot-class"]} == {"class 1", "class 2"}
        assert any(d.series == "train (running)" for d in loss)
        legend = panel.legend.plain
        assert all(f"fold {f}" in legend for f in range(5)) and "val" in legend
        raw = next(d for d in loss if d.label == "fold 0 train").ys
        assert not panel.show(folds, running)  # nothing changed: no redraw
        assert panel.show(folds, running, smoothing=0.6)
        smoothed = next(d for d in panel.drawn["plot-loss"] if d.label == "fold 0 train").ys
        assert list(smoothed) == pytest.approx(smooth(list(raw), 0.6)) and smoothed != raw
        lr = next(d for d in panel.drawn["plot-lr"] if d.label == "fold 0 lr")
        assert lr.ys == (0.01,) * 5  # lr and epoch time are never smoothed
        panel.show({"fold 0": history(3)})
        single = panel.drawn["plot-loss"]
        assert len({d.colour for d in single}) == len(single)  # one fold: a colour per series
