"""Every screen's key bindings, in one leaf module.

The screens bind them and the help screen lists them; keeping them here (importing only
textual) lets help, dashboard and job detail use each other's keys without importing each
other (no import cycle).
"""

from __future__ import annotations

from textual.binding import Binding

DASHBOARD_NAV = [
    Binding("enter", "detail", "Detail", id="detail"),
    Binding("question_mark", "help", "Help", key_display="?", id="help"),
    Binding("q", "quit", "Quit", tooltip="leave nnui; jobs keep running", id="quit"),
    # View toggles (they change nothing but the screen, so read-only has them too).
    Binding("c", "gpu_commands", "GPU commands", id="gpu-commands", show=False),
    Binding("u", "gpu_sort", "Sort GPU procs", id="gpu-sort", show=False),
    Binding("t", "toggle_theme", "Light/dark", id="theme", show=False),
]
DASHBOARD_ACTIONS = [
    Binding("l", "launch", "Launch", id="launch"),
    Binding("s", "stop", "Stop", id="stop"),
    Binding("r", "resume", "Resume", id="resume"),
    Binding("k", "kill", "Kill", id="kill"),
]
ACTION_IDS = frozenset(b.id for b in DASHBOARD_ACTIONS)
# Views of the job list (read-only too); after the actions so a narrow footer keeps those.
DASHBOARD_VIEW = [
    Binding("slash", "filter", "Filter", key_display="/", id="filter"),
    Binding("o", "sort", "Sort", id="sort"),
    Binding("v", "cross_validation", "Cross-validation", id="cv"),
    Binding("escape", "clear_filter", "Clear filter", show=False, id="filter-clear"),
]

DETAIL_NAV = [
    Binding("escape", "back", "Back", id="detail-back"),
    Binding("o", "overlay", "All folds", id="detail-overlay"),
    Binding("m", "smooth", "Smoothing", id="detail-smooth"),
    Binding("question_mark", "help", "Help", key_display="?", id="detail-help"),
]
DETAIL_ACTIONS = [
    Binding("s", "stop", "Stop", id="detail-stop"),
    Binding("r", "resume", "Resume", id="detail-resume"),
    Binding("k", "kill", "Kill", id="detail-kill"),
]

# The cross-validation view (v on the dashboard); queueing is an action (not read-only).
CV_NAV = [Binding("escape", "back", "Back", id="cv-back")]
CV_ACTIONS = [Binding("m", "queue_missing", "Queue missing/failed folds", id="cv-queue")]

# The keys that move focus into or out of the flags field are priority bindings: they run
# when the app takes the key, in key order, so every later key goes to the widget that has
# focus after them (app/widgets/key_order.py). The launch screen enables each one only where
# it applies (LaunchScreen.check_action): `f` types an f inside the field.
LAUNCH = [
    Binding("escape", "cancel", "Back", id="launch-back", priority=True),
    Binding("g", "go", "Go: start", id="launch-go"),
    Binding("e", "toggle_engine", "Engine nnui/nnU-Net", id="launch-engine"),
    Binding("m", "toggle_launcher", "spawn/torchrun", id="launch-ddp"),
    Binding("c", "toggle_resume", "Resume --c", id="launch-resume"),
    Binding("w", "toggle_when_free", "When free", id="launch-when-free"),
    Binding("f", "focus_flags", "Trainer flags", id="launch-flags", priority=True),
    Binding("p", "predict", "Predict on these GPUs", id="launch-predict"),
    Binding("x", "cluster", "Cluster (SLURM)", id="launch-cluster"),
    Binding("enter", "leave_flags", "Done", id="launch-flags-done", priority=True),
]

# The cluster form (x on the board): enter reviews the exact scripts, then submits.
CLUSTER = [
    Binding("escape", "cancel", "Back", id="cluster-back", priority=True),
    Binding("enter", "go", "Review the scripts", id="cluster-go"),
    Binding("ctrl+r", "toggle_requeue", "Requeue on/off", id="cluster-requeue", priority=True),
]

# The prediction form (opened with p on the board): its fields take every printable key, so
# its toggles are ctrl keys; enter in any field (or on the button) reviews and starts.
PREDICT = [
    Binding("escape", "cancel", "Back", id="predict-back", priority=True),
    Binding("enter", "go", "Review and start", id="predict-go"),
    Binding("ctrl+t", "toggle_tta", "TTA on/off", id="predict-tta", priority=True),
    Binding("ctrl+n", "toggle_probabilities", "Save probabilities (.npz)", id="predict-npz",
            priority=True),
]  # fmt: skip
