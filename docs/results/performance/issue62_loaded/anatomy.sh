#!/usr/bin/env bash
# issue 62: where FDG's tick goes on plainconv (K = 2, GAS 4, split 0,14,29), before (030ef9a) and after, by allocator.
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
A="--model plainconv --parts 0,14,29 --rounds 4 --window 24 --warmup 8 --gas 4"
run() { # dir tree memory
  [ -f /work/runs/i62/anatomy_$1/tick_anatomy.md ] && return
  (cd $2 && PYTHONPATH=$2 nice -n -20 /work/main/.venv/bin/python -m benchmarks.studies.tick_anatomy $A --host-memory $3 \
     --out /work/runs/i62/anatomy_$1 > /work/runs/i62/anatomy_$1.log 2>&1)
  echo "anatomy $1 done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /work/runs/i62/progress
}
run before_system /work/wt-before system
run after_system /work/wt-bench system
run after_retain /work/wt-bench retain
