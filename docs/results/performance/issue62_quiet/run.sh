#!/usr/bin/env bash
# issue 62, quiet set 2 after Note [a lent message] (engine 7fdf3b5): the seven nets, GAS 4, the default transport
# ("auto" = shm here) against 1F1B m=4 and the halves, 12 interleaved rounds each; then mlp_1024's trace.
set -u
SRC=${SRC:-/work/wt-q62}
cd $SRC
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$SRC
OUT=${OUT:-/work/runs/q62b}
V=1f1b_m4,halves,fdg_current_stored_shm
for m in plainconv mlp_1024 plainconv_w16_d16 plainconv_w64_d6 blockstack resnet32 transformer; do
  [ -f $OUT/$m/throughput.json ] && continue
  nice -n -20 /work/main/.venv/bin/python -m benchmarks.throughput.throughput --models $m --fdg-gas 4 --window 32 \
    --warmup 8 --repeats 12 --rss '' --variants $V --out $OUT/$m > $OUT/$m.log 2>&1
  echo "$m done $(date +%T) rc=$? load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/progress
done
[ -f $OUT/mlp_1024_anatomy/tick_anatomy.md ] || {
nice -n -20 /work/main/.venv/bin/python -m benchmarks.studies.tick_anatomy --model mlp_1024 --rounds 4 \
  --window 24 --warmup 8 --gas 4 --host-memory retain --out $OUT/mlp_1024_anatomy > $OUT/mlp_1024_anatomy.log 2>&1
echo "anatomy done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/progress; }
