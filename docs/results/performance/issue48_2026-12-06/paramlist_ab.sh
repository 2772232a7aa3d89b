#!/bin/bash
# A/B: the engine walking the module each tick (base: a worktree at eca9084) against the parameter list made once
# (new: main's working tree), smalltransformer, interleaved, queues paused.
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
for i in 1 2 3; do
  for tree in base new; do
    dir=/work/main; [ $tree = base ] && dir=/work/wt_base
    cd $dir && echo "$(date -u +%T) $tree run $i load $(cut -d' ' -f1 /proc/loadavg)" &&
      PYTHONPATH=$dir timeout 900 /work/main/.venv/bin/python -m benchmarks.studies.tick_anatomy --model smalltransformer \
        --rounds 3 --window 48 --warmup 8 --out /tmp/h48/ab2_${tree}_$i > /tmp/h48/ab2_${tree}_$i.log 2>&1
  done
done
echo done
