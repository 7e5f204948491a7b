"""The loop's per-step hooks into MegaMoE: the capacity check before the optimizer step (MegaMoE on
only), one weight generation after it (quantised precisions only: mxfp8, fp8)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megamoe.backends.symm import workspace as wsm
from megamoe.megatron import MegaMoEOptions
from megamoe.quant import weight_generation
from megamoe.settings import SymmSettings
from megamoe.train.loop import after_optimizer_step, before_optimizer_step
from megamoe.train.model import MoESwitch


def _switch(use_mega_moe: bool) -> MoESwitch:
    return MoESwitch(use_mega_moe=use_mega_moe, reason="test", options=MegaMoEOptions(enabled=use_mega_moe))


@pytest.fixture
def overflowed_workspace(monkeypatch):
    """A real (host-memory) EP=2 workspace of 16 pool rows whose last op routed 20 rows to this rank."""
    key = wsm.WorkspaceKey("ep", topk=2, num_experts=4, hidden=8, dtype=torch.float32)
    layout = wsm.BufferLayout.build(key, world=2, max_tokens=8, capacity_factor=1.0)
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    ws = layout.workspace(
        SimpleNamespace(group_name="ep"), key, 0, buffer, 0, (), SymmSettings(capacity_factor=1.0)
    )
    monkeypatch.setattr(wsm, "_LIVE", {key: ws})
    ws.note_received(torch.tensor([20], dtype=torch.int32))
    return ws


def test_before_the_optimizer_step_an_overflowed_pool_stops_the_run(overflowed_workspace) -> None:
    with pytest.raises(wsm.SymmCapacityError) as err:
        before_optimizer_step(_switch(True))
    assert "routed rows on EP rank 0=20" in str(err.value)
    assert "MEGAMOE_SYMM_CAPACITY>=1.25" in str(err.value)
    before_optimizer_step(_switch(True))  # reported once: the count starts over


def test_without_megamoe_the_capacity_is_not_read(overflowed_workspace) -> None:
    before_optimizer_step(_switch(False))
    assert int(overflowed_workspace.received_max) == 20


@pytest.mark.parametrize(
    ("use_mega_moe", "precision", "advances"),
    [(True, "mxfp8", 1), (True, "fp8", 1), (True, "bf16", 0), (False, "mxfp8", 0), (False, "fp8", 0)],
)
def test_after_optimizer_step_advances_the_weight_generation_only_for_quantised_megamoe(
    use_mega_moe: bool, precision: str, advances: int
) -> None:
    options = MegaMoEOptions(enabled=use_mega_moe, precision=precision)
    switch = MoESwitch(use_mega_moe=use_mega_moe, reason="test", options=options)
    before = weight_generation()
    after_optimizer_step(switch)
    assert weight_generation() - before == advances
