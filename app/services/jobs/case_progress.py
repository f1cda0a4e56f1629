"""A prediction job's progress from its events (trainer.prediction_events): cases done of
its part, seconds per case, time left. Plain data, fed by jobs/views.py with this job's records."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field
from typing import Any

from trainer.schema.events import Kind

RECENT_CASES = 8  # seconds per case: the median of the latest intervals


@dataclass
class CaseProgress:
    num_cases: int | None = None  # this part's cases, those done before included
    num_skipped: int = 0  # done by an earlier run (--continue_prediction)
    num_predicted: int = 0  # by this run
    last_case: str | None = None
    _started_t: float | None = None
    _case_t: list[float] = field(default_factory=list)  # recent case_predicted times
    _first_seconds: float | None = None

    def absorb(self, record: dict[str, Any]) -> None:
        """One record of this job's run (a new `prediction_started`: give a fresh object)."""
        kind = record["kind"]
        if kind == Kind.PREDICTION_STARTED:
            self.num_skipped = record.get("num_skipped", 0)
            self.num_cases = record["num_cases"] + self.num_skipped
            self._started_t = record["t"]
        elif kind == Kind.CASE_PREDICTED:
            self.num_predicted = max(self.num_predicted, record.get("index", 0))
            self.last_case = record["case"]
            if self._first_seconds is None:
                self._first_seconds = record.get("seconds")
            self._case_t = [*self._case_t, record["t"]][-(RECENT_CASES + 1) :]

    @property
    def num_done(self) -> int | None:
        return None if self.num_cases is None else self.num_skipped + self.num_predicted

    @property
    def seconds_per_case(self) -> float | None:
        """Wall time between finished cases (reading and writing overlap with predicting,
        so a case's own seconds overstate it); the first case's own until two are done."""
        times = self._case_t
        if len(times) >= 2:
            return statistics.median(b - a for a, b in itertools.pairwise(times))
        return self._first_seconds

    def eta_s(self) -> float | None:
        per_case, done = self.seconds_per_case, self.num_done
        if per_case is None or done is None or self.num_cases is None:
            return None
        return max(0, self.num_cases - done) * per_case
