#!/bin/bash
# issue 48's table for convstack, the fourth benchmark model (the table had plainconv, resnet32, resnet56 and
# transformer), three readings in a row, the nice-19 queues running as for the other readings (throughput_runs.sh).
cd /work/main
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
py=/work/main/.venv/bin/python
for run in 1 2 3; do
  echo "$(date -u +%T) convstack $run load $(cut -d' ' -f1 /proc/loadavg)"
  timeout 1800 $py -m benchmarks.throughput.throughput --models convstack --fdg-gas 4 --rss '' --repeats 4 --window 16 \
      --variants bp,1f1b_m4,fdg_current_stored,fdg_current_stored_shm,fdg_current_recomputed,halves \
      --out out/h48c/throughput_convstack$run > out/h48c_convstack$run.log 2>&1
done
echo "$(date -u +%T) done"
