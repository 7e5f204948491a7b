"""Accuracy of each implementation the layer bench times: SNR of ``y`` and of every gradient against float32.

The bench's second table, so a speed-up never hides a wrong or sloppier result: every implementation
(ours, the torch pipeline, SonicMoE) runs forward and backward once on the bench's own bf16 inputs with
one seeded output gradient, and :func:`megamoe.fused_mega_moe`'s reference backend runs the same on
float32 copies of those inputs (PyTorch's default float32 matmuls, no TF32). Per output,
``SNR = 10 log10(|ref|^2 / |got - ref|^2)`` dB (:func:`benchmarks.accuracy.snr_db`), the measure the
GPU tests hold the Triton backend to (tests/megamoe/triton/test_gpu_backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from benchmarks.accuracy import snr_db
from megamoe import fused_mega_moe

OUTPUTS = {"y": "y", "dx": "dx", "d_topk_weights": "d(topk_weights)", "dw1": "dW1", "dw2": "dW2"}
"""Output -> its column in the table; the gradients in the order of the layer's leaves after ``y``."""

CAPTION = (
    "SNR dB against the float32 reference backend (and a quantised precision's exact emulation), "
    "forward and backward on the inputs timed above:"
)


@dataclass(slots=True)
class Accuracy:
    model: str
    routing: str
    impl: str
    snr_db: dict[str, float]
    against: str = "float32"
    """the reference: ``float32``, or the precision whose exact emulation it was compared with."""


def _outputs(y: Tensor, leaves: list[Tensor], dy: Tensor) -> dict[str, Tensor]:
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return dict(zip(OUTPUTS, (y.detach(), *grads), strict=True))


def _emulation(inputs: tuple[Tensor, ...], precision: str, dy: Tensor) -> dict[str, Tensor]:
    """The exact emulation of ``precision`` on the bench's own (bf16) inputs: it hands ``h`` and ``dh``
    between the stages in their dtype, as the kernels do, so the comparison sees the kernels' error only."""
    x, idx, tw, w1, w2 = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (x, tw, w1, w2)]
    y = fused_mega_moe(leaves[0], idx, *leaves[1:], backend="reference", precision=precision)
    return _outputs(y, leaves, dy)


def _snr(got: dict[str, Tensor], ref: dict[str, Tensor]) -> dict[str, float]:
    return {name: round(snr_db(got[name].float(), ref[name].float()), 2) for name in OUTPUTS}


def measure(
    cases: list, inputs: tuple[Tensor, ...], *, seed: int = 1, emulated: dict[str, str] | None = None
) -> list[tuple[str, str, dict[str, float]]]:
    """``(impl, against, {output: SNR dB})`` of each layer case ``(impl, forward, [x, topk_weights, w1,
    w2])`` of the bench, on ``inputs = (x, topk_idx, topk_weights, w1, w2)``: against float32 for every
    case, and against its precision's exact emulation for the impls ``emulated`` maps to one."""
    x, idx, tw, w1, w2 = inputs
    g = torch.Generator(device=x.device).manual_seed(seed)
    dy = torch.randn(x.shape, generator=g, device=x.device, dtype=torch.float32)
    leaves = [t.detach().float().requires_grad_() for t in (x, tw, w1, w2)]
    ref = _outputs(fused_mega_moe(leaves[0], idx, *leaves[1:], backend="reference"), leaves, dy)
    emulated = emulated or {}
    report = []
    for impl, forward, case_leaves in cases:
        got = _outputs(forward(), case_leaves, dy)
        report.append((impl, "float32", _snr(got, ref)))
        if impl in emulated:
            report.append((impl, emulated[impl], _snr(got, _emulation(inputs, emulated[impl], dy))))
    return report


def format_table(rows: list[Accuracy], labels: dict[str, str]) -> str:
    """One line per (model, routing, impl), impl named by ``labels``: the SNR of each output."""
    lines = [
        "| model | routing | impl | against | " + " | ".join(OUTPUTS.values()) + " |",
        "|---|---|---|---|" + "---|" * len(OUTPUTS),
    ]
    for r in rows:
        cells = [f"{r.snr_db[name]:.1f}" for name in OUTPUTS]
        against = r.against if r.against == "float32" else f"{r.against} emulation"
        lines.append(
            f"| {r.model} | {r.routing} | {labels.get(r.impl, r.impl)} | {against} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)
