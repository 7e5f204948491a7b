"""Per-iteration numbers: LM loss and MoE aux loss gathered to rank 0, model FLOPs, peak memory.

FLOPs count the matrix products of one training step (forward + backward = 3x forward; full
activation recompute adds one more forward), with active parameters per token only: top-k routed
experts plus the shared expert, causal attention at half the S x S products.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megamoe.train.schema import PretrainConfig


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """One iteration as logged: losses, lr, grad norm, speed and memory."""

    iteration: int
    lm_loss: float
    aux_loss: float | None
    lr: float
    grad_norm: float | None
    seconds: float
    tokens_per_s: float
    tflops_per_gpu: float
    peak_mem_gib: float

    def line(self, train_iters: int) -> str:
        aux = f" | aux loss {self.aux_loss:.4e}" if self.aux_loss is not None else ""
        grad = f" | grad norm {self.grad_norm:.3f}" if self.grad_norm is not None else ""
        return (
            f"iteration {self.iteration:>6d}/{train_iters} | lm loss {self.lm_loss:.6f}{aux} | lr {self.lr:.3e}"
            f"{grad} | {self.seconds * 1000:.1f} ms | {self.tokens_per_s:,.0f} tokens/s"
            f" | {self.tflops_per_gpu:.3g} TFLOP/s/GPU | peak mem {self.peak_mem_gib:.2f} GiB"
        )


def _moe_layer_count(cfg: PretrainConfig) -> int:
    freq, layers = cfg.moe.moe_layer_freq, cfg.model.num_layers
    if cfg.moe.num_experts is None:
        return 0
    if isinstance(freq, int):
        return sum(1 for i in range(layers) if i % freq == 0)
    return sum(freq)


def flops_per_iteration(cfg: PretrainConfig, global_batch_size: int, vocab_size: int) -> float:
    """Model FLOPs of one optimizer step over the whole job (``vocab_size``: the output layer's rows)."""
    m, moe = cfg.model, cfg.moe
    h, s = m.hidden_size, cfg.training.seq_length
    heads = m.num_attention_heads
    if m.multi_latent_attention:
        qk, v = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
        q_proj = h * m.q_lora_rank + m.q_lora_rank * heads * qk if m.q_lora_rank else h * heads * qk
        kv_proj = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank * heads * (m.qk_head_dim + v)
        attn_params = q_proj + kv_proj + heads * v * h
        core = s * heads * (qk + v)  # 2 * s * d per product, halved for the causal mask
    else:
        d = m.kv_channels or h // heads
        kv_heads = m.num_query_groups if m.group_query_attention and m.num_query_groups else heads
        attn_params = h * d * (heads + 2 * kv_heads) + heads * d * h
        core = s * heads * 2 * d
    gate = 3 if m.swiglu else 2
    dense_mlp = gate * h * (m.ffn_hidden_size or 4 * h)
    n_moe = _moe_layer_count(cfg)
    moe_mlp = 0
    if n_moe:
        moe_ffn = moe.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * h
        moe_mlp = moe.moe_router_topk * gate * h * moe_ffn + h * moe.num_experts
        moe_mlp += gate * h * (moe.moe_shared_expert_intermediate_size or 0)
    per_token = (
        m.num_layers * (2 * attn_params + core)
        + 2 * (m.num_layers - n_moe) * dense_mlp
        + 2 * n_moe * moe_mlp
        + 2 * h * vocab_size
    )
    passes = 4 if cfg.training.recompute_granularity == "full" else 3
    return float(passes * per_token * global_batch_size * s)


def peak_memory_gib() -> float:
    """Peak GPU memory allocated on this rank, or the process's peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def gather_loss(losses: list[dict[str, torch.Tensor]]) -> float:
    """Mean LM loss of the step: last pipeline stages hold it, every rank learns it (one all-reduce)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    for item in losses:
        acc[0] += item["lm loss"].double()
        acc[1] += 1
    dist.all_reduce(acc)
    return float(acc[0] / acc[1].clamp(min=1))


AUX_LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss")


def aux_loss(cfg: PretrainConfig, num_microbatches: int) -> float | None:
    """Mean load-balancing loss per MoE layer and micro-batch, from megatron's aux-loss tracker.

    Both MoE paths (megatron's MoELayer and MegaMoE) record into the tracker. Every rank must call
    this (collectives); the tracker entry is created on ranks whose stages hold no MoE layer.
    """
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    n_moe = _moe_layer_count(cfg)
    if not n_moe or cfg.moe.moe_aux_loss_coeff == 0 or cfg.moe.moe_router_load_balancing_type == "none":
        return None
    name = {
        "aux_loss": "load_balancing_loss",
        "seq_aux_loss": "seq_load_balancing_loss",
        "global_aux_loss": "global_load_balancing_loss",
    }.get(cfg.moe.moe_router_load_balancing_type)
    if name is None:
        return None
    tracker = get_moe_layer_wise_logging_tracker()
    if name not in tracker:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        layers = cfg.model.num_layers + (cfg.model.mtp_num_layers or 0)
        tracker[name] = {
            "values": torch.zeros(layers, device=device),
            "reduce_group": None,
            "avg_group": None,
            "reduce_group_has_dp": False,
        }
    reduce_aux_losses_tracker_across_ranks([name])
    value = float(tracker[name]["values"].float().sum()) / (n_moe * num_microbatches)
    clear_aux_losses_tracker()
    return value
