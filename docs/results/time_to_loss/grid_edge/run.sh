#!/bin/bash
# Post-hoc sensitivity check, NOT part of the pre-registered time-to-loss test: the LM AdamW grid chose its upper
# edge (lr 2e-3) for every arm on seed 300; the same runner (frozen worktree) at lr 4e-3 and 8e-3, seed 300,
# validation split, into its own folder so the test's choices cannot read it.
cd /work/ttl_queue
# bp_a4 at 4e-3 ended above 2e-3 (5.674 against 5.572), so 8e-3 was dropped; bp_a1 and FDG at 4e-3 for equal effort
for name in lm_adamw/bp_a4_lr0.004_w0.1_s300 lm_adamw/bp_a1_lr0.004_w0.1_s300 lm_adamw/fdg_k2_lr0.004_w0.1_s300; do
  [ -e "/work/ttl_grid_ext/$name.json" ] && continue
  echo "$(date -u '+%F %T') start $name"
  chrt --idle 0 nice -n 19 env DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 WANDB_MODE=offline PYTHONPATH=$PWD \
    /work/main/.venv/bin/python -m benchmarks.convergence.time_to_loss one "$name" --out /work/ttl_grid_ext \
    --pause-while /work/QUIET 2>&1 | grep -v WARNING | tail -n 3
done
echo "$(date -u '+%F %T') done"
