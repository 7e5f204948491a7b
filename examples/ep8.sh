#!/bin/bash
# primus-cli template ep8: rendered by `primus-cli template render`; every value is quoted.
#SBATCH --job-name=ep8
#SBATCH --nodes=1
#SBATCH --open-mode=append
#SBATCH --output=./%x-%j.out
set -euo pipefail
exec primus-cli direct -- train pretrain --config examples/megatron/configs/MI355X/deepseek_v3-BF16-pretrain.yaml \
  --num_layers 4 \
  --micro_batch_size 2 \
  --global_batch_size 1024 \
  --tensor_model_parallel_size 1 \
  --pipeline_model_parallel_size 1 \
  --expert_model_parallel_size 8 \
  --moe_layer_freq 1 \
  --moe_shared_expert_intermediate_size None \
  --pipeline_model_parallel_layout null \
  --recompute_granularity null \
  --recompute_num_layers 0 \
  --recompute_layer_ids null \
  --moe_router_force_load_balancing_type uniform \
  --enable_primus_turbo True \
  --use_turbo_mega_moe True \
  --mock_data True