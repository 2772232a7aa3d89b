#!/bin/bash
# issue 48's throughput table again, at 64352ff (eventfd doorbells, after issue 46's order), the nice-19 queues running.
# The second reading (throughput_c2, _d2, _e2) ran the same three commands with --out out/h48b/throughput_<run>2.
cd /work/main
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
py=/work/main/.venv/bin/python
echo "$(date -u +%T) c load $(cut -d' ' -f1 /proc/loadavg)"
timeout 1800 $py -m benchmarks.throughput.throughput --models plainconv --parts "plainconv:2=0,14,29;plainconv:2m4=0,14,29" \
    --fdg-gas 4 --rss '' --repeats 6 --window 16 \
    --variants bp,1f1b_m4,fdg_current_stored,fdg_current_stored_shm,fdg_current_recomputed,fdg_current_recomputed_shm,halves \
    --out out/h48b/throughput_c > out/h48b_c.log 2>&1
echo "$(date -u +%T) d load $(cut -d' ' -f1 /proc/loadavg)"
timeout 2400 $py -m benchmarks.throughput.throughput --models smalltransformer,resnet32,transformer,resnet56 --fdg-gas 4 --rss '' \
    --repeats 4 --window 16 --variants bp,1f1b_m4,fdg_current_stored,fdg_current_stored_shm,fdg_current_recomputed,halves \
    --out out/h48b/throughput_d > out/h48b_d.log 2>&1
echo "$(date -u +%T) e load $(cut -d' ' -f1 /proc/loadavg)"
timeout 1200 $py -m benchmarks.throughput.throughput --models widemlp --fdg-gas 4 --rss '' --repeats 4 --window 8 --warmup 4 \
    --variants bp,1f1b_m4,fdg_current_stored,fdg_current_stored_shm,halves --out out/h48b/throughput_e > out/h48b_e.log 2>&1
echo "$(date -u +%T) done"
