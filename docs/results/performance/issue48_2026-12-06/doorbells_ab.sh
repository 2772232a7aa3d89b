#!/bin/bash
# A/B: shm doorbells over the socket (base: a worktree at 44a8cbb) against eventfd doorbells (efd: 44a8cbb with
# fdg_schedule/exchange/shm_link.py as committed in 64352ff, uncommitted at the time), interleaved; the nice-19
# queues running. Run on 2026-12-06 02:30-02:36 UTC; the paths are this machine's.
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
for i in 1 2 3; do
  for tree in base efd; do
    dir=/work/main; [ $tree = base ] && dir=/work/wt_base
    cd $dir && echo "$(date -u +%T) $tree run $i load $(cut -d' ' -f1 /proc/loadavg)" &&
      PYTHONPATH=$dir timeout 900 /work/main/.venv/bin/python -m benchmarks.studies.tick_anatomy --model plainconv \
        --parts 0,14,29 --rounds 3 --window 24 --warmup 8 --out /tmp/h48/ab_${tree}_$i > /tmp/h48/ab_${tree}_$i.log 2>&1
  done
done
echo done
