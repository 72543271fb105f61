#!/usr/bin/env bash
# Train on the 2 GPUs of one machine with accelerate's DistributedDataParallel.
#
# per_device_train_batch_size rows go to each GPU; the engine gathers both GPUs' reps, so the contrastive
# loss (in-batch negatives) and the FLOPS regularizer see 2 x 256 = 512 rows, and the gradients equal one
# process training on those 512 rows. mini_batch_size bounds each GPU's activation memory. Every encoder
# parameter gets a gradient in each step, so DDP need not search for unused parameters.
# Extra flags are passed on to `gradcache-sparton train` (e.g. --max_steps 1000 --output_dir outputs/run).
set -euo pipefail
accelerate launch --multi_gpu --num_processes 2 --module gradcache_sparton.cli train \
    --per_device_train_batch_size 256 --mini_batch_size 64 --bf16 True \
    --ddp_find_unused_parameters False "$@"
