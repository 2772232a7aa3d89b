#!/bin/bash
# Issue 63 part 4: the K = 2 throughput ratios, FDG / DeepSpeed 1F1B (GAS 4), each with its own optimizer.
# Run from a checkout of the commit named in the report; quiet machine (queues paused by /work/QUIET).
set -euo pipefail
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD WANDB_MODE=offline
PY=${PY:-python}
OUT=${OUT:-out/ttl_throughput}
$PY -m benchmarks.throughput.throughput --models ttl_lm --optimizer adamw --variants bp,1f1b_m4,fdg_stashed_stored \
    --repeats 7 --rss '' --out $OUT/lm_adamw --parts 'ttl_lm:2=0,5,10;ttl_lm:2m4=0,5,10'
$PY -m benchmarks.throughput.throughput --models ttl_lm --optimizer muon --variants bp,1f1b_m4,fdg_stashed_stored \
    --repeats 7 --rss '' --out $OUT/lm_muon --parts 'ttl_lm:2=0,5,10;ttl_lm:2m4=0,5,10'
$PY -m benchmarks.throughput.throughput --models ttl_resnet --optimizer sgd --variants bp,1f1b_m4,fdg_stashed_stored \
    --repeats 7 --rss '' --out $OUT/resnet_sgd --parts 'ttl_resnet:2=0,6,12;ttl_resnet:2m4=0,6,12'
$PY -m benchmarks.throughput.ttl_ratios $OUT/lm_adamw/throughput.json $OUT/lm_muon/throughput.json \
    $OUT/resnet_sgd/throughput.json --json $OUT/ttl_ratios.json
