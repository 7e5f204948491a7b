"""Why fc1 and fc2 live in separate modules: with megatron DDP + distributed optimizer + overlap,
fc2's parameter all-gather is issued at fc2's own forward pre-hook (after stage 1 ran), and dW2's
gradient reduce starts before stage 1's backward runs."""

from __future__ import annotations

import pytest

from tests._dist import run_ranks
from tests.megamoe.megatron.models import batch, build_gpt, moe_config, setup_megatron


def _record_hook_order(rank, world):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megamoe.backends.reference import ReferenceBackend

    setup_megatron(ep=1)  # EP=1 on 2 ranks: expert weights are data-parallel, so they really reduce
    cfg = moe_config(num_layers=1)
    gpt = build_gpt(cfg, mega=True)
    names = {id(p): n for n, p in gpt.named_parameters()}
    ddp = DistributedDataParallel(
        config=cfg,
        ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            use_distributed_optimizer=True,
            bucket_size=1,  # one bucket per parameter: each gather/reduce is observable alone
        ),
        module=gpt,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True, bf16=False, fp16=False),
        [ddp],
    )
    cfg.finalize_model_grads_func = finalize_model_grads

    events: list[str] = []

    def tag(group) -> str:
        return ",".join(sorted(names[id(p)].rsplit(".", 2)[-2] for p in group.params if id(p) in names))

    def wrap(cls, method, label):
        original = getattr(cls, method)

        def wrapped(self, *args, **kwargs):
            events.append(f"{label}:{tag(self) if isinstance(self, _ParamAndGradBucketGroup) else ''}")
            return original(self, *args, **kwargs)

        setattr(cls, method, wrapped)

    wrap(_ParamAndGradBucketGroup, "finish_param_sync", "gather")
    wrap(_ParamAndGradBucketGroup, "start_grad_sync", "reduce")
    for stage in ("stage1_forward", "stage2_forward", "stage1_backward", "stage2_backward"):
        wrap(ReferenceBackend, stage, stage)

    tokens, position_ids, mask, labels = batch(seed=rank)
    for _step in range(2):  # step 0 records DDP's golden grad counts; step 1 overlaps
        events.clear()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(tokens, position_ids, mask, labels=labels).mean()
        loss.backward()
        finalize_model_grads([ddp])
        opt.step()
    return events


@pytest.fixture(scope="module")
def hook_events(tmp_path_factory):
    return run_ranks(_record_hook_order, 2, tmp_path_factory.mktemp("ddp"))[0]


def test_fc2_param_gather_is_issued_at_its_own_pre_hook(hook_events):
    order = [
        e for e in hook_events if e in ("stage1_forward:", "stage2_forward:", "gather:fc1", "gather:fc2")
    ]
    assert order[:4] == ["gather:fc1", "stage1_forward:", "gather:fc2", "stage2_forward:"], hook_events


def test_dw2_reduce_starts_before_stage1_backward(hook_events):
    reduce_fc2 = hook_events.index("reduce:fc2")
    assert hook_events.index("stage2_backward:") < reduce_fc2 < hook_events.index("stage1_backward:"), (
        hook_events
    )
    assert hook_events.index("stage1_backward:") < hook_events.index("reduce:fc1")
