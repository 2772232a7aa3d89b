#!/usr/bin/env bash
# The LM Muon end-to-end check (README.md here), unattended and restartable: tune on seed 300 beside the queues, then
# the report seeds with the queues paused. Run from the repository root of a checkout of the protocol's commit:
#   setsid nohup bash docs/results/time_to_loss/end_to_end_muon/run.sh >> /work/ttl_wc_muon.log 2>&1 < /dev/null &
set -euo pipefail
OUT=${OUT:-/work/ttl_wc_muon}
QUIET=${QUIET:-/work/QUIET}
QUEUES='convergence\.(time_to_loss|auto_v2_test) one'  # the queues' running jobs
PYTHON=${PYTHON:-python}
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 WANDB_MODE=offline PYTHONPATH=$PWD

"$PYTHON" -m benchmarks.convergence.ttl_wallclock tune --task lm --optimizer muon --out "$OUT/tune"

resume() { pkill -CONT -f "$QUEUES" || true; rm -f "$QUIET"; }
trap resume EXIT
touch "$QUIET"                     # the queues wait at their next evaluation ...
pkill -STOP -f "$QUEUES" || true   # ... and their running jobs stop now (their curves do not depend on it)
"$PYTHON" -m benchmarks.convergence.ttl_wallclock run --task lm --optimizer muon --out "$OUT/runs" --against 1f1b,bp \
    --choices "$OUT/tune/choices.json"
echo "$(date '+%F %T') done"
