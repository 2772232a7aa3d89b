#!/usr/bin/env bash
# The device check (issue 47): FDG on the lent GPU machine as it is, in under 8 minutes, written up as one report.
#
#   bash scripts/prepare_gpu_wheels.sh             # here, with network: .gpu_wheels/ (DeepSpeed, pydantic, hjson),
#                                                  # with the commit (COMMIT) and the tree's files (MANIFEST)
#   bash scripts/gpu_check.sh                      # there, with .gpu_wheels carried: prints the report, and writes
#                                                  # it to $OUT/gpu_report.md when OUT is set (the device tool's)
#   bash scripts/gpu_check.sh --dry-run OUT_DIR    # any machine, on the CPU, with this checkout's venv (the suite)
#
# There it uses the machine's own python3 and torch, installs the carried wheels with pip --no-index --no-deps
# --target (nothing is fetched, nothing comes from apt) and needs no git: the report names the commit in
# .gpu_wheels/COMMIT and checks the tree against .gpu_wheels/MANIFEST file by file (scripts/gpu_check_plan.py
# provenance; the dry run does too when .gpu_wheels or $FDG_GPU_WHEELS holds them). The parts
# (scripts/gpu_check.py), each in a process of its own under a shell timeout, its result, time and output in
# the report:
#   env      python, torch, CUDA, DeepSpeed, the GPUs, their driver, NCCL, the network interfaces
#   single   one rank, K = 1: the engine equals plain backprop on the GPU; steady-state ticks under
#            torch.cuda.set_sync_debug_mode("error"), where a host synchronisation raises
#   shared   K = 2 and K = 3, every rank on GPU 0 over gloo (the STAGED path): against fdg_reference on the GPU
#            after every call, dropout replayed by a recomputed forward, a checkpoint resumed mid-flight
#   nccl     K = 2 over NCCL, one rank per GPU (the STREAM path), only with two or more GPUs visible
# The parts' order, the install's and each part's timeout come from `scripts/gpu_check_plan.py timeouts`: a
# part's timeout is its launcher deadlines plus a margin, so a hang ends in the launcher's stack dump and the
# report shows it (Note [the device check's time bounds]). With the install, 480 s at most; on one H200 the parts
# take a fraction of their bounds. Where the loopback is the only interface up (the lent machine), every part
# sets GLOO_SOCKET_IFNAME=lo and NCCL_SOCKET_IFNAME=lo unless they are set.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
  DRY=1
  DIR=${2:?--dry-run needs an output directory}
else
  DIR=${OUT:-$(mktemp -d)}
fi
mkdir -p "$DIR"
REPORT=$DIR/gpu_report.md
WHEELS=${FDG_GPU_WHEELS:-$ROOT/.gpu_wheels}  # scripts/prepare_gpu_wheels.sh
export OMP_NUM_THREADS=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
if ((DRY)); then
  PY=${FDG_VENV:-$ROOT/.venv}/bin/python
else
  PY=${FDG_PYTHON:-python3}  # the machine's own, with its torch
fi
# LIMIT[install] and LIMIT[part] in seconds; PARTS in the plan's order (scripts/gpu_check_plan.py, stdlib only)
declare -A LIMIT=()
PARTS=()
while read -r name secs; do
  LIMIT[$name]=$secs
  [[ $name == install ]] || PARTS+=("$name")
done < <("$PY" scripts/gpu_check_plan.py timeouts)
if [[ -z "${LIMIT[install]:-}" ]] || ((${#PARTS[@]} == 0)); then
  echo "scripts/gpu_check_plan.py timeouts printed no plan (with $PY)" >&2
  exit 2
fi
if ((DRY)); then
  export DS_ACCELERATOR=cpu PYTHONPATH=$ROOT:$ROOT/tests
else
  SITE=$(mktemp -d)
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "no wheels in $WHEELS: run scripts/prepare_gpu_wheels.sh here, then carry .gpu_wheels" >&2
    exit 2
  fi
  timeout "${LIMIT[install]}" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl >"$DIR/install.log" 2>&1 || { cat "$DIR/install.log"; exit 2; }
  export DS_ACCELERATOR=cuda PYTHONPATH=$SITE:$ROOT:$ROOT/tests
fi
CODE=$("$PY" scripts/gpu_check_plan.py provenance "$WHEELS" 2>&1)  # the wheels' commit, the tree against it

FAILED=0
TABLE=""
DETAILS=""
# part NAME: run scripts/gpu_check.py NAME under its timeout; its result, time and output go in the report.
part() {
  local name=$1 limit=${LIMIT[$1]} log=$DIR/$1.log start=$SECONDS
  timeout "$limit" "$PY" scripts/gpu_check.py "$name" --timeout-s "$limit" >"$log" 2>&1
  local rc=$? took=$((SECONDS - start))
  local result summary
  result=$(grep '^RESULT ' "$log" | tail -n 1 | cut -c8-)
  summary=$("$PY" -c 'import json, sys; r = json.loads(sys.argv[1] or "{}"); print(r.get("summary", ""))' \
    "$result" 2>/dev/null)
  local verdict=pass
  if ((rc == 124)); then verdict="FAIL (over ${limit} s: a hang?)"; elif ((rc != 0)); then verdict="FAIL (exit $rc)"; fi
  [[ "$result" == *'"skipped": true'* ]] && verdict="skipped"
  [[ "$verdict" == FAIL* ]] && FAILED=1
  echo "$name: $verdict in ${took} s -- $summary"
  TABLE+="| $name | $verdict | $took | $limit | ${summary//|//} |"$'\n'
  DETAILS+="### $name: $verdict (${took} s)"$'\n\n''```'$'\n'
  local lines='^(bounds: |rank |ran, |python |torch |deepspeed |GPUs|NCCL |no GPU|network: |RESULT )'
  DETAILS+="$(grep -E "$lines" "$log")"$'\n''```'$'\n\n'
  DETAILS+="<details><summary>$name: the output's last 40 lines</summary>"$'\n\n''```'$'\n'"$(tail -n 40 "$log")"
  DETAILS+=$'\n''```'$'\n''</details>'$'\n\n'
}

for name in "${PARTS[@]}"; do
  part "$name"
done

{
  echo "# Device check report"
  echo
  echo "Written by \`scripts/gpu_check.sh$( ((DRY)) && echo " --dry-run")\` on $(date -u '+%Y-%m-%d %H:%M UTC'), \
machine $(hostname)."
  echo
  echo "$CODE"
  echo
  echo "Verdict: $( ((FAILED)) && echo "**some parts failed** (see below)" || echo "every part passed")."
  echo
  echo "| part | result | seconds | timeout (s) | summary |"
  echo "|---|---|---|---|---|"
  printf '%s' "$TABLE"
  echo
  printf '%s' "$DETAILS"
} >"$REPORT"
cat "$REPORT"
echo "report: $REPORT"
exit $FAILED
