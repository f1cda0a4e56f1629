"""nnU-Net's text training log, read incrementally: per-epoch points, EMA, ETA.

nnU-Net 2.8.1 (`nnUNetTrainer.print_to_log_file`) writes one `training_log_<Y_M_D_H_M_S>.txt`
per start of `nnUNetv2_train` in the fold folder; every line is `<datetime>: <args...> `
(each argument followed by a space; written with one `write()` per argument, so a reader can
see half a line: only complete lines are parsed, through tail.ByteTail). Per epoch:

    2026-12-01 15:53:58.565691: Epoch 0
    2026-12-01 15:53:58.565978: Current learning rate: 0.01
    2026-12-01 15:54:08.281547: train_loss 1.3503
    2026-12-01 15:54:08.281830: val_loss 1.2323
    2026-12-01 15:54:08.281884: Pseudo dice [np.float32(0.169), np.float32(0.0074)]
    2026-12-01 15:54:08.281948: Epoch time: 9.75 s
    2026-12-01 15:54:08.281998: Yayy! New best EMA pseudo Dice: 0.08820000290870667

(numpy < 2 prints `[0.169, 0.0074]`; a class without foreground prints `nan`). After the
last epoch: `Training done.`, then validation lines and `Mean Validation Dice:  0.35`.
The log never states num_epochs: nnU-Net writes it to `debug.json` (`"num_epochs": "1000"`,
with `"log_file"` naming the log of that start), else variants say it in their name
(`nnUNetTrainer_250epochs`), else it is nnU-Net's default of 1000.

The EMA is computed as nnU-Net's logger does (first mean, then 0.9 * previous + 0.1 *
mean); a "New best EMA" line gives nnU-Net's own value and replaces the computed one.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from app.services.tail import ByteTail

DEFAULT_NUM_EPOCHS = 1000  # nnUNetTrainer.__init__: self.num_epochs = 1000
EMA_MOMENTUM = 0.9  # nnunet_logger: ema = prev * 0.9 + 0.1 * mean_fg_dice
RECENT_EPOCHS = 10  # the ETA uses the median epoch period of this many last epochs
LOG_GLOB = "training_log_*.txt"
DEBUG_FILE = "debug.json"
STARTING_PHASE = "starting"  # TrainingLog.phase before its first epoch (not a job state)
MAX_DEBUG_BYTES = 4 << 20

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?): (.*)$")
_LOG_NAME = re.compile(r"^training_log_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)\.txt$")
_NP_SCALAR = re.compile(r"np\.float\d*\(([^()]*)\)")
_EPOCHS_IN_NAME = re.compile(r"_(\d+)epochs?(?:_|$)")


@dataclass
class LogEpoch:
    """What one log says about one epoch (complete once `epoch_time_s` is set)."""

    epoch: int
    started_at: float | None = None  # the "Epoch N" line's time (the log's local clock)
    lr: float | None = None
    train_loss: float | None = None
    val_loss: float | None = None
    dice_per_class: tuple[float, ...] = ()
    epoch_time_s: float | None = None
    best_ema: float | None = None  # nnU-Net's own EMA, printed when it is a new best


@dataclass(frozen=True)
class EpochStats:
    """One finished epoch of the run, as the views show it (NaN where the log said nan)."""

    epoch: int
    train_loss: float
    val_loss: float
    dice_per_class: tuple[float, ...]
    mean_fg_dice: float
    ema_fg_dice: float
    lr: float
    epoch_time_s: float
    period_s: float | None  # start to next start (adds checkpoint and plot time); None: last


def _float(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None


def parse_dice_list(text: str) -> tuple[float, ...] | None:
    """`[np.float32(0.169), np.float32(nan)]` or `[0.169, nan]` -> (0.169, nan)."""
    inner = _NP_SCALAR.sub(r"\1", text.strip())
    if not (inner.startswith("[") and inner.endswith("]")):
        return None
    values = []
    for part in inner[1:-1].split(","):
        if not part.strip():
            continue
        value = _float(part)
        if value is None:
            return None
        values.append(value)
    return tuple(values)


def log_name_time(path: Path) -> tuple[int, ...] | None:
    """(year, month, day, hour, minute, second) from a training log's name (its start)."""
    match = _LOG_NAME.match(path.name)
    return tuple(int(g) for g in match.groups()) if match else None


