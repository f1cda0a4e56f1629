"""Dataset picker: preprocessed datasets x plans x configurations with patch size, global
batch size and the existing result of every fold. Renders `DatasetInfo`s it is given; the
highlighted row chooses the dataset, the plans (e.g. nnUNetPlans or nnUNetResEncUNetLPlans)
and the configuration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.message import Message
from textual.widgets import DataTable

from app.services.launch.catalog import DatasetInfo
from app.widgets.formatting import readable_style
from trainer.schema.tree import DEFAULT_PLANS, FOLDS

RESULT_STYLES = {"finished": "bold blue", "running": "green", "stopped": "yellow", "failed": "red"}


@dataclass(frozen=True)
class Choice:
    dataset: str
    configuration: str
    batch_size: int
    patch_size: tuple[int, ...]
    results: dict[str, str]  # fold -> state
    plans: str = DEFAULT_PLANS
    previous_stage: str | None = None  # a cascade: the stage whose folds it needs first

    @property
    def configuration_text(self) -> str:
        after = f" (after {self.previous_stage} folds 0-4)" if self.previous_stage else ""
        return f"{self.configuration}{after}"


def choices_of(datasets: Sequence[DatasetInfo]) -> list[Choice]:
    out = []
    for info in datasets:
        for conf in info.configurations:
            results = {f: s for (c, f), s in info.results.items() if c == conf.name}
            plans = getattr(info, "plans", DEFAULT_PLANS)
            patch = tuple(conf.patch_size)
            previous = getattr(conf, "previous_stage", None)
            out.append(
                Choice(info.name, conf.name, conf.batch_size, patch, results, plans, previous)
            )
    return out


class DatasetPicker(DataTable):
    """One row per (dataset, plans, configuration); the highlighted row is the choice."""

    class Chosen(Message):
        def __init__(self, choice: Choice | None) -> None:
            super().__init__()
            self.choice = choice

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", **kwargs)
        self.choices: list[Choice] = []

    def on_mount(self) -> None:
        self.add_column("dataset", key="dataset")
        self.add_column("plans", key="plans")
        self.add_column("configuration", key="configuration")
        self.add_column("patch", key="patch")
        self.add_column("batch", key="batch")
        for fold in FOLDS:
            self.add_column(f"f{fold}", key=f"fold-{fold}")

    def show(self, datasets: Sequence[DatasetInfo]) -> None:
        self.clear()
        self.choices = choices_of(datasets)
        for i, choice in enumerate(self.choices):
            cells: list[Any] = [
                choice.dataset,
                choice.plans,
                choice.configuration_text,
                "x".join(str(s) for s in choice.patch_size),
                str(choice.batch_size),
            ]
            for fold in FOLDS:
                state = choice.results.get(fold)
                style = RESULT_STYLES.get(state or "", "dim")
                cells.append(Text(state or "-", style=readable_style(style, self.app.no_color)))
            self.add_row(*cells, key=str(i))
        self.post_message(self.Chosen(self.current))

    @property
    def current(self) -> Choice | None:
        if not self.choices:
            return None
        return self.choices[min(self.cursor_row, len(self.choices) - 1)]

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        self.post_message(self.Chosen(self.current))
