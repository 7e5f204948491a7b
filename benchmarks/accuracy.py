"""Accuracy of a quantised expert path: SNR and cosine of y, dx, dW1, dW2 against bf16 and float64.

One random problem (Gaussian tokens and output gradient, weights scaled by 1/sqrt(fan-in), random
top-k routing with softmax weights) runs three ways through :func:`megamoe.fused_mega_moe`: float64
(the truth), bf16 (``precision="bf16"``) and bf16 with ``precision="mxfp8"`` (or ``--precision fp8``).
The figures in ``docs/mxfp8.md`` and ``docs/fp8.md`` come from ``python -m benchmarks.accuracy``; on a
GPU, ``--device cuda --backend triton`` measures a kernel backend the same way.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import click
import torch
from torch import Tensor

from megamoe import fused_mega_moe

OUTPUTS = ("y", "dx", "dw1", "dw2")


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """Shape and seed of the measured problem (one EP rank)."""

    tokens: int
    hidden: int
    inter: int
    experts: int
    topk: int
    seed: int = 0


def snr_db(got: Tensor, ref: Tensor) -> float:
    """``10 log10(|ref|^2 / |got - ref|^2)`` in float64 (inf when equal)."""
    ref = ref.double()
    noise = (got.double() - ref).pow(2).sum()
    return float("inf") if noise == 0 else (10 * torch.log10(ref.pow(2).sum() / noise)).item()


def cosine(got: Tensor, ref: Tensor) -> float:
    return torch.nn.functional.cosine_similarity(got.double().flatten(), ref.double().flatten(), dim=0).item()


def _inputs(problem: Problem, device: torch.device) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(problem.seed)
    T, H, I, E, K = problem.tokens, problem.hidden, problem.inter, problem.experts, problem.topk
    scores = torch.randn(T, E, generator=g, dtype=torch.float64)
    top, idx = scores.topk(K, dim=1)
    tensors = {
        "x": torch.randn(T, H, generator=g, dtype=torch.float64),
        "topk_idx": idx,
        "topk_weights": top.softmax(dim=1),
        "w1": torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / H**0.5,
        "w2": torch.randn(E, H, I, generator=g, dtype=torch.float64) / I**0.5,
        "dy": torch.randn(T, H, generator=g, dtype=torch.float64),
    }
    return {name: t.to(device) for name, t in tensors.items()}


def _run(inputs: dict[str, Tensor], dtype: torch.dtype, *, backend: str, precision: str) -> dict[str, Tensor]:
    x, w1, w2 = (inputs[n].to(dtype).requires_grad_() for n in ("x", "w1", "w2"))
    y = fused_mega_moe(
        x, inputs["topk_idx"], inputs["topk_weights"].float(), w1, w2, backend=backend, precision=precision
    )
    dx, dw1, dw2 = torch.autograd.grad(y, (x, w1, w2), inputs["dy"].to(dtype))
    return {"y": y.detach(), "dx": dx, "dw1": dw1, "dw2": dw2}


def measure(
    problem: Problem, *, device: str = "cpu", backend: str = "reference", precision: str = "mxfp8"
) -> dict[str, dict[str, float]]:
    """``{comparison: {"<output> snr_db" | "<output> cos": value}}`` for bf16 and ``precision`` vs
    float64, ``precision`` vs bf16."""
    inputs = _inputs(problem, torch.device(device))
    truth = _run(inputs, torch.float64, backend="reference", precision="bf16")
    bf16 = _run(inputs, torch.bfloat16, backend=backend, precision="bf16")
    quantised = _run(inputs, torch.bfloat16, backend=backend, precision=precision)
    pairs = {
        "bf16 vs float64": (bf16, truth),
        f"{precision} vs float64": (quantised, truth),
        f"{precision} vs bf16": (quantised, bf16),
    }
    report = {}
    for label, (got, ref) in pairs.items():
        report[label] = {}
        for name in OUTPUTS:
            report[label][f"{name} snr_db"] = round(snr_db(got[name], ref[name]), 2)
            report[label][f"{name} cos"] = round(cosine(got[name], ref[name]), 5)
    return report


def format_report(problem: Problem, report: dict[str, dict[str, float]]) -> str:
    """A Markdown table: one row per comparison, SNR (dB) / cosine per output."""
    lines = [
        f"T={problem.tokens} H={problem.hidden} I={problem.inter} E={problem.experts} K={problem.topk} seed={problem.seed}",
        "",
        "| comparison | " + " | ".join(f"{n} SNR dB / cos" for n in OUTPUTS) + " |",
        "|---" * (len(OUTPUTS) + 1) + "|",
    ]
    for label, values in report.items():
        cells = [f"{values[f'{n} snr_db']:.2f} / {values[f'{n} cos']:.5f}" for n in OUTPUTS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--tokens", default=2048, show_default=True, help="tokens T on the rank")
@click.option("--hidden", default=1024, show_default=True, help="hidden size H")
@click.option("--inter", default=512, show_default=True, help="expert intermediate size I")
@click.option("--experts", default=8, show_default=True, help="experts E")
@click.option("--topk", default=4, show_default=True, help="experts per token K")
@click.option("--seed", default=0, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="torch device, e.g. cuda")
@click.option(
    "--backend", default="reference", show_default=True, help="backend measured for bf16 and the precision"
)
@click.option(
    "--precision",
    type=click.Choice(["mxfp8", "fp8"]),
    default="mxfp8",
    show_default=True,
    help="quantised precision measured",
)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a Markdown table")
@click.option("--dry-run", is_flag=True, help="print the problem and exit without computing")
def main(
    tokens: int,
    hidden: int,
    inter: int,
    experts: int,
    topk: int,
    seed: int,
    device: str,
    backend: str,
    precision: str,
    as_json: bool,
    dry_run: bool,
) -> None:
    """Measure a quantised expert path's accuracy (forward and backward) against bf16 and float64."""
    if topk > experts:
        raise click.BadParameter(
            f"{topk} exceeds --experts {experts}; set --topk <= {experts}", param_hint="--topk"
        )
    problem = Problem(tokens=tokens, hidden=hidden, inter=inter, experts=experts, topk=topk, seed=seed)
    if dry_run:
        click.echo(
            json.dumps(
                {"problem": asdict(problem), "device": device, "backend": backend, "precision": precision},
                sort_keys=True,
            )
        )
        return
    report = measure(problem, device=device, backend=backend, precision=precision)
    if as_json:
        click.echo(json.dumps({"problem": asdict(problem), "report": report}, sort_keys=True))
    else:
        click.echo(format_report(problem, report))


if __name__ == "__main__":
    main()
