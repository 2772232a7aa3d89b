#!/usr/bin/env bash
# issue 62 measurement set: FDG by GAS and transport against 1F1B m=4 and the halves, K = 2, per model.
cd /work/wt-bench
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=/work/wt-bench
V=1f1b_m4,halves,fdg_current_stored_g1,fdg_current_stored_g4,fdg_current_stored_g16,fdg_current_stored_shm_g1,fdg_current_stored_shm_g4,fdg_current_stored_shm_g16
for m in ${MODELS:-plainconv plainconv_w16_d16 plainconv_w64_d6 mlp_1024 blockstack resnet32 transformer}; do
  [ -f /work/runs/i62/$m/throughput.json ] && continue
  nice -n -20 /work/main/.venv/bin/python -m benchmarks.throughput.throughput --models $m --fdg-gas 1,4,16 --window 32 --warmup 8 \
    --repeats 6 --rss '' --variants $V --out /work/runs/i62/$m > /work/runs/i62/$m.log 2>&1
  echo "$m done $(date +%T) rc=$?" >> /work/runs/i62/progress
done