def _line_time(stamp: str) -> float | None:
    for fmt in ("%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S"):
        try:
            return datetime.strptime(stamp, fmt).timestamp()
        except ValueError:
            continue
    return None


class TrainingLog(ByteTail):
    """One training_log_*.txt, parsed incrementally (complete lines only)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)  # no backlog: every epoch of the file is needed
        self.epochs: dict[int, LogEpoch] = {}
        self.phase = STARTING_PHASE  # starting | training | validating | done
        self.final_dice: float | None = None
        self.num_unparsed = 0  # epoch lines whose value did not parse (a format we don't know)
        self._current: LogEpoch | None = None

    def poll(self) -> bool:
        """Read what was appended; True when anything was parsed (or the file restarted)."""
        changed = False
        while True:
            lines = self._new_lines()
            if self.reset:
                self.epochs.clear()
                self.phase, self.final_dice, self._current = STARTING_PHASE, None, None
                changed = True
            for raw in lines:
                changed |= self._line(raw.decode(errors="replace").rstrip("\r"))
            if not self.more:
                return changed

    def _line(self, line: str) -> bool:
        match = _LINE.match(line)
        if match is None:
            return False
        stamp, message = match.group(1), match.group(2).strip()
        if message.startswith("Epoch ") and message[6:].isdigit():
            epoch = int(message[6:])
            self._current = self.epochs[epoch] = LogEpoch(epoch, started_at=_line_time(stamp))
            self.phase = "training"
            return True
        if message == "Training done.":
            self.phase, self._current = "validating", None
            return True
        if message.startswith("Mean Validation Dice:"):
            self.final_dice = _float(message.split(":", 1)[1])
            self.phase = "done"
            return True
        return self._epoch_value(message)

    def _epoch_value(self, message: str) -> bool:
        current = self._current
        if current is None:
            return False
        key, _, rest = message.partition(" ")
        value: object = None
        if message.startswith("Current learning rate:"):
            current.lr = value = _float(message.split(":", 1)[1])
        elif key in ("train_loss", "val_loss"):
            value = _float(rest)
            setattr(current, key, value)
        elif message.startswith("Pseudo dice"):
            value = parse_dice_list(message[len("Pseudo dice") :])
            current.dice_per_class = value or ()
        elif message.startswith("Epoch time:"):
            current.epoch_time_s = value = _float(message.split(":", 1)[1].removesuffix("s"))
        elif message.startswith("Yayy! New best EMA pseudo Dice:"):
            current.best_ema = value = _float(message.split(":", 1)[1])
        else:
            return False
        if value is None:
            self.num_unparsed += 1
        return True


def sorted_logs(fold_dir: Path) -> list[Path]:
    """The fold folder's training logs, oldest start first (name time, then mtime)."""

    def key(path: Path) -> tuple:
        try:
            mtime = path.stat().st_mtime
        except OSError:
            mtime = 0.0
        return (log_name_time(path) or (0,), mtime)

    try:
        return sorted((p for p in fold_dir.glob(LOG_GLOB) if p.is_file()), key=key)
    except OSError:
        return []


def merge_history(logs: list[TrainingLog]) -> list[EpochStats]:
    """The run's finished epochs over its logs (oldest first): a later start (`--c`, or a
    fresh run in the same folder) replaces the epochs it trains again."""
    merged: dict[int, tuple[int, LogEpoch]] = {}  # epoch -> (index of its log, point)
    for index, log in enumerate(logs):
        if log.epochs:
            first = min(log.epochs)
            merged = {e: p for e, p in merged.items() if e < first}
        merged.update({e: (index, p) for e, p in log.epochs.items() if p.epoch_time_s is not None})
    stats: list[EpochStats] = []
    for epoch in sorted(merged):
        source, point = merged[epoch]
        stats.append(_stats(point, stats[-1] if stats else None, _period(merged, epoch, source)))
    return stats


