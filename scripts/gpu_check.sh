#!/usr/bin/env bash
# The device check of issue 14: FDG on one GPU, in under 8 minutes, written up as a Markdown report.
#
#   bash scripts/gpu_check.sh [REPORT]             # a machine with a GPU; REPORT defaults to docs/gpu_report.md
#   bash scripts/gpu_check.sh --dry-run OUT_DIR    # any machine, on the CPU: the same steps, tiny (the suite runs it)
#
# Steps (each bounded -- 460 s in all, 560 s with two GPUs -- its result in the report whatever happens):
#   1. environment   the GPU (nvidia-smi), torch, DeepSpeed, the commit
#   2. parity        the engine-vs-reference tests (K = 2 and 3, every mode, data parallel, dropout replay,
#                    bf16 and bf16 + ZeRO-1) with every rank on GPU 0 over gloo; NCCL refuses two ranks on
#                    one device, so this runs the exchange's STAGED path (Note [three ways to wait])
#   3. host reads    no host read of a tensor inside a steady-state tick (tests/test_host_sync.py), on CUDA
#   4. throughput    benchmarks/throughput.py's ResNet and transformer rows (FDG vs BP vs 1F1B), CUDA timings
# The STREAM path (NCCL, stream-ordered, watchdog) needs two GPUs; with two or more visible this
# script also runs step 5, the K = 2 parity tests over NCCL, one rank per GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
  DRY=1
  OUT=${2:?--dry-run needs an output directory}
  REPORT=$OUT/gpu_report.md
else
  REPORT=${1:-docs/gpu_report.md}
  OUT=$(mktemp -d)
fi
mkdir -p "$OUT" "$(dirname "$REPORT")"
PY=${FDG_VENV:-$ROOT/.venv}/bin/python
if [[ ! -x "$PY" ]]; then
  bash scripts/bootstrap.sh >"$OUT/bootstrap.log" 2>&1 || { echo "bootstrap failed: $OUT/bootstrap.log"; exit 1; }
  PY=$ROOT/.venv/bin/python
fi
export PYTHONPATH=$ROOT OMP_NUM_THREADS=1 WANDB_MODE=offline
if ((DRY)); then
  export DS_ACCELERATOR=cpu
  PYTEST=("$PY" -m pytest -q -p no:cacheprovider --collect-only)  # the selections resolve; nothing runs
  BENCH=(--quick --models=transformer_tiny --repeats=1 --variants=bp,1f1b_m2,fdg_current_stored)
else
  export DS_ACCELERATOR=cuda FDG_LAUNCH_DEVICES=1  # every rank on GPU 0 (fdg_schedule.launch)
  PYTEST=("$PY" -m pytest -q -rf -p no:cacheprovider)  # every failure in the report, not only the first
  BENCH=(--models=resnet32,transformer --repeats=2 --window=16 --warmup=8 --rss=)
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "no CUDA device visible: run with --dry-run on a CPU machine"; exit 1; }
fi
GPUS=$( ((DRY)) && echo 0 || nvidia-smi -L 2>/dev/null | wc -l)

RESULTS=$OUT/steps.md
: >"$RESULTS"
FAILED=0
# step NAME SECONDS COMMAND...: run, record pass/fail, time and the output's tail.
step() {
  local name=$1 limit=$2
  shift 2
  local log=$OUT/$name.log start=$SECONDS
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$? took=$((SECONDS - start)) verdict=pass
  if ((rc != 0)); then verdict="FAIL (exit $rc$( ((rc == 124)) && echo ", over ${limit} s"))"; FAILED=1; fi
  echo "$name: $verdict in ${took} s"
  {
    echo "### $name: $verdict (${took} s)"
    echo
    echo '```'
    echo "$*"
    echo '```'
    echo
    echo '<details><summary>output (last 40 lines)</summary>'
    echo
    echo '```'
    tail -n 40 "$log"
    echo '```'
    echo '</details>'
    echo
  } >>"$RESULTS"
}

PARITY="two_stages or three_stages or data_parallel or dropout or bf16"  # one_stage: bit-for-bit vs the CPU
step environment 20 bash -c "nvidia-smi 2>/dev/null || echo 'no nvidia-smi (dry run: CPU)'; \
  '$PY' -c 'import torch, deepspeed; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \
  \"deepspeed\", deepspeed.__version__)'; git log -1 --format='commit %H %cd'"
step parity 200 "${PYTEST[@]}" tests/test_engine.py -k "$PARITY"
step host_reads 60 "${PYTEST[@]}" tests/test_host_sync.py tests/test_rng.py
step throughput 180 "$PY" benchmarks/throughput.py "${BENCH[@]}" --out="$OUT/throughput"
if ((GPUS >= 2)); then  # one rank per GPU: NCCL, the stream-ordered exchange
  step nccl_parity 100 env FDG_LAUNCH_BACKEND=nccl FDG_LAUNCH_DEVICES="$GPUS" \
    "${PYTEST[@]}" tests/test_engine.py -k "two_stages"
fi

{
  echo "# Device check report"
  echo
  echo "Written by \`scripts/gpu_check.sh$( ((DRY)) && echo " --dry-run")\` on $(date -u '+%Y-%m-%d %H:%M UTC'), \
machine $(hostname), $( ((DRY)) && echo "CPU only (dry run: the selections were collected, not run)" \
|| nvidia-smi -L | head -n 4 | tr '\n' ' '), commit $(git rev-parse --short HEAD)."
  echo
  echo "Verdict: $( ((FAILED)) && echo "**some steps failed** (see below)" || echo "every step passed")."
  echo
  cat "$RESULTS"
  if [[ -f "$OUT/throughput/throughput.md" ]]; then
    echo "## Throughput"
    echo
    cat "$OUT/throughput/throughput.md"
  fi
} >"$REPORT"
echo "report: $REPORT"
exit $FAILED
