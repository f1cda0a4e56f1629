"""Launch: engine (nnui or nnU-Net), dataset picker, fold board, DDP launcher choice,
trainer flags, the checks with their reasons, and the exact environment + argv of every
process before anything starts.

`e` switches the engine: with nnU-Net the picker lists nnU-Net's own plans files
(`nnUNet*Plans*.json`) and the launch runs nnU-Net with nnui's extension trainer. It is
offered only when nnunetv2 is importable (engines.nnunet_available()); else the board says
so and `e` does nothing.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Checkbox, Input, RadioButton, RadioSet, Static

from app.screens import actions, keys
from app.screens.confirm import LaunchConfirmScreen
from app.screens.predict_form import PredictScreen, form_defaults
from app.screens.seam import app_of
from app.services.jobs.registry import new_job_id
from app.services.launch import catalog, engines, launcher, niceness
from app.services.launch import request as launch_request
from app.services.launch.schedule import Schedule
from app.widgets.dataset_picker import DatasetPicker
from app.widgets.fitting_footer import FittingFooter
from app.widgets.fold_board import CPU_COLUMN, FoldBoard
from app.widgets.formatting import readable_style
from app.widgets.key_order import OrderedInput
from app.widgets.toggles import TextCheckbox, TextRadioButton

if TYPE_CHECKING:
    from app.services.jobs.views import JobView
    from app.services.launch.catalog import DatasetInfo
    from app.services.launch.launcher import LaunchPlan
    from app.services.launch.request import LaunchRequest
    from app.services.machine.gpus import MachineSnapshot


def board_columns(snapshot: MachineSnapshot | None) -> list[str]:
    slots = getattr(snapshot, "slots", ())  # a MIG device is a column of its own
    return [g.slot for g in slots] if slots else [CPU_COLUMN]


class LaunchScreen(Screen):
    BINDINGS: ClassVar[list[BindingType]] = list(keys.LAUNCH)

    def __init__(self) -> None:
        super().__init__(id="launch")
        self.plans: list[LaunchPlan] = []
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.confirmations: list[str] = []  # GPUs already in use: g asks first (busy_gpus.py)
        self.resumable: list[str] = []  # folds with an earlier, stopped run: offer --c
        self.preview_text = ""
        self._shown: tuple[str, str] | None = None
        self._generation = 0
        self.planned_generation = -1  # tests wait until it catches up with _generation
        self._go_pending = False  # g pressed while the checks were still running
        self.num_refused = 0  # g refused by the checks (tests wait for it)
        self._inputs: tuple | None = None  # what the newest plan was made from
        self._job_ids: dict[str, str] = {}  # fold -> the id its preview shows and it gets
        self._ready = False  # data messages can arrive before the widgets are composed
        self._machine_key: tuple | None = None
        self._jobs_key: tuple | None = None
        self.engine = engines.NNUI  # engines.NNUI | engines.NNUNET
        self.datasets_engine: str | None = None  # whose datasets the picker shows now
        self.datasets: list[DatasetInfo] = []  # what the picker shows
        self.memory_lines: list[str] = []  # estimated GPU memory beside the GPUs' free

    class Planned(Message):
        """Checks and preview are up to date (tests wait for it)."""

    def compose(self) -> ComposeResult:
        yield Static("Launch folds", classes="screen-title")
        yield Static(self.engine_text(), id="engine-line")
        yield DatasetPicker(id="picker")
        with Horizontal(id="launch-middle"):
            yield FoldBoard(board_columns(app_of(self).snapshot), id="board")
            with Vertical(id="launch-options"):
                with RadioSet(id="ddp-launcher"):
                    yield TextRadioButton("DDP via -num_gpus (spawn)", value=True, id="spawn")
                    yield TextRadioButton("DDP via torchrun", id="torchrun")
                yield TextCheckbox("resume (--c)", id="resume")
                yield TextCheckbox("when free (wait for the GPUs)", id="when-free")
                yield OrderedInput(placeholder="trainer flags, e.g. --epochs 3", id="flags")
                yield OrderedInput(placeholder="nice N threads T (default: as now)", id="manners")
        yield Static(id="launch-checks")
        with VerticalScroll(id="launch-preview-box"):
            yield Static(id="launch-preview")
        yield FittingFooter()

    def on_mount(self) -> None:
        self._ready = True
        self.query_one(FoldBoard).border_title = "folds × GPUs"
        self.query_one(FoldBoard).border_subtitle = "■ alone or queued · D DDP group"
        self.query_one("#launch-preview-box").border_title = "exact commands (env + argv)"
        self.set_focus(self.query_one(FoldBoard))  # at once: keys pressed next go to it
        self._read_datasets()
        self.recompute()

    # ---- the engine and its datasets --------------------------------------------------

    def engine_text(self) -> Text:
        chosen = engines.engine(self.engine)
        text, mono = Text(), self.app.no_color
        text.append("engine: ", style="bold")
        text.append(chosen.label, style=readable_style("bold cyan", mono))
        if not engines.nnunet_available():
            text.append(f"   {engines.NNUNET_MISSING_SHORT}", style=readable_style("yellow", mono))
            return text
        other = engines.engine(engines.NNUNET if self.engine == engines.NNUI else engines.NNUI)
        text.append(f"   (e: switch to {other.label})", style=readable_style("dim", mono))
        if self.engine == engines.NNUNET:
            text.append(f"   trainer {chosen.default_trainer} (nnui's stop and events)",
                        readable_style("dim", mono))  # fmt: skip
        return text

    def _read_datasets(self) -> None:
        name, roots = self.engine, app_of(self).config.roots
        self.query_one(
            "#picker"
        ).border_title = (
            f"dataset, plans and configuration ({engines.engine(name).label} plans files)"
        )

        def read() -> list[Any]:
            return catalog.list_engine_datasets(roots, engines.engine(name))

        app_of(self).run_in_thread(read, lambda datasets: self._got(name, datasets))

    def _got(self, engine_name: str, datasets: Any) -> None:
        if engine_name != self.engine or not self.is_mounted:
            return  # the engine changed meanwhile: its own read is on its way
        if isinstance(datasets, Exception):
            self.notify(f"error: cannot read datasets: {datasets}", severity="error")
            return
        self.datasets_engine, self.datasets = engine_name, list(datasets)
        self.query_one(DatasetPicker).show(datasets)
        self.recompute()

    # ---- data from the app: replan only when something the checks use changed -------

    def show_machine(self, snapshot: MachineSnapshot) -> None:
        if not self._ready:
            return
        board = self.query_one(FoldBoard)
        columns = board_columns(snapshot)
        if columns != board.model.columns and not board.model.assignments:
            board.model.columns = columns  # opened before the first GPU reading arrived
            board.refresh()
        key = tuple((g.index, tuple(p.pid for p in g.processes)) for g in snapshot.gpus)
        if key != self._machine_key:
            self._machine_key = key
            self.recompute()

    def show_jobs(self, views: list[JobView], cv_eta_s: float | None) -> None:
        key = tuple((v.job.job_id, v.state) for v in views)
        if key != self._jobs_key:
            self._jobs_key = key
            self.recompute()

    # ---- events -----------------------------------------------------------------------

    def on_fold_board_changed(self, event: FoldBoard.Changed) -> None:
        self.recompute()

    def on_dataset_picker_chosen(self, event: DatasetPicker.Chosen) -> None:
        self.recompute()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.recompute()

    def on_descendant_focus(self) -> None:
        self.refresh_bindings()  # f / enter change meaning with the focus (check_action)

    def on_radio_set_changed(self, event: RadioSet.Changed) -> None:
        self.query_one(FoldBoard).set_ddp_launcher(event.pressed.id or "spawn")

    def on_checkbox_changed(self, event: Checkbox.Changed) -> None:
        self.recompute()

    # ---- the plan: inputs gathered here, checks and plans in a thread -----------------

    def requests(self) -> tuple[list[LaunchRequest], int | None, list[str]]:
        """Launch requests from the widgets, the plans batch size, and input problems."""
        board = self.query_one(FoldBoard)
        choice = self.query_one(DatasetPicker).current
        problems = board.model.checks()
        try:
            trainer_args = shlex.split(self.query_one("#flags", Input).value)
        except ValueError as error:
            trainer_args = []
            problems.append(f"trainer flags: {error}")
        try:
            nice, threads = niceness.parse_field(self.query_one("#manners", Input).value)
        except ValueError as error:
            nice, threads = None, None
            problems.append(str(error))
        if self.datasets_engine != self.engine:
            return [], None, [*problems, "reading the datasets ..."]
        if choice is None:
            problems.append(self._no_dataset())
            return [], None, problems
        chosen = engines.engine(self.engine)
        if choice.plans != chosen.default_plans:  # the picker's plans; typed flags win
            trainer_args = ["-p", choice.plans, *trainer_args]
        simulated = bool(getattr(app_of(self).snapshot, "simulated", False))
        when_free = self.query_one("#when-free", Checkbox).value and board.model.device != "cpu"
        cascade = bool(getattr(choice, "previous_stage", None))
        requests = [
            launch_request.LaunchRequest(
                dataset=choice.dataset,
                configuration=choice.configuration,
                folds=list(spec.folds),
                gpus=[] if spec.gpus == (CPU_COLUMN,) else list(spec.gpus),
                mode=spec.mode,
                device=board.model.device,
                trainer_args=trainer_args,
                simulated=simulated,
                continue_training=self.query_one("#resume", Checkbox).value,
                sequential=spec.sequential and not when_free,  # waiting queues them anyway
                engine=self.engine,
                # a cascade waits for its previous stage's folds (`--after-lowres`)
                schedule=Schedule(when_free=when_free, after_previous_stage=cascade),
                nice=nice,
                threads=threads,
            )
            for spec in board.model.specs()
        ]
        return requests, choice.batch_size, problems

    def _check_memory(
        self, requests: list[LaunchRequest], snapshot: MachineSnapshot | None
    ) -> list[str]:
        """Sets memory_lines; returns the misfits (g asks before starting them)."""
        choice = self.query_one(DatasetPicker).current
        info = next((d for d in self.datasets if choice and d.name == choice.dataset
                     and getattr(d, "plans", None) == choice.plans), None)  # fmt: skip
        config = info.configuration(choice.configuration) if info and choice else None
        lines, misfits = [], []
        for request in requests:
            line, misfit = catalog.memory_check(config, request.gpus, snapshot)
            lines += [line] if line and line not in lines else []
            misfits += [misfit] if misfit and misfit not in misfits else []
        self.memory_lines = lines
        return misfits

    def _no_dataset(self) -> str:
        where = app_of(self).config.roots.preprocessed
        if self.engine == engines.NNUNET:
            return (
                f"no nnU-Net plans (DatasetXXX/nnUNet*Plans*.json) in {where} "
                "(nnUNetv2_plan_and_preprocess -d ID)"
            )
        return catalog.first_step(app_of(self).config.roots)

    def job_id_of(self, fold: str) -> str:
        """One job id per fold for the life of the form: every preview shows it, the job
        started gets it."""
        return self._job_ids.setdefault(fold, new_job_id(fold))

    def recompute(self) -> None:
        if not self._ready:
            return
        requests, batch_size, problems = self.requests()
        self._inputs = (requests, batch_size, problems)
        self._generation += 1
        generation = self._generation
        app = app_of(self)
        snapshot, registry, roots = app.snapshot, app.services.registry, app.config.roots
        misfits = self._check_memory(requests, snapshot)

        def plan() -> tuple[list[Any], list[str], list[str], list[str], list[str]]:
            # The full checks: busy GPUs, other users, a fold already running (registry and
            # run folder), a finished or stopped fold (offer resume).
            plans: list[LaunchPlan] = []
            errors, warnings, resumable, asks = list(problems), [], [], list(misfits)
            for request in requests:
                checks = launch_request.check_request(
                    request, roots, batch_size, snapshot, registry
                )
                errors += [e for e in checks.errors if e not in errors]
                warnings += [w for w in checks.warnings if w not in warnings]
                asks += [c for c in checks.confirmations if c not in asks]
                resumable += checks.resumable_folds
                if not checks.errors:
                    got, why = launcher.plan_launch(
                        request, roots, batch_size, snapshot, registry, self.job_id_of
                    )
                    plans += got
                    errors += [e for e in why if e not in errors]
            return plans, errors, warnings, resumable, asks

        app.run_in_thread(plan, lambda result: self._planned(generation, result))

    def _planned(self, generation: int, result: Any) -> None:
        if generation != self._generation or not self.is_mounted:
            return  # a newer plan is on its way
        self.planned_generation = generation
        if isinstance(result, Exception):
            plans, problems, warnings, resumable = [], [f"cannot plan: {result}"], [], []
            self.confirmations = []
        else:
            plans, problems, warnings, resumable, self.confirmations = result
        self.plans = [] if problems else plans
        self.problems, self.warnings, self.resumable = problems, warnings, resumable
        self.preview_text = "\n\n".join(launcher.preview(p) for p in plans)
        self._show()
        self.post_message(self.Planned())
        if self._go_pending:
            self._go()

    def _show(self) -> None:
        checks, mono = Text(), self.app.no_color
        for problem in self.problems:
            checks.append(f"✗ {problem}\n", style=readable_style("bold red", mono))
        for warning in self.warnings:
            checks.append(f"! {warning}\n", style=readable_style("yellow", mono))
        for line in self.memory_lines:
            checks.append(f"· {line}\n")
        for note in self.confirmations:
            checks.append(f"? {note} (g asks)\n", style=readable_style("bold yellow", mono))
        if self.resumable:
            folds = ", ".join(self.resumable)
            checks.append(
                f"↻ fold {folds} can continue from its checkpoint: press c (resume --c)\n",
                style=readable_style("bold cyan", mono),
            )
        if not self.problems:
            checks.append(f"✓ ready: {len(self.plans)} process(es); press g to start",
                          readable_style("green", mono))  # fmt: skip
        shown = (checks.plain, self.preview_text)
        if shown == self._shown:
            return
        self._shown = shown
        self.query_one("#launch-checks", Static).update(checks)
        preview = self.preview_text or "(nothing to start yet)"
        if self.problems:
            preview = "(the exact commands appear here once the problems above are solved)"
        self.query_one("#launch-preview", Static).update(Text(preview))

    # ---- actions ----------------------------------------------------------------------

    def _in_flags(self) -> bool:  # the trainer flags field or the nice/threads one
        if not self.is_mounted:
            return False
        return self.focused in (self.query_one("#flags", Input), self.query_one("#manners", Input))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "leave_flags":
            return self._in_flags()
        if action == "focus_flags":
            return not self._in_flags()
        return True

    def _focus_now(self, widget: Any) -> None:
        """Focus moves at once (Widget.focus() would wait a tick), so the next key, already
        on its way, is forwarded to the widget that has focus after this one."""
        self.set_focus(widget)
        self.refresh_bindings()

    def plan_is_current(self) -> bool:
        """The checks and preview shown were made from what the widgets hold now."""
        return self.planned_generation == self._generation and self._inputs == self.requests()

    def action_cancel(self) -> None:
        # Escape while typing flags leaves the field, not the board (nothing typed is lost).
        if self._in_flags():
            self._focus_now(self.query_one(FoldBoard))
            return
        self.app.pop_screen()

    def action_leave_flags(self) -> None:
        self._focus_now(self.query_one(FoldBoard))

    def action_go(self) -> None:
        # Keys pressed before g can still be waiting in the field's or the board's queue (a
        # busy machine): start once both have handled them, from what they then hold.
        flags, board = self.query_one("#flags", Input), self.query_one(FoldBoard)
        flags.call_later(board.call_later, self._go)

    def _go(self) -> None:
        if not self.is_mounted or self.app.screen is not self:
            return
        if self._inputs != self.requests():
            self.recompute()  # input whose change message has not arrived yet (fast typing)
        if self.planned_generation != self._generation:
            # The checks of the latest input (e.g. flags typed just now) are still running:
            # start once they are back, never from a plan of older input.
            self._go_pending = True
            return
        self._go_pending = False
        if self.problems or not self.plans:
            self.num_refused += 1
            self.notify(
                "Cannot start: " + "; ".join(self.problems or ["nothing"]), severity="error"
            )
            return
        if self.confirmations:  # shared-box manners: starting beside a process is confirmed
            plans, previews = self.plans, [launcher.preview(p) for p in self.plans]
            title = "GPU already in use: start beside it?"
            confirm = LaunchConfirmScreen(title, previews, [], self.confirmations)
            self.app.push_screen(confirm, lambda ok: self._start(plans) if ok else None)
            return
        self._start(self.plans)

    def _start(self, plans: list[LaunchPlan]) -> None:
        actions.start_plans(app_of(self), plans)
        if self.app.screen is self:
            self.app.pop_screen()

    def action_toggle_launcher(self) -> None:
        other = "torchrun" if self.query_one(FoldBoard).model.ddp_launcher == "spawn" else "spawn"
        self.query_one(f"#{other}", RadioButton).value = True

    def action_toggle_engine(self) -> None:
        if not engines.nnunet_available():
            self.notify(engines.NNUNET_MISSING, severity="warning", timeout=8)
            return
        self.engine = engines.NNUNET if self.engine == engines.NNUI else engines.NNUI
        self.datasets_engine = None  # the other engine's plans files: read them again
        self.query_one(DatasetPicker).show([])
        self.query_one("#engine-line", Static).update(self.engine_text())
        self._read_datasets()
        self.recompute()

    def action_toggle_resume(self) -> None:
        box = self.query_one("#resume", Checkbox)
        box.value = not box.value

    def action_toggle_when_free(self) -> None:
        box = self.query_one("#when-free", Checkbox)
        box.value = not box.value

    def action_focus_flags(self) -> None:
        self._focus_now(self.query_one("#flags", Input))

    def action_predict(self) -> None:
        """p: the prediction form, with the folds and GPUs marked on the board."""
        choice = self.query_one(DatasetPicker).current
        assignments = self.query_one(FoldBoard).model.assignments
        if self.engine != engines.NNUI:
            self.notify("nnui predicts nnui's models: press e for the nnui engine (nnU-Net's "
                        "own models: nnUNetv2_predict)", severity="warning", timeout=8)  # fmt: skip
            return
        if choice is None or not assignments:
            why = self._no_dataset() if choice is None else (
                "mark the folds to average on the GPUs to predict with (space), then press p"
            )  # fmt: skip
            self.notify(why, severity="warning", timeout=8)
            return
        defaults = form_defaults(app_of(self).config.roots, choice, assignments, choice.plans)
        simulated = bool(getattr(app_of(self).snapshot, "simulated", False))
        self.app.push_screen(PredictScreen(defaults, simulated))

    def action_cluster(self) -> None:
        """x: the cluster target, with the dataset and the folds marked on the board."""
        from app.screens.cluster_form import open_cluster_form

        open_cluster_form(self)