def _period(merged: dict[int, tuple[int, LogEpoch]], epoch: int, source: int) -> float | None:
    """Start of this epoch to the start of the next one, both in the same log (a restart
    in between is not epoch time)."""
    nxt = merged.get(epoch + 1)
    if nxt is None or nxt[0] != source:
        return None
    start, next_start = merged[epoch][1].started_at, nxt[1].started_at
    return None if start is None or next_start is None else next_start - start


def _stats(point: LogEpoch, previous: EpochStats | None, period: float | None) -> EpochStats:
    mean = _nanmean(point.dice_per_class)
    if previous is None or previous.epoch != point.epoch - 1:
        ema = mean  # nnU-Net's first value (or a gap in the logs: restart the average)
    else:
        ema = EMA_MOMENTUM * previous.ema_fg_dice + (1 - EMA_MOMENTUM) * mean
    if point.best_ema is not None:
        ema = point.best_ema  # nnU-Net's own number (rounded to 4 decimals)
    return EpochStats(
        epoch=point.epoch, train_loss=_nan(point.train_loss), val_loss=_nan(point.val_loss),
        dice_per_class=point.dice_per_class, mean_fg_dice=mean, ema_fg_dice=ema,
        lr=_nan(point.lr), epoch_time_s=_nan(point.epoch_time_s), period_s=period,
    )  # fmt: skip


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _nanmean(values: tuple[float, ...]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.fmean(finite) if finite else math.nan


def median_epoch_s(stats: list[EpochStats]) -> float | None:
    """Median time per epoch over the last RECENT_EPOCHS: start-to-start where known (it
    includes nnU-Net's checkpoint and progress.png time), else the logged epoch time."""
    recent = [s.period_s if s.period_s is not None else s.epoch_time_s for s in stats]
    recent = [v for v in recent[-RECENT_EPOCHS:] if math.isfinite(v) and v > 0]
    return statistics.median(recent) if recent else None


def eta_s(stats: list[EpochStats], num_epochs: int) -> float | None:
    """Seconds until the last epoch ends (final validation not included)."""
    per_epoch = median_epoch_s(stats)
    if per_epoch is None:
        return None
    done = stats[-1].epoch + 1 if stats else 0
    return max(0, num_epochs - done) * per_epoch


@dataclass(frozen=True)
class Schedule:
    num_epochs: int
    source: str  # "debug.json" | "trainer name" | "default"
    iterations_per_epoch: int | None = None


@dataclass
class DebugCache:
    mtime_ns: int = -1
    data: dict = field(default_factory=dict)


def read_schedule(fold_dir: Path, log_path: Path, trainer: str, cache: DebugCache) -> Schedule:
    """num_epochs of the start that writes `log_path` (debug.json only when it names it)."""
    debug = _read_debug(fold_dir / DEBUG_FILE, cache)
    if Path(str(debug.get("log_file", ""))).name == log_path.name:
        epochs = _int(debug.get("num_epochs"))
        if epochs is not None:
            return Schedule(epochs, "debug.json", _int(debug.get("num_iterations_per_epoch")))
    match = _EPOCHS_IN_NAME.search(trainer)
    if match:
        return Schedule(int(match.group(1)), "trainer name")
    return Schedule(DEFAULT_NUM_EPOCHS, "default")


def _read_debug(path: Path, cache: DebugCache) -> dict:
    try:
        stat = path.stat()
        if stat.st_mtime_ns == cache.mtime_ns:
            return cache.data
        if stat.st_size > MAX_DEBUG_BYTES:
            return {}
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    cache.mtime_ns, cache.data = stat.st_mtime_ns, data if isinstance(data, dict) else {}
    return cache.data


def _int(value: object) -> int | None:
    try:
        number = int(str(value))
    except ValueError:
        return None
    return number if number > 0 else None
