"""The prediction form (p on the fold board): the folds marked on the board predict a folder,
one part of its cases per marked GPU (app/services/launch/prediction.py).

Prefilled from the board: the picker's dataset and configuration, the marked folds, the
marked GPUs, `imagesTs` of the dataset's raw folder as input and a folder of its own under
the results root as output. Enter reviews: the checks run off the UI thread and the exact
argv of every part is shown (the launch confirm) before anything starts.
"""

from __future__ import annotations

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
from app.services.launch import launcher, prediction
from app.widgets.fitting_footer import FittingFooter
from app.widgets.toggles import TextCheckbox
from trainer.schema.tree import DEFAULT_PLANS, Roots

PREDICTIONS_FOLDER = "nnui_predictions"  # under results/DatasetNNN_Name/, nnui's own


@dataclass(frozen=True)
class FormDefaults:
    dataset: str
    configuration: str
    plans: str
    folds: tuple[str, ...]
    gpus: tuple[str, ...]  # () = one part on the CPU
    input_dir: Path
    output_dir: Path


def form_defaults(
    roots: Roots, choice: Any, assignments: dict[str, list[str]], plans: str = DEFAULT_PLANS
) -> FormDefaults:
    """What the form starts with, from the picker's choice and the board's marks."""
    folds = tuple(sorted(assignments, key=lambda f: (f == "all", f)))
    columns = {c for cols in assignments.values() for c in cols if c.isdigit()}
    gpus = tuple(sorted(columns, key=int))
    name = f"{choice.configuration}_f{'_'.join(folds)}"
    return FormDefaults(
        dataset=choice.dataset,
        configuration=choice.configuration,
        plans=plans,
        folds=folds,
        gpus=gpus,
        input_dir=roots.raw / choice.dataset / "imagesTs",
        output_dir=roots.results / choice.dataset / PREDICTIONS_FOLDER / name,
    )


class PredictScreen(Screen):
    BINDINGS: ClassVar[list[BindingType]] = list(keys.PREDICT)

    def __init__(self, defaults: FormDefaults, simulated: bool) -> None:
        super().__init__(id="predict-form")
        self.defaults = defaults
        self.simulated = simulated
        self.num_reviews = 0  # tests wait for it

    def compose(self) -> ComposeResult:
        d = self.defaults
        where = f"GPUs {', '.join(d.gpus)} (one part each)" if d.gpus else "the CPU (one part)"
        if d.gpus and self.simulated:
            where += ", simulated: -device cpu"
        yield Static("Predict a folder", classes="screen-title")
        yield Static(f"{d.dataset} {d.configuration}, plans {d.plans}, on {where}", id="pf-what")
        with Vertical(id="pf-fields"):
            yield Static("input folder (CASE_0000 images)")
            yield Input(str(d.input_dir), id="pf-input")
            yield Static("output folder")
            yield Input(str(d.output_dir), id="pf-output")
            with Horizontal(classes="pf-row"):
                yield Static("folds ", classes="pf-label")
                yield Input(" ".join(d.folds), id="pf-folds")
                yield Static(" checkpoint ", classes="pf-label")
                yield Input("checkpoint_final", id="pf-checkpoint")
            with Horizontal(classes="pf-row"):
                yield TextCheckbox("test-time mirroring (TTA)", value=True, id="pf-tta")
                yield TextCheckbox("save probabilities (CASE.npz)", id="pf-npz")
            yield Button("Review and start (enter)", variant="success", id="pf-go")
        yield Static(id="pf-problems")
        yield FittingFooter()

    def on_mount(self) -> None:
        self.set_focus(self.query_one("#pf-input", Input))

    def request(self) -> prediction.PredictRequest:
        d = self.defaults
        args = ["-chk", self.query_one("#pf-checkpoint", Input).value.strip()]
        if d.plans != DEFAULT_PLANS:
            args += ["-p", d.plans]
        if not self.query_one("#pf-tta", Checkbox).value:
            args.append("--disable_tta")
        if self.query_one("#pf-npz", Checkbox).value:
            args.append("--save_probabilities")
        return prediction.PredictRequest(
            input_dir=Path(self.query_one("#pf-input", Input).value.strip()).expanduser(),
            output_dir=Path(self.query_one("#pf-output", Input).value.strip()).expanduser(),
            dataset=d.dataset,
            configuration=d.configuration,
            folds=tuple(self.query_one("#pf-folds", Input).value.split()),
            gpus=d.gpus,
            device="cuda" if d.gpus else "cpu",
            simulated=self.simulated,
            predict_args=tuple(args),
        )

    # ---- actions ----------------------------------------------------------------------

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_go()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "pf-go":
            self.action_go()

    def action_cancel(self) -> None:
        self.app.pop_screen()

    def action_toggle_tta(self) -> None:
        self.query_one("#pf-tta", Checkbox).toggle()

    def action_toggle_probabilities(self) -> None:
        self.query_one("#pf-npz", Checkbox).toggle()

    def action_go(self) -> None:
        request = self.request()
        app = app_of(self)
        roots, registry, snapshot = app.config.roots, app.services.registry, app.snapshot

        def plan() -> tuple[list[Any], list[str], list[str]]:
            checks = prediction.check_prediction(request, roots, registry, snapshot)
            if checks.errors:
                return [], checks.errors, checks.warnings
            plans = prediction.plan_prediction(request, roots, registry, checks.dataset_name)
            return plans, [], checks.warnings

        app.run_in_thread(plan, self._review)

    def _review(self, result: Any) -> None:
        if not self.is_mounted:
            return
        self.num_reviews += 1
        if isinstance(result, Exception):
            result = ([], [f"cannot plan: {result}"], [])
        plans, problems, warnings = result
        shown = Text()
        for problem in problems:
            shown.append(f"✗ {problem}\n", style="bold red")
        for warning in warnings:
            shown.append(f"! {warning}\n", style="yellow")
        self.query_one("#pf-problems", Static).update(shown)
        if problems:
            return
        previews = [launcher.preview(p) for p in plans]
        title = f"Predict: {len(plans)} part(s), one job each"
        confirm = LaunchConfirmScreen(title, previews, [])
        self.app.push_screen(confirm, lambda ok: self._start(plans) if ok else None)

    def _start(self, plans: list[Any]) -> None:
        from app.screens import actions

        actions.start_plans(app_of(self), plans)
        while self.app.screen.id not in ("dashboard", None) and len(self.app.screen_stack) > 2:
            self.app.pop_screen()  # back to the jobs, where the parts appear
