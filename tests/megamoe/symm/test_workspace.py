"""The workspace's size bound: the capacity factor caps the pool (and every per-layer row tensor)."""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.symm.workspace import BufferLayout, WorkspaceKey

DEEPSEEK = WorkspaceKey("ep", topk=8, num_experts=256, hidden=7168, dtype=torch.bfloat16)


def _pool_rows(world: int, factor: float, max_tokens: int = 8192) -> int:
    key = WorkspaceKey("ep", DEEPSEEK.topk, 32 * world, DEEPSEEK.hidden, DEEPSEEK.dtype)
    return BufferLayout.build(key, world, max_tokens, factor).pool_rows


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_default_holds_twice_a_balanced_share_and_max_the_worst_case(world) -> None:
    share = 8192 * 8  # T_max * top-k: what one rank receives under balanced routing
    assert _pool_rows(world, 2.0) == min(2, world) * share
    assert _pool_rows(world, float("inf")) == world * share  # every row of every rank to one rank
    assert _pool_rows(world, 0.5) == share // 2


def test_the_pool_never_exceeds_the_worst_case_with_few_local_experts() -> None:
    key = WorkspaceKey("ep", topk=8, num_experts=8, hidden=64, dtype=torch.bfloat16)  # G = 2 < K
    assert BufferLayout.build(key, 4, 100, 2.0).pool_rows == 4 * 100 * 2


def _owned_workspace_rank(rank: int, world: int) -> dict:
    """Two layers of one shape own one workspace sized by the caller; the ops find it; it dies with them."""
    import gc

    import torch.distributed as dist

    from megamoe.backends.symm import workspace as wsm
    from megamoe.layer import MegaMoEExperts
    from megamoe.settings import EPSettings

    settings = EPSettings(transport="symm")
    layers = [
        MegaMoEExperts(
            num_experts=4,
            hidden_size=16,
            ffn_hidden_size=8,
            ep_group=dist.group.WORLD,
            backend="triton",
            ep_settings=settings,
        )
        for _ in range(2)
    ]
    for layer in layers:
        layer.allocate_workspace(max_tokens=24, topk=2)
    key = wsm.WorkspaceKey(dist.group.WORLD.group_name, 2, 4, 16, torch.float32)
    found = wsm.find_workspace(key)
    result = {
        "uses_symm": [layer.uses_symmetric_memory() for layer in layers],
        "shared": layers[0].workspace is layers[1].workspace is found,
        "max_tokens": found.max_tokens,
        "ops_workspace_is_the_layers": wsm.get_workspace(
            dist.group.WORLD,
            num_tokens=24,
            topk=2,
            num_experts=4,
            hidden=16,
            dtype=torch.float32,
            device=torch.device("cpu"),
            settings=settings.symm,
        )
        is found,
    }
    try:
        wsm.allocate_workspace(
            dist.group.WORLD, max_tokens=25, topk=2, num_experts=4, hidden=16, dtype=torch.float32,
            device=torch.device("cpu"),
        )  # fmt: skip
    except wsm.SymmCapacityError as e:
        result["larger"] = str(e)
    try:
        wsm.get_workspace(
            dist.group.WORLD, num_tokens=25, topk=2, num_experts=4, hidden=16, dtype=torch.float32,
            device=torch.device("cpu"), settings=settings.symm,
        )  # fmt: skip
    except wsm.SymmCapacityError as e:
        result["too_many_tokens"] = str(e)
    del layers, layer, found
    gc.collect()
    result["freed"] = wsm.find_workspace(key) is None
    return result


def test_layers_own_one_workspace_the_caller_sized_and_it_dies_with_them(tmp_path) -> None:
    from tests._dist import run_ranks

    for r in run_ranks(_owned_workspace_rank, 2, tmp_path):
        assert r["uses_symm"] == [True, True]
        assert r["shared"] and r["max_tokens"] == 24 and r["ops_workspace_is_the_layers"]
        assert "holds 24 tokens per rank" in r["larger"]
        assert "tokens on this EP rank=25" in r["too_many_tokens"]
        assert r["freed"]


def test_narrow_rows_pack_from_the_region_start_and_never_overrun_it() -> None:
    """Rows narrower than the region's (quantised rows with their scales) move at their own size."""
    from megamoe.backends.symm.workspace import narrow_rows

    region = torch.arange(4 * 6.0).view(4, 6)
    assert narrow_rows(region, None) is region and narrow_rows(region, 6) is region
    packed = narrow_rows(region, 4)
    assert packed.shape == (4, 4) and packed.is_contiguous()
    assert packed.data_ptr() == region.data_ptr()
    packed[3] = -1.0  # row 3 of width 4 ends at element 16, inside the region's first 3 rows
    assert (region.view(-1)[12:16] == -1).all() and (region.view(-1)[16:] >= 0).all()
    with pytest.raises(ValueError, match="do not fit"):
        narrow_rows(region, 7)
