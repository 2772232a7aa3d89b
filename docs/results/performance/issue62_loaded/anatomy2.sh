#!/usr/bin/env bash
while pgrep -f "i62/run.sh" > /dev/null; do sleep 5; done
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
cd /work/wt-bench && PYTHONPATH=/work/wt-bench nice -n -20 /work/main/.venv/bin/python -m benchmarks.studies.tick_anatomy \
  --model mlp_1024 --rounds 4 --window 24 --warmup 8 --gas 4 --host-memory retain --out /work/runs/i62/anatomy_mlp_retain \
  > /work/runs/i62/anatomy_mlp_retain.log 2>&1
echo "anatomy mlp_retain done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /work/runs/i62/progress
