"""MegaMoEBlock's distributed-checkpoint layout: experts are EP shards of one global tensor."""

from __future__ import annotations

import pytest

from tests._dist import run_ranks
from tests.megamoe.megatron.models import build_gpt, moe_config, setup_megatron


def _layout(rank, world):
    setup_megatron(ep=world)
    model = build_gpt(moe_config(expert_model_parallel_size=world, num_layers=1), mega=True)
    state = model.sharded_state_dict()
    out = {}
    for key, sh in state.items():
        if ".mlp." in key and hasattr(sh, "global_shape"):
            out[key] = (tuple(sh.global_shape), tuple(sh.global_offset), sh.replica_id)
    return out


@pytest.mark.slow
def test_expert_weights_are_sharded_over_ep_and_router_is_replicated(tmp_path):
    layouts = run_ranks(_layout, 2, tmp_path)
    fc1 = "decoder.layers.0.mlp.experts.fc1.weight"
    fc2 = "decoder.layers.0.mlp.experts.fc2.weight"
    router = "decoder.layers.0.mlp.router.weight"
    for rank, layout in enumerate(layouts):
        assert layout[fc1][0] == (1, 4, 24, 16), layout[fc1]  # [layers, E, 2I, H]: all 4 experts
        assert layout[fc1][1] == (0, 2 * rank, 0, 0)  # this rank's 2 experts start at 2 * rank
        assert layout[fc2][0] == (1, 4, 16, 12) and layout[fc2][1] == (0, 2 * rank, 0, 0)
        assert layout[fc1][2] == (0, 0, 0)  # EP=2 on 2 ranks: no expert-DP replicas
        assert layout[router][0] == (1, 4, 16) and layout[router][1] == (0, 0, 0)
    assert layouts[0][router][2] != layouts[1][router][2]  # the router is one replica per DP rank
