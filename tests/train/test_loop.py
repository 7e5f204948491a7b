"""The loop's per-step hook into MegaMoE: one weight generation per optimizer step, mxfp8 only."""

from __future__ import annotations

import pytest

from megamoe.megatron import MegaMoEOptions
from megamoe.quant import weight_generation
from megamoe.train.loop import after_optimizer_step
from megamoe.train.model import MoESwitch


@pytest.mark.parametrize(
    ("use_mega_moe", "precision", "advances"),
    [(True, "mxfp8", 1), (True, "bf16", 0), (False, "mxfp8", 0)],
)
def test_after_optimizer_step_advances_the_weight_generation_only_for_mxfp8_megamoe(
    use_mega_moe: bool, precision: str, advances: int
) -> None:
    options = MegaMoEOptions(enabled=use_mega_moe, precision=precision)
    switch = MoESwitch(use_mega_moe=use_mega_moe, reason="test", options=options)
    before = weight_generation()
    after_optimizer_step(switch)
    assert weight_generation() - before == advances
