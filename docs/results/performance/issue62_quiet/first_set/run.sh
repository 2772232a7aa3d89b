#!/usr/bin/env bash
# issue 62, quiet set after Note [a lent message]: plainconv (12 rounds) and mlp_1024 (8 rounds), GAS 4,
# default transport ("auto" = shm here) against 1F1B m=4 and the halves; then plainconv's trace.
set -u
SRC=${SRC:-/work/wt-q62}
cd $SRC
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$SRC
OUT=${OUT:-/work/runs/q62}
V=1f1b_m4,halves,fdg_current_stored_shm
for spec in plainconv:12 mlp_1024:8; do
  m=${spec%%:*}; r=${spec##*:}
  [ -f $OUT/$m/throughput.json ] && continue
  nice -n -20 /work/main/.venv/bin/python -m benchmarks.throughput.throughput --models $m --fdg-gas 4 --window 32 \
    --warmup 8 --repeats $r --rss '' --variants $V --out $OUT/$m > $OUT/$m.log 2>&1
  echo "$m done $(date +%T) rc=$? load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/progress
done
[ -f $OUT/plainconv_anatomy/tick_anatomy.md ] || {
nice -n -20 /work/main/.venv/bin/python -m benchmarks.studies.tick_anatomy --model plainconv --parts 0,14,29 --rounds 4 \
  --window 24 --warmup 8 --gas 4 --host-memory retain --out $OUT/plainconv_anatomy > $OUT/plainconv_anatomy.log 2>&1
echo "anatomy done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/progress; }
