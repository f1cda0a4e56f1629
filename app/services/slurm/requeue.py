"""`--requeue` for nnui's SLURM job scripts: through time limits, losing no finished epoch.

SLURM's USR1 lead (`--signal=B:USR1@LEAD`) stops the fold gracefully (checkpoint_latest,
exit 0; script.py). With --requeue the batch shell then submits its own script again,
`--dependency=afterany:THIS_JOB`, and the next job continues with `--c`. It does so only when

- the training step ended with exit code 0 (a crash is not retried forever),
- the USR1 came within the lead window: at most LEAD + WINDOW_SLACK_S seconds before the
  time limit (SLURM sends it up to ~30 s early); an earlier USR1 is a user's stop. Such a
  lead USR1 is relayed to the workers only once this job trained an epoch (or half the lead
  is left): a job whose lead comes during its start-up would requeue with nothing trained,
- `nnui stop` left no stop mark for this job (it writes one before it signals: a user's stop
  in the last minutes is a stop, not a requeue), and
- the fold has no final checkpoint (it may have finished in the same epoch), and
- not more than MAX_IDLE_RESTARTS jobs in a row ended without a new checkpoint_latest (a
  time limit that leaves no room for an epoch after the start-up would requeue forever).

Each resubmission carries NNUI_RESTARTS (the job's environment) and the comment
`nnui-restarts=N` (squeue %k): the board shows the restarts. Jobs that wait for this one
(`afterok:THIS_JOB`, a cascade's --after-lowres) are moved on to the new one.
Standard library only.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from app.services.jobs.slurm_jobs import RESTARTS_PREFIX
from trainer.schema.tree import EVENTS_FILE

WINDOW_SLACK_S = 60
MAX_IDLE_RESTARTS = 2  # jobs in a row that finished no epoch before the lead: then stop

_ON_USR1 = '; [ -n "$heard_left" ] || heard_left=$(nnui_time_left)'

_PRELUDE = r"""heard_left=""
NNUI_SCRIPT=__SCRIPT__
nnui_began=$(mktemp)
nnui_time_left() {  # seconds until the job's time limit, when the USR1 is heard
  local end
  end=$(scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null | grep -o 'EndTime=[^ ]*' | cut -d= -f2)
  end=$(date -d "$end" +%s 2>/dev/null) || { echo 999999999; return; }
  echo $(( end - $(date +%s) ))
}
nnui_epochs() {  # epochs the fold has recorded so far
  local n
  n=$(grep -c '"kind":"epoch_ended"' __EVENTS__ 2>/dev/null)
  echo "${n:-0}"
}
nnui_epochs0=$(nnui_epochs)
nnui_may_stop() {  # a time-limit USR1 waits for this job's first epoch, while time allows
  if [ -z "$heard_left" ] || [ "$heard_left" -gt __WINDOW__ ] \
      || [ -e "$NNUI_SCRIPT.stop-$SLURM_JOB_ID" ]; then
    return 0  # a user's stop: at once
  fi
  [ "$(nnui_epochs)" -gt "$nnui_epochs0" ] || [ "$(nnui_time_left)" -le __HALF_LEAD__ ]
}
echo "nnui: --requeue on; restart ${NNUI_RESTARTS:-0} of this fold" >&2
"""

_AFTER_STEP = r"""idle=0
[ __LATEST__ -nt "$nnui_began" ] || idle=$(( ${NNUI_IDLE:-0} + 1 ))
rm -f "$nnui_began"
if [ "$rc" = 0 ] && [ -n "$heard_left" ] && [ "$heard_left" -le __WINDOW__ ] \
    && [ ! -e "$NNUI_SCRIPT.stop-$SLURM_JOB_ID" ] && [ ! -f __FINAL__ ]; then
  restarts=$(( ${NNUI_RESTARTS:-0} + 1 ))
  next=""
  if [ "$idle" -le __MAX_IDLE__ ]; then
    next=$(sbatch --parsable --dependency="afterany:$SLURM_JOB_ID" \
      --export="ALL,NNUI_RESTARTS=$restarts,NNUI_IDLE=$idle" --comment="__PREFIX__$restarts" \
      "$NNUI_SCRIPT")
    next=${next%%;*}
  else
    echo "nnui: not requeued: $idle jobs in a row finished no epoch before the USR1; raise" \
      "--time or lower --signal-lead, then submit $NNUI_SCRIPT again" >&2
  fi
  if [ -n "$next" ]; then
    echo "nnui: time limit in ${heard_left} s: requeued as job $next (restart $restarts)" >&2
    squeue -h -u "$(id -un)" -t PD -o '%i|%E' | while IFS='|' read -r dep deps; do
      plain=$(echo "$deps" | sed -e 's/([^)]*)//g')
      case ",$plain," in *"afterok:$SLURM_JOB_ID,"*) ;; *) continue ;; esac
      moved=$(echo ",$plain," | sed -e "s/afterok:$SLURM_JOB_ID,/afterok:$next,/g" \
        -e 's/^,//' -e 's/,$//')
      scontrol update JobId="$dep" Dependency="$moved" \
        && echo "nnui: job $dep now waits for $next ($moved)" >&2
    done
  elif [ "$idle" -le __MAX_IDLE__ ]; then
    echo "nnui: requeue failed: submit $NNUI_SCRIPT again to continue (--c)" >&2
  fi
fi
"""


def requeue_parts(
    requeue: bool, script: Path, run_folder: Path | None, names: tuple[str, str], lead_s: int
) -> tuple[str, str, str, str]:
    """(what the USR1 trap adds, the prelude before the step, what the relay waits for, the
    block after the step); empty strings without --requeue (the script is then exactly
    the plain one). `names`: the fold's final and latest checkpoint files."""
    if not requeue or run_folder is None:
        return "", "", "", ""
    final_checkpoint, latest = run_folder / names[0], run_folder / names[1]
    prelude = (
        _PRELUDE.replace("__SCRIPT__", shlex.quote(str(script)))
        .replace("__EVENTS__", shlex.quote(str(run_folder / EVENTS_FILE)))
        .replace("__WINDOW__", str(lead_s + WINDOW_SLACK_S))
        .replace("__HALF_LEAD__", str(lead_s // 2))
    )
    after = (
        _AFTER_STEP.replace("__WINDOW__", str(lead_s + WINDOW_SLACK_S))
        .replace("__FINAL__", shlex.quote(str(final_checkpoint)))
        .replace("__LATEST__", shlex.quote(str(latest)))
        .replace("__MAX_IDLE__", str(MAX_IDLE_RESTARTS))
        .replace("__PREFIX__", RESTARTS_PREFIX)
    )
    return _ON_USR1, prelude, " && nnui_may_stop", after


def stop_mark(script: Path, job_id: str) -> Path:
    """The file `nnui stop` writes beside the script before it signals job `job_id`."""
    return script.with_name(f"{script.name}.stop-{job_id}")
