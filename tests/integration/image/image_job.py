"""The short job the image test runs inside the CPU image through `primus-cli container`.

Checks that torch is the image's CPU build (not the host venv's), that the ranks form a gloo group
across torchrun's processes, and that the fused MoE op runs; prints one line per rank.
"""

import os
import sys

import torch
import torch.distributed as dist

import megamoe


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    x_TH = torch.randn(4, 8)
    topk_idx_TK = torch.tensor([[0, 1], [1, 0], [0, 0], [1, 1]])
    topk_weights_TK = torch.full((4, 2), 0.5)
    w1 = torch.randn(2, 2 * 16, 8)
    w2 = torch.randn(2, 8, 16)
    y_TH = megamoe.fused_mega_moe(x_TH, topk_idx_TK, topk_weights_TK, w1, w2)
    print(
        f"image-job rank={rank} world={world} sum={total.item():g} torch={torch.__version__} "
        f"torch_file={torch.__file__} moe_shape={tuple(y_TH.shape)} "
        f"turbo={os.environ.get('PRIMUS_TURBO_COMMIT', '-')}",
        flush=True,
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
