"""``opaque_op``: the plain function in eager mode, the registered custom op under torch.compile."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megamoe.backends.opaque import opaque_op

CALLS: list[str] = []


@opaque_op("megamoe_test::scaled_copy")
def scaled_copy(x: torch.Tensor, scale: float) -> torch.Tensor:
    CALLS.append("body")
    return x * scale


@scaled_copy.register_fake
def _(x, scale):
    CALLS.append("fake")
    return torch.empty_like(x)


def test_eager_calls_run_the_body_without_the_dispatcher() -> None:
    CALLS.clear()
    x = torch.arange(4.0)
    assert torch.equal(scaled_copy(x, 2.0), x * 2)
    assert CALLS == ["body"]
    assert scaled_copy.__name__ == "scaled_copy" and scaled_copy.__doc__ is None


def test_the_op_is_registered_with_its_fake() -> None:
    CALLS.clear()
    x = torch.arange(4.0)
    assert torch.equal(torch.ops.megamoe_test.scaled_copy(x, 3.0), x * 3)
    with FakeTensorMode() as mode:
        out = scaled_copy.op(mode.from_tensor(x), 3.0)
    assert out.shape == x.shape and CALLS == ["body", "fake"]


def test_dynamo_sees_one_opaque_node(monkeypatch) -> None:
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)  # the suite runs with dynamo off
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    x = torch.arange(4.0)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(disable=False):
            fn = torch.compile(lambda x: scaled_copy(x, 2.0) + 1, backend=backend, fullgraph=True)
            assert torch.equal(fn(x), x * 2 + 1)
    finally:
        torch._dynamo.reset()
    assert any("megamoe_test.scaled_copy" in target for target in seen), seen
