#!/bin/bash
# issue 48's table, three readings in a row with the queues stopped (SIGSTOP; resumed at the end), so that the only
# load is the benchmark's own. The commands of issue48_2026-12-06/throughput_runs.sh, convstack joining the second.
cd /work/main
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
py=/work/main/.venv/bin/python
queues() { pkill -"$1" -f auto_test.py; pkill -"$1" -f resnet_reference.py; }
trap 'queues CONT' EXIT
queues STOP
sleep 5
for run in 1 2 3; do
  echo "$(date -u +%T) c$run load $(cut -d' ' -f1 /proc/loadavg)"
  timeout 1800 $py -m benchmarks.throughput.throughput --models plainconv --parts "plainconv:2=0,14,29;plainconv:2m4=0,14,29" \
      --fdg-gas 4 --rss '' --repeats 6 --window 16 \
      --variants bp,1f1b_m4,fdg_current_stored,fdg_current_stored_shm,fdg_current_recomputed,fdg_current_recomputed_shm,halves \
      --out out/h48q/throughput_c$run > out/h48q_c$run.log 2>&1
  echo "$(date -u +%T) d$run load $(cut -d' ' -f1 /proc/loadavg)"
  timeout 2400 $py -m benchmarks.throughput.throughput --models smalltransformer,resnet32,transformer,resnet56,convstack \
      --fdg-gas 4 --rss '' --repeats 4 --window 16 \
      --variants bp,1f1b_m4,fdg_current_stored,fdg_current_stored_shm,fdg_current_recomputed,halves \
      --out out/h48q/throughput_d$run > out/h48q_d$run.log 2>&1
  echo "$(date -u +%T) e$run load $(cut -d' ' -f1 /proc/loadavg)"
  timeout 1200 $py -m benchmarks.throughput.throughput --models widemlp --fdg-gas 4 --rss '' --repeats 4 --window 8 --warmup 4 \
      --variants bp,1f1b_m4,fdg_current_stored,fdg_current_stored_shm,halves --out out/h48q/throughput_e$run > out/h48q_e$run.log 2>&1
done
echo "$(date -u +%T) done"
