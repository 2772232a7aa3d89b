#!/usr/bin/env bash
# issue 62: plainconv at GAS 4 and 16, 12 rounds (a 95 % CI of each paired median), and its trace with freed memory kept.
cd /work/wt-bench
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=/work/wt-bench
OUT=${OUT:-/work/runs/i62/plainconv12}
nice -n -20 /work/main/.venv/bin/python -m benchmarks.throughput.throughput --models plainconv --fdg-gas 4,16 --window 32 \
  --warmup 8 --repeats 12 --rss '' --out $OUT \
  --variants 1f1b_m4,halves,fdg_current_stored_g4,fdg_current_stored_shm_g4,fdg_current_stored_g16,fdg_current_stored_shm_g16 \
  > $OUT.log 2>&1
echo "plainconv12 $OUT done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /work/runs/i62/progress
nice -n -20 /work/main/.venv/bin/python -m benchmarks.studies.tick_anatomy --model plainconv --parts 0,14,29 --rounds 4 \
  --window 24 --warmup 8 --gas 4 --host-memory retain --out ${OUT}_anatomy > ${OUT}_anatomy.log 2>&1
echo "anatomy ${OUT}_anatomy done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /work/runs/i62/progress
