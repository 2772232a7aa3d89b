#!/bin/bash
# issue 48, what each transport costs without the engine: three readings with the queues stopped (SIGSTOP; resumed
# at the end), at e120456 (engine as at e8f0116). The five target models, FDG stored over gloo and shm against the
# halves alone and the halves with the same messages through the same transport (halves_exchange: gloo, halves_shm).
# Decided before the run: per model and transport, the medians over the three readings of (a) the halves with the
# messages over the halves (what the transport costs on this machine with no engine) and (b) FDG stored over the
# halves with its messages (what the engine costs on top).
cd /work/main
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
py=/work/main/.venv/bin/python
queues() { pkill -"$1" -f auto_test.py; pkill -"$1" -f resnet_reference.py; }
trap 'queues CONT' EXIT
queues STOP
sleep 5
variants=fdg_current_stored,fdg_current_stored_shm,halves,halves_exchange,halves_shm
for run in 1 2 3; do
  echo "$(date -u +%T) c$run load $(cut -d' ' -f1 /proc/loadavg)"
  timeout 1800 $py -m benchmarks.throughput.throughput --models plainconv --parts "plainconv:2=0,14,29" \
      --fdg-gas 4 --rss '' --repeats 6 --window 16 --variants $variants \
      --out out/h48q3/throughput_c$run > out/h48q3_c$run.log 2>&1
  echo "$(date -u +%T) d$run load $(cut -d' ' -f1 /proc/loadavg)"
  timeout 2400 $py -m benchmarks.throughput.throughput --models resnet32,transformer,resnet56,convstack \
      --fdg-gas 4 --rss '' --repeats 4 --window 16 --variants $variants \
      --out out/h48q3/throughput_d$run > out/h48q3_d$run.log 2>&1
done
echo "$(date -u +%T) done"
