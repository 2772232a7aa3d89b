#!/usr/bin/env bash
# The main job: set up, then train ResNet-20 on Fashion-MNIST with FDG on K=2 pipeline stages (two CPU
# processes) and print test accuracy and throughput. Extra arguments go to recipes/train_resnet.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV="${FDG_VENV:-.venv}"
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 WANDB_MODE="${WANDB_MODE:-offline}"
exec "$VENV/bin/deepspeed" --num_gpus 2 --master_port "${MASTER_PORT:-29500}" recipes/train_resnet.py \
  --deepspeed_config ds_configs/resnet_fdg_k2.json --epochs 3 --train-subset 6000 "$@"
