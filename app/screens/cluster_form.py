"""The cluster target of the launch board (x): the folds marked on the board (else the ones
typed) go to SLURM, one `nnui sbatch` job per fold (app/services/slurm/folds.py).

Prefilled from the board: the picker's dataset and configuration, the marked folds and the
trainer flags. The partition and the limits are chosen here; enter shows the exact script
of every fold (the launch confirm) before anything is submitted, and y submits them.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, Checkbox, Input, Static

from app.screens import keys
from app.screens.confirm import LaunchConfirmScreen
from app.screens.seam import app_of
from app.services.launch.engines import engine
from app.services.launch.request import LaunchRequest
from app.services.slurm.control import SlurmError
from app.services.slurm.folds import (
    ClusterLimits,
    dependencies,
    expand_folds,
    fold_specs,
    submit_fold,
)
from app.services.slurm.script import JobSpec, render_script
from app.widgets.fitting_footer import FittingFooter
from app.widgets.toggles import TextCheckbox
from trainer.schema.tree import Roots


@dataclass(frozen=True)
class ClusterDefaults:
    dataset: str
    configuration: str
    folds: tuple[str, ...]
    trainer_args: tuple[str, ...]
    engine: str
    cascade: bool  # a cascade: its folds wait for the previous stage's jobs (afterok)


_FIELDS = (  # (id, label, default)
    ("cl-folds", "folds", ""), ("cl-partition", "partition", ""),
    ("cl-time", "time limit", "24:00:00"), ("cl-gpus", "GPUs per node (0: CPU)", "1"),
    ("cl-nodes", "nodes per fold", "1"), ("cl-account", "account", ""),
    ("cl-lead", "USR1 lead (s)", "600"), ("cl-flags", "trainer flags", ""),
)  # fmt: skip


class ClusterScreen(Screen):
    BINDINGS: ClassVar[list[BindingType]] = list(keys.CLUSTER)

    def __init__(self, defaults: ClusterDefaults) -> None:
        super().__init__(id="cluster-form")
        self.defaults = defaults
        self.num_reviews = 0  # tests wait for it
        self.submitted: list[str] = []  # SLURM job ids, in fold order

    def compose(self) -> ComposeResult:
        d = self.defaults
        yield Static("Launch on the cluster (SLURM)", classes="screen-title")
        yield Static(f"{d.dataset} {d.configuration}: one nnui sbatch job per fold", id="cl-what")
        values = {"cl-folds": " ".join(d.folds), "cl-flags": shlex.join(d.trainer_args)}
        with Vertical(id="cl-fields"):
            for ident, label, default in _FIELDS:
                with Horizontal(classes="pf-row"):
                    yield Static(f"{label} ", classes="pf-label")
                    yield Input(values.get(ident) or default, id=ident)
            yield TextCheckbox("requeue at the time limit (--requeue)", id="cl-requeue")
            yield Button("Review the scripts (enter)", variant="success", id="cl-go")
        yield Static(id="cl-problems")
        yield FittingFooter()

    def on_mount(self) -> None:
        self.set_focus(self.query_one("#cl-partition", Input))

    def values(self) -> dict[str, str]:
        """What the fields hold (read on the UI thread; the plan runs off it)."""
        got = {ident: self.query_one(f"#{ident}", Input).value.strip() for ident, *_ in _FIELDS}
        got["cl-requeue"] = "1" if self.query_one("#cl-requeue", Checkbox).value else ""
        return got

    # ---- actions ----------------------------------------------------------------------

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_go()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cl-go":
            self.action_go()

    def action_cancel(self) -> None:
        self.app.pop_screen()

    def action_toggle_requeue(self) -> None:
        self.query_one("#cl-requeue", Checkbox).toggle()

    def action_go(self) -> None:
        values, roots = self.values(), app_of(self).config.roots

        def plan() -> Any:
            try:
                return plan_cluster(self.defaults, values, roots)
            except ValueError as problem:  # UsageError too: one line
                return str(problem)

        app_of(self).run_in_thread(plan, self._review)

    def _review(self, result: Any) -> None:
        if not self.is_mounted:
            return
        self.num_reviews += 1
        if isinstance(result, Exception):
            result = f"cannot plan: {result}"
        if isinstance(result, str):
            self.query_one("#cl-problems", Static).update(Text(f"✗ {result}", style="bold red"))
            return
        self.query_one("#cl-problems", Static).update("")
        specs, after = result
        previews = [f"# {s.script_path}" + (f"  (sbatch --dependency={a})" if a else "") +
                    f"\n{render_script(s)}" for s, a in zip(specs, after, strict=True)]  # fmt: skip
        title = f"Submit {len(specs)} fold(s) to SLURM, one job each"
        confirm = LaunchConfirmScreen(title, previews, [])
        self.app.push_screen(confirm, lambda ok: self._submit(specs, after) if ok else None)

    def _submit(self, specs: list[JobSpec], after: list[str | None]) -> None:
        for spec, dependency in zip(specs, after, strict=True):
            try:
                self.submitted.append(submit_fold(spec, dependency))
            except (SlurmError, OSError) as problem:
                self.notify(f"fold {spec.fold} not submitted: {problem}", severity="error",
                            timeout=10)  # fmt: skip
                return
        jobs = ", ".join(f"slurm:{j}" for j in self.submitted)
        self.notify(f"submitted {jobs}; they appear on the board", timeout=8)
        while self.app.screen.id not in ("dashboard", None) and len(self.app.screen_stack) > 2:
            self.app.pop_screen()  # back to the jobs, where the folds appear


def plan_cluster(
    d: ClusterDefaults, values: dict[str, str], roots: Roots
) -> tuple[list[JobSpec], list[str | None]]:
    """The fold specs and their dependencies from the form; ValueError: the one problem."""
    numbers = {}
    for ident, name in (("cl-gpus", "GPUs per node"), ("cl-nodes", "nodes"),
                        ("cl-lead", "USR1 lead")):  # fmt: skip
        if not values[ident].isdigit():
            raise ValueError(f"{name}: a whole number, got {values[ident]!r}")
        numbers[ident] = int(values[ident])
    limits = ClusterLimits(
        time_limit=values["cl-time"], partition=values["cl-partition"] or None,
        account=values["cl-account"] or None, nodes=numbers["cl-nodes"],
        gpus_per_node=numbers["cl-gpus"], signal_lead_s=numbers["cl-lead"],
        requeue=bool(values["cl-requeue"]), output=Path("nnui_slurm").absolute(),
    )  # fmt: skip
    try:
        trainer_args = shlex.split(values["cl-flags"])
    except ValueError as problem:
        raise ValueError(f"trainer flags: {problem}") from None
    request = LaunchRequest(
        dataset=d.dataset, configuration=d.configuration,
        folds=expand_folds(values["cl-folds"].replace(" ", ",")), gpus=[], mode="torchrun",
        device="cuda" if limits.gpus_per_node else "cpu", trainer_args=trainer_args,
        simulated=False, engine=d.engine,
    )  # fmt: skip
    if not request.folds:
        raise ValueError("folds: which folds to submit, e.g. 0-4")
    specs = fold_specs(request, roots, limits)
    return specs, dependencies(specs, roots.preprocessed, d.cascade)


def open_cluster_form(board: Any) -> None:
    """The launch board's x: the form for its picker's choice and marked folds."""
    from app.widgets.dataset_picker import DatasetPicker
    from app.widgets.fold_board import FoldBoard

    choice = board.query_one(DatasetPicker).current
    if choice is None:
        board.notify(board._no_dataset(), severity="warning", timeout=8)
        return
    try:
        flags = tuple(shlex.split(board.query_one("#flags", Input).value))
    except ValueError:
        flags = ()
    if choice.plans != engine(board.engine).default_plans:
        flags = ("-p", choice.plans, *flags)
    marked = board.query_one(FoldBoard).model.assignments
    folds = tuple(sorted(marked, key=lambda f: (f == "all", f))) or ("0", "1", "2", "3", "4")
    cascade = bool(getattr(choice, "previous_stage", None))
    defaults = ClusterDefaults(choice.dataset, choice.configuration, folds, flags,
                               board.engine, cascade)  # fmt: skip
    board.app.push_screen(ClusterScreen(defaults))
