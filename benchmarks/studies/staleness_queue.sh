#!/usr/bin/env bash
# The staleness-correction evidence of docs/results/staleness/experiment-log.md (issue 11), every grid in order,
# restartable.
#
#   export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
#   OUT=/work/results bash benchmarks/studies/staleness_queue.sh
#
# Each step skips the runs its JSON (convergence.py --reuse) or folder (lm_convergence.py) already
# holds and writes after every run, so rerunning the same command continues a stopped queue. At most
# two runs at a time (two cores). Order: what the issue's targets need first (BP and K = 4), then K = 3.
#   1. ResNet-56, Fashion-MNIST, the plateau protocol, seeds 0 1: BP (with and without warm-up), K = 4 rows
#   2. ResNet-56: BP and the best K = 4 setting of step 1 on seed 2
#   3. ResNet-20, K = 4: BP, the best K = 4 setting of step 1 and no correction, seeds 0 1 2
#   4. GPT-2 on Shakespeare, K = 4 with none / delay_lr / predict / both (weights "current", the docs'
#      runs' mode) and none / both with "stashed", BP; seeds 1234 and 1
#   5. ResNet-56, K = 3 rows, seeds 0 1; then BP and the best K = 3 setting on seed 2
#   6. GPT-2, K = 3 with none / delay_lr / predict / both, seed 1234
# K >= 3 (and here every ResNet run, BP included) runs on fdg_reference in one process; K = 2 runs with
# corrections need the engine's implementation and are not in this queue.
set -uo pipefail
OUT=${OUT:-runs/staleness}
PYTHON=${PYTHON:-python}
T_RESNET=${T_RESNET:-1024}  # delay_lr_ticks: 8 epochs of 128 ticks, the first learning-rate phase
GAMMA=${GAMMA:-0.9}         # predict_decay
WARMUP=${WARMUP:-2}         # epochs at 0.1 x lr
T_LM=${T_LM:-400}           # delay_lr_ticks for the 800-tick GPT-2 runs
mkdir -p "$OUT"

protocol=(--epochs 16 --train-subset 4096 --test-subset 2000 --micro-batch 32 --final-full-test
          --backend reference --jobs 2 --timeout 172800 --reuse)

grid() {  # grid NAME MODEL SEEDS... -- VARIANTS...
  local name=$1 model=$2; shift 2
  local seeds=(); while [ "$1" != "--" ]; do seeds+=("$1"); shift; done; shift
  local variants=(); for v in "$@"; do variants+=(--variant "$v"); done
  mkdir -p "$OUT/$name"
  echo "$(date '+%F %T') $name: $(( ${#variants[@]} / 2 )) variants x seeds ${seeds[*]}"
  for attempt in 1 2; do  # the second call runs again what a signal (the OOM killer) stopped, if anything
    "$PYTHON" -m benchmarks.convergence.convergence --model "$model" "${protocol[@]}" --seeds "${seeds[@]}" \
      --out "$OUT/$name/convergence" "${variants[@]}" >> "$OUT/$name/log.txt" 2>&1
  done
}

best() {  # best NAME K: the --variant spec of the K-stage row with the lowest mean final test error
  "$PYTHON" - "$OUT/$1/convergence.json" "$2" <<'EOF'
import json, sys
results = json.load(open(sys.argv[1]))["results"]
def score(result):
    runs = result["runs"]
    if len(runs) < 2 or any("failed" in r for r in runs):
        return None  # must train on every seed
    return sum(r.get("full_test_error", r["test_error"][-1]) for r in runs) / len(runs)
rows = [(score(r), r["spec"]) for r in results if r["stages"] == int(sys.argv[2]) and score(r) is not None]
print(min(rows)[1] if rows else "")
EOF
}

fdg() { echo "fdg:$1:1:stashed${2:+:$2}"; }  # fdg K [options]
corrections() {  # the screen's rows at K stages
  local K=$1
  echo "$(fdg "$K" "warmup=$WARMUP,delay_lr=$T_RESNET,predict=$GAMMA")"
  echo "$(fdg "$K" "warmup=$WARMUP,predict=$GAMMA")"
  echo "$(fdg "$K" "warmup=$WARMUP,delay_lr=$T_RESNET")"
  echo "$(fdg "$K" "warmup=$WARMUP")"
  echo "$(fdg "$K" "delay_lr=$T_RESNET,predict=$GAMMA")"
  echo "$(fdg "$K" "delay_lr=$T_RESNET")"
  echo "$(fdg "$K" "predict=$GAMMA")"
  echo "$(fdg "$K")"
}

# 1. ResNet-56, BP and K = 4
mapfile -t k4 < <(corrections 4)
grid resnet56 resnet56 0 1 -- BP "BP:warmup=$WARMUP" "${k4[@]}" \
  "fdg:4:0.5:stashed:warmup=$WARMUP,delay_lr=$T_RESNET,predict=$GAMMA" \
  "fdg:4:1:current:warmup=$WARMUP,delay_lr=$T_RESNET,predict=$GAMMA"
# 2. seed 2 for BP and the best K = 4
best4=$(best resnet56 4)
[ -n "$best4" ] && grid resnet56 resnet56 0 1 2 -- BP "$best4"
# 3. ResNet-20 at K = 4 (no paper preset: DeepSpeed's "parameters" partition, as the recipe)
grid resnet20_k4 resnet20 0 1 2 -- BP ${best4:+"$best4"} "$(fdg 4)"
# 4. GPT-2, K = 4 and BP, two seeds (one process per seed list, so two runs at a time)
lm_k4() {
  local s=$1 runs="bp$1"
  for c in "" "_dlr$T_LM" "_p$GAMMA" "_dlr${T_LM}_p$GAMMA" "_stashed" "_stashed_dlr${T_LM}_p$GAMMA"; do
    runs+=",ref_k4_b1.0$c$1"
  done
  LM_CONVERGENCE_OUT="$OUT/gpt2" "$PYTHON" -m benchmarks.convergence.lm_convergence run --runs "$runs" >> "$OUT/gpt2/log$s.txt" 2>&1
}
mkdir -p "$OUT/gpt2"
echo "$(date '+%F %T') gpt2 K=4"
lm_k4 "" & lm_k4 _s1; wait
# 5. ResNet-56, K = 3
mapfile -t k3 < <(corrections 3)
grid resnet56 resnet56 0 1 -- "${k3[@]}"
best3=$(best resnet56 3)
[ -n "$best3" ] && grid resnet56 resnet56 0 1 2 -- BP "$best3"
# 6. GPT-2, K = 3
echo "$(date '+%F %T') gpt2 K=3"
LM_CONVERGENCE_OUT="$OUT/gpt2" "$PYTHON" -m benchmarks.convergence.lm_convergence run \
  --runs "ref_k3_b1.0,ref_k3_b1.0_dlr$T_LM" >> "$OUT/gpt2/log.txt" 2>&1 &
LM_CONVERGENCE_OUT="$OUT/gpt2" "$PYTHON" -m benchmarks.convergence.lm_convergence run \
  --runs "ref_k3_b1.0_p$GAMMA,ref_k3_b1.0_dlr${T_LM}_p$GAMMA" >> "$OUT/gpt2/log_s1.txt" 2>&1
wait
echo "$(date '+%F %T') queue done"
