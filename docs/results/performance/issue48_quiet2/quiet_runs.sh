#!/bin/bash
# issue 48, three more readings with the queues stopped (SIGSTOP; resumed at the end), at cf7ffcf (engine as at
# e8f0116; the benchmark gains halves_recomputed). The commands of ../issue48_quiet/quiet_runs.sh for the five target
# models, plus halves_recomputed (the recomputed modes' own ceiling) and fdg_current_recomputed_shm everywhere; the
# two shapes that are not targets (smalltransformer, widemlp) left out to keep the queue's pause short.
# Decided before the run: each target cell is read by its median over these three readings and the three of
# ../issue48_quiet (six quiet readings); recomputed by its median × halves_recomputed over these three.
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
      --variants bp,1f1b_m4,fdg_current_stored,fdg_current_stored_shm,fdg_current_recomputed,fdg_current_recomputed_shm,halves,halves_recomputed \
      --out out/h48q2/throughput_c$run > out/h48q2_c$run.log 2>&1
  echo "$(date -u +%T) d$run load $(cut -d' ' -f1 /proc/loadavg)"
  timeout 2400 $py -m benchmarks.throughput.throughput --models resnet32,transformer,resnet56,convstack \
      --fdg-gas 4 --rss '' --repeats 4 --window 16 \
      --variants bp,1f1b_m4,fdg_current_stored,fdg_current_stored_shm,fdg_current_recomputed,fdg_current_recomputed_shm,halves,halves_recomputed \
      --out out/h48q2/throughput_d$run > out/h48q2_d$run.log 2>&1
done
echo "$(date -u +%T) done"
