"""`nnui sbatch`: write (optionally submit) a SLURM script for one fold (docs/shared-box.md).

Standard library only. The script asks SLURM for a USR1 some minutes before the time limit
(`--signal=B:USR1@LEAD`) and turns it into a graceful stop of the trainer workers, so the
next submission of the same script resumes with `--c` (always passed: without a checkpoint
the trainer simply starts fresh).

Signal path, and why (facts in shared/notes/slurm-local.md):
- `B:` delivers USR1 to the batch shell only. The shell traps it (the trap only records it)
  and relays it with `kill -USR1` to its `srun`, which relays it to the tasks of the step:
  one small wrapper shell per node.
- Each node's wrapper traps USR1 too and started torchrun with USR1 *ignored*
  (`(trap '' USR1; exec python -m torch.distributed.run ...) &`): torchrun has no handler
  and would die of it (exit 138), orphaning its workers. The wrapper signals torchrun's
  direct children - the workers - and nothing else. Any process that receives USR1 from
  SLURM's own step signalling is therefore either a worker (graceful stop), torchrun
  (ignored) or a wrapper (recorded).
- A USR1 that arrives before the workers exist is not lost: the wrappers send it to each
  worker only once that worker catches SIGUSR1 (bit 10 of SigCgt in /proc/PID/status), and
  the batch shell relays only once the step runs. Duplicates are harmless (the trainer's
  handler only sets a flag).
- Bash runs a trap only between commands, and `wait` returns early when one runs: both
  shells poll their child with a short interruptible `sleep 1 & wait $!` loop and collect
  its exit status at the end.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from app.services.launch.engines import ENGINES, NNUI, NNUNET, engine
from app.services.launch.trainer_flags import flag_value, without_flags
from app.services.slurm.requeue import requeue_parts
from trainer.schema.atomic import atomic_write_text
from trainer.schema.tree import (
    FOLDS,
    ROOT_ENVS,
    checkpoint_file,
    find_dataset,
    resolve_roots,
    run_dir,
)

_TIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")
_NAME = re.compile(r"[^A-Za-z0-9_.-]+")


def time_limit_s(text: str) -> int:
    """Seconds in a validated [D-]HH:MM:SS."""
    days, _, clock = text.rpartition("-")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


@dataclass(frozen=True)
class JobSpec:
    """Everything the job script depends on, validated once."""

    dataset: str
    configuration: str
    fold: str
    nodes: int
    gpus_per_node: int
    time_limit: str  # [D-]HH:MM:SS
    procs_per_node: int  # CPU runs (gpus_per_node == 0) only
    signal_lead_s: int = 600
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    output_dir: Path = Path("nnui_slurm")
    workdir: Path = Path(".")
    python: str = sys.executable
    # Multi-node rendezvous port; None: 20000 + job id mod 20000 (two jobs on one node never
    # share one). A one-node job is --standalone (torchrun picks a free port itself).
    rdzv_port: int | None = None
    trainer_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # exported at the top of the script
    engine: str = NNUI  # "nnunet": the real nnU-Net with nnui's extension, one node
    # --requeue: at the time-limit lead the job checkpoints and submits itself again
    # (slurm_requeue.py); run_folder tells it whether the fold finished meanwhile.
    requeue: bool = False
    run_folder: Path | None = None

    @property
    def script_path(self) -> Path:
        return self.output_dir / f"{self.job_name}.sbatch"

    @property
    def nproc_per_node(self) -> int:
        return self.gpus_per_node if self.gpus_per_node > 0 else self.procs_per_node

    @property
    def job_name(self) -> str:
        return _NAME.sub("_", f"nnui_{self.dataset}_{self.configuration}_{self.fold}")

    def validate(self) -> None:
        if self.fold not in FOLDS:
            raise ValueError(f"fold {self.fold!r} is not one of {', '.join(FOLDS)}")
        if self.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if self.procs_per_node < 1:
            raise ValueError(f"--procs-per-node must be >= 1, got {self.procs_per_node}")
        if not _TIME.match(self.time_limit):
            raise ValueError(
                f"--time must look like HH:MM:SS or D-HH:MM:SS, got {self.time_limit!r}"
            )
        if self.signal_lead_s < 0:
            raise ValueError(f"--signal-lead must be >= 0 seconds, got {self.signal_lead_s}")
        if self.signal_lead_s >= time_limit_s(self.time_limit):
            raise ValueError(
                f"--signal-lead {self.signal_lead_s} s is not shorter than --time "
                f"{self.time_limit}: the job would be told to stop as soon as it starts"
            )
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ValueError(f"--cpus-per-task must be >= 1, got {self.cpus_per_task}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == NNUNET and self.nodes != 1:
            raise ValueError(
                "nnU-Net trains on one node (-num_gpus): use --nodes 1 with --engine nnunet"
            )
        if self.requeue and self.run_folder is None:
            raise ValueError(
                "--requeue needs the fold's run folder: drop --no-check so nnui can find the "
                "dataset here"
            )
        for flag in ("-num_gpus", "--c", "-device"):
            if flag in self.trainer_args:
                raise ValueError(
                    f"do not pass {flag} after --: the job script sets it (torchrun decides the "
                    "number of processes, --c is always on, -device follows --gpus-per-node)"
                )


def _sbatch_header(spec: JobSpec) -> list[str]:
    out = spec.output_dir.absolute()
    lines = [
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={spec.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={spec.time_limit}",
        f"#SBATCH --signal=B:USR1@{spec.signal_lead_s}",
        f"#SBATCH --output={out}/{spec.job_name}_%j.out",
        f"#SBATCH --chdir={spec.workdir.absolute()}",
    ]
    if spec.gpus_per_node > 0:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    if spec.cpus_per_task is not None:
        lines.append(f"#SBATCH --cpus-per-task={spec.cpus_per_task}")
    if spec.partition:
        lines.append(f"#SBATCH --partition={spec.partition}")
    if spec.account:
        lines.append(f"#SBATCH --account={spec.account}")
    return lines


def trainer_command(spec: JobSpec) -> list[str]:
    """The per-node torchrun command line; $-variables are expanded on each node."""
    device = "cuda" if spec.gpus_per_node > 0 else "cpu"
    if spec.engine == NNUNET:
        return nnunet_command(spec, device)
    return [
        spec.python, "-m", "torch.distributed.run",
        *_rendezvous(spec),
        f"--nproc_per_node={spec.nproc_per_node}",
        "-m", "trainer", spec.dataset, spec.configuration, spec.fold,
        "--c", "-device", device, *spec.trainer_args,
    ]  # fmt: skip


def _rendezvous(spec: JobSpec) -> list[str]:
    if spec.nodes == 1:
        return ["--standalone", "--nnodes=1"]
    return ["--nnodes=$SLURM_NNODES", "--rdzv_backend=c10d",
            "--rdzv_endpoint=$NNUI_HEAD:$NNUI_PORT", "--rdzv_id=$SLURM_JOB_ID"]  # fmt: skip


def nnunet_command(spec: JobSpec, device: str) -> list[str]:
    """nnU-Net's nnUNetv2_train entry with nnui's extension trainer (-num_gpus for >1 GPU)."""
    chosen = engine(NNUNET)
    trainer = chosen.trainer_arg(flag_value(spec.trainer_args, "-tr") or chosen.default_trainer)
    plans = flag_value(spec.trainer_args, "-p") or chosen.default_plans
    rest = without_flags(spec.trainer_args, ("-tr", "-p"))
    extra = ["-num_gpus", str(spec.nproc_per_node)] if spec.nproc_per_node > 1 else []
    return [
        spec.python, "-m", "trainer.nnunet_engine", spec.dataset, spec.configuration,
        spec.fold, "-tr", trainer, "-p", plans, "--c", "-device", device, *rest, *extra,
    ]  # fmt: skip


def _quote_keep_vars(word: str) -> str:
    """Shell-quote a word but let $NAME references expand (double quotes)."""
    if "$" in word:
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`") + '"'
    return shlex.quote(word)


# One wrapper per node (an srun task): starts torchrun with USR1 ignored and passes USR1 on
# to torchrun's workers only, once each of them catches it. (For the nnU-Net engine the
# "torchrun" is nnU-Net's process: itself the worker on one GPU, its ranks' parent with
# -num_gpus; __KIDS__ names the workers.)
_NODE_STEP = r"""set -u
stop=0
trap 'stop=1' USR1
(trap '' USR1; exec __TORCHRUN__) &
torchrun_pid=$!
sent=" "
catches_usr1() {  # SigCgt bit 10 (SIGUSR1) of a pid
  local mask
  mask=$(awk '/^SigCgt:/ {print $2}' "/proc/$1/status" 2>/dev/null) || return 1
  [ -n "$mask" ] && (( (16#$mask >> 9) & 1 ))
}
forward_usr1() {  # returns 0 once every worker got it
  local kid caught=0
  for kid in $(__KIDS__); do
    case "$sent" in *" $kid "*) caught=$((caught + 1)); continue ;; esac
    if catches_usr1 "$kid"; then
      kill -USR1 "$kid" 2>/dev/null && sent="$sent$kid " && caught=$((caught + 1))
    fi
  done
  [ "$caught" -ge __NPROC__ ]
}
while kill -0 "$torchrun_pid" 2>/dev/null; do
  if [ "$stop" = 1 ]; then
    if forward_usr1; then
      echo "nnui: node $(hostname -s): USR1 -> workers of torchrun $torchrun_pid:$sent" >&2
      stop=0
      sent=" "
    fi
  fi
  sleep 1 & wait $! 2>/dev/null
done
wait "$torchrun_pid"
"""

_BATCH_BODY = r"""set -u
stop=0
__PRELUDE__trap 'stop=1__ON_USR1__' USR1
NNUI_HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
NNUI_PORT=__PORT__
export NNUI_HEAD NNUI_PORT
echo "nnui: job $SLURM_JOB_ID on $SLURM_NNODES node(s), rendezvous $NNUI_HEAD:$NNUI_PORT" >&2
read -r -d '' NNUI_NODE_STEP <<'NNUI_NODE_STEP_END'
__NODE_STEP__NNUI_NODE_STEP_END
srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
  bash -c "$NNUI_NODE_STEP" &
srun_pid=$!
step_running() {
  scontrol -o show step "$SLURM_JOB_ID.0" 2>/dev/null | grep -q 'State=RUNNING'
}
while kill -0 "$srun_pid" 2>/dev/null; do
  if [ "$stop" = 1 ] && step_running__MAY_STOP__; then
    echo "nnui: USR1 -> srun $srun_pid (relayed to every node's wrapper)" >&2
    kill -USR1 "$srun_pid" 2>/dev/null
    stop=0
  fi
  sleep 1 & wait $! 2>/dev/null
done
wait "$srun_pid"
rc=$?
echo "nnui: training step ended with exit code $rc" >&2
__AFTER_STEP__exit "$rc"
"""


def render_script(spec: JobSpec) -> str:
    spec.validate()
    torchrun = " ".join(_quote_keep_vars(word) for word in trainer_command(spec))
    single_nnunet = spec.engine == NNUNET and spec.nproc_per_node == 1
    kids = 'echo "$torchrun_pid"' if single_nnunet else 'pgrep -P "$torchrun_pid"'
    node_step = (
        _NODE_STEP.replace("__TORCHRUN__", torchrun)
        .replace("__NPROC__", str(spec.nproc_per_node))
        .replace("__KIDS__", kids)
    )
    exports = [f"export {name}={shlex.quote(value)}" for name, value in sorted(spec.env.items())]
    port = str(spec.rdzv_port) if spec.rdzv_port else "$((20000 + SLURM_JOB_ID % 20000))"
    body = _BATCH_BODY.replace("__NODE_STEP__", node_step).replace("__PORT__", port)
    kinds = ("final", "latest")
    names = [f"checkpoint_{k}.pth" if spec.engine == NNUNET else checkpoint_file(k) for k in kinds]
    on_usr1, prelude, may_stop, after_step = requeue_parts(
        spec.requeue, spec.script_path.absolute(), spec.run_folder, (names[0], names[1]),
        spec.signal_lead_s,
    )  # fmt: skip
    body = body.replace("__MAY_STOP__", may_stop)
    body = body.replace("__ON_USR1__", on_usr1).replace("__PRELUDE__", prelude)
    body = body.replace("__AFTER_STEP__", after_step)
    header = [
        "#!/bin/bash",
        *_sbatch_header(spec),
        f"# Written by nnui sbatch. Submit again to resume (--c); USR1 {spec.signal_lead_s} s",
        "# before the time limit stops the workers gracefully after their current epoch.",
    ]
    return "\n".join([*header, *exports, body])


class UsageError(ValueError):
    """A command-line mistake: printed as one `error:` line with a hint, exit 2."""


def check_preprocessed(spec: JobSpec) -> str:
    """The dataset's full name; UsageError unless the dataset and configuration are
    preprocessed where the job will look (the trainer's --preprocessed, else
    $nnUNet_preprocessed, else ./nnui_data).

    Reads the plans file as plain JSON: the app does not import the trainer's numpy code.
    """
    preprocessed = flag_value(spec.trainer_args, "--preprocessed") or spec.env.get(
        ROOT_ENVS["preprocessed"]
    )
    root = resolve_roots(preprocessed=preprocessed).preprocessed
    hint = "; pass --no-check if the data lives only on the cluster"
    try:
        name = find_dataset(root, spec.dataset)
    except ValueError as error:
        raise UsageError(f"{error}{hint}") from None
    chosen = engine(spec.engine)
    plans_name = flag_value(spec.trainer_args, "-p") or chosen.default_plans
    plans_path = root / name / chosen.plans_file(plans_name)
    try:
        configurations = json.loads(plans_path.read_text()).get("configurations", {})
    except (OSError, ValueError, AttributeError):
        raise UsageError(
            f"no readable plans at {plans_path}; run nnui-preprocess {name}{hint}"
        ) from None
    if spec.configuration not in configurations:
        available = ", ".join(sorted(configurations)) or "none"
        raise UsageError(
            f"configuration {spec.configuration!r} is not preprocessed for {name} "
            f"(plans have: {available}); run nnui-preprocess {name} -c {spec.configuration}"
            f"{hint}"
        )
    return name


def fold_folder(spec: JobSpec, dataset_name: str) -> Path:
    """The run folder the job trains in (its --results, else the roots it exports)."""
    chosen = engine(spec.engine)
    tr = chosen.trainer_arg(flag_value(spec.trainer_args, "-tr") or chosen.default_trainer)
    plans = flag_value(spec.trainer_args, "-p") or chosen.default_plans
    results = flag_value(spec.trainer_args, "--results") or spec.env.get(ROOT_ENVS["results"])
    root = resolve_roots(results=results).results
    return run_dir(root, dataset_name, spec.configuration, spec.fold, chosen.folder_trainer(tr),
                   plans)  # fmt: skip


def write_script(spec: JobSpec) -> Path:
    text = render_script(spec)
    spec.output_dir.mkdir(parents=True, exist_ok=True)
    path = spec.script_path
    atomic_write_text(path, text, mode=0o755)
    return path
