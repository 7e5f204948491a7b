#!/bin/bash
# primus-cli template pp8-8node: rendered by `primus-cli template render`; every value is quoted.
# Run it with bash (primus-cli allocates with srun) or submit it with sbatch (srun then runs inside
# the allocation). The pipeline layout: E = embedding, t = transformer layer, L = loss, | = stage;
# 16 stages on PP=8 means 2 virtual stages per rank (61 DeepSeek-V3 layers).
#SBATCH --job-name=pp8-8node
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=./%x-%j.out
set -euo pipefail
slurm_flags=(-N 8)
exec primus-cli slurm srun "${slurm_flags[@]}" -- container --image rocm/primus:v26.5 -- \
  train pretrain --config examples/megatron/configs/MI355X/deepseek_v3-BF16-pretrain.yaml \
  --train_iters 15 \
  --micro_batch_size 2 \
  --global_batch_size 1024 \
  --tensor_model_parallel_size 1 \
  --pipeline_model_parallel_size 8 \
  --pipeline_model_parallel_layout 'Ett|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttL' \
  --expert_model_parallel_size 8 \
  --moe_shared_expert_intermediate_size None \
  --mtp_num_layers 0 \
  --recompute_granularity full \
  --recompute_method uniform \
  --recompute_num_layers 1 \
  --recompute_layer_ids null \
  --moe_router_force_load_balancing_type uniform \
  --enable_primus_turbo True \
  --use_turbo_mega_moe True \
  --mock_data True