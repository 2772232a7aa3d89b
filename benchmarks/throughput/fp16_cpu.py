"""Run a recipe with DeepSpeed's fp16 on a CPU without fp16 kernels: the fp16 evidence runs
of docs/results/performance/issue5-bars-and-fp16.md.

DeepSpeed's CPU accelerator reports fp16 support only where oneDNN has fp16 kernels (AVX512-FP16 or AMX-FP16);
elsewhere ``deepspeed.initialize`` refuses ``"fp16": {"enabled": true}`` with ``ValueError: Type fp16 is not
supported on your device.``, though torch computes fp16 on any CPU (slowly: its own kernels). This wrapper says
yes for the accelerator, then runs the recipe unchanged, under DeepSpeed's launcher:

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 --module benchmarks.throughput.fp16_cpu \\
        recipes/train_resnet.py \\
        --deepspeed_config ds_configs/resnet_fdg_k2_fp16.json --epochs 2 --train-subset 3000 --partition paper

On a GPU, or a CPU with fp16 kernels, run the recipe itself: nothing here changes what it computes.
"""

import runpy
import sys

from deepspeed.accelerator import get_accelerator

accelerator = get_accelerator()
if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
    type(accelerator).is_fp16_supported = lambda self: True  # Note [fp16 on this CPU] in tests/fp16_workers.py

# DeepSpeed's launcher passes --local_rank=N before the arguments: the recipe is the first argument ending in .py.
script = next((arg for arg in sys.argv[1:] if arg.endswith(".py")), None)
if script is None:
    raise SystemExit("fp16_cpu.py: error: give the recipe to run, e.g. recipes/train_resnet.py, then its arguments")
sys.argv = [script] + [arg for arg in sys.argv[1:] if arg != script]
runpy.run_path(script, run_name="__main__")
