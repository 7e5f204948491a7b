"""The MXFP8 Triton backend on a CUDA GPU (device machine only): accuracy, capture, determinism.

``pytest -m gpu tests/megamoe/triton_mx`` (the unmarked tests in this folder run on the GPU too).

Accuracy at DeepSeek-V3's per-rank shape (H 7168, I 2048, 32 experts, top-8, T 8192), bf16 inputs:

* against the MX emulation (:class:`MXFP8ReferenceBackend`, same operands, float32 products):
  SNR >= 40 dB for y, dx, d_topk_weights, dW1, dW2. What is left is the summation order, Hopper's
  reduced-precision accumulation inside each 32-deep FP8 MMA, and bf16 intermediates (``o``, the
  dgrad rows) where the emulation keeps float32.
* against the float32 reference (``precision="bf16"`` on float32 copies): cosine >= 0.997 and
  SNR >= 23 dB. The issue asked for 25 dB; docs/mxfp8.md measures the emulation itself at
  23.4-23.6 dB on this data (every GEMM operand in E4M3), so 25 dB is a property of the recipe that
  no kernel can reach; 23 dB is the bar docs/mxfp8.md restates.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.accuracy import cosine, snr_db
from benchmarks.common import MODELS, ModelShape, capture, make_routing
from megamoe import fused_mega_moe
from megamoe.backends.triton_mx.quantize_rows import quantize_rows
from megamoe.backends.triton_mx.weights import weight_cache
from megamoe.quant.mx import quantize_mx

pytestmark = pytest.mark.gpu

GRADS = ("y", "dx", "d_topk_weights", "dw1", "dw2")
SMALL = ModelShape(hidden=1024, inter=384, experts=8, topk=4, tokens=2048)


def _inputs(shape: ModelShape, routing: str, *, drop: float = 0.0, seed: int = 0):
    torch.manual_seed(seed)
    dev = torch.device("cuda")
    T, H, I, G = shape.tokens, shape.hidden, shape.inter, shape.experts
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    w1 = (torch.randn(G, 2 * I, H, device=dev) / H**0.5).bfloat16()
    w2 = (torch.randn(G, H, I, device=dev) / I**0.5).bfloat16()
    idx, tw = make_routing(shape, routing, device=dev, seed=seed)
    if drop:
        idx = torch.where(torch.rand(idx.shape, device=dev) < drop, -1, idx)
    dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    return x, idx, tw, w1, w2, dy


def _run(backend: str, precision: str, x, idx, tw, w1, w2, dy, dtype=None) -> dict[str, torch.Tensor]:
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (x, tw, w1, w2)]
    y = fused_mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], backend=backend, precision=precision)
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return dict(zip(GRADS, (y.detach(), *grads), strict=True))


def _first_mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a != b).nonzero()
    if diff.numel() == 0:
        return ""
    where = tuple(diff[0].tolist())
    return f"first mismatch at {where}: {a[where].item()} vs {b[where].item()}"


@pytest.fixture(scope="module")
def deepseek() -> dict[str, dict[str, torch.Tensor]]:
    inputs = _inputs(MODELS["DeepSeek-V3"], "uniform")
    return {
        "ours": _run("triton", "mxfp8", *inputs),
        "emulation": _run("reference", "mxfp8", *inputs),
        "fp32": _run("reference", "bf16", *inputs, dtype=torch.float32),
    }


def test_triton_mxfp8_deepseek_v3_matches_emulation(deepseek) -> None:
    ours, ref = deepseek["ours"], deepseek["emulation"]
    report = {n: snr_db(ours[n], ref[n]) for n in GRADS}
    print("vs emulation:", {n: f"{s:.1f} dB" for n, s in report.items()})
    for name, snr in report.items():
        assert torch.isfinite(ours[name]).all(), name
        assert snr >= 40.0, f"{name}: SNR {snr:.1f} dB against the MX emulation"


def test_triton_mxfp8_deepseek_v3_against_fp32_reference(deepseek) -> None:
    ours, ref = deepseek["ours"], deepseek["fp32"]
    report = {n: (cosine(ours[n], ref[n]), snr_db(ours[n], ref[n])) for n in ("y", "dx", "dw1", "dw2")}
    print("vs fp32:", {n: f"cos={c:.5f} snr={s:.2f}dB" for n, (c, s) in report.items()})
    for name, (cos, snr) in report.items():
        assert cos >= 0.997 and snr >= 23.0, f"{name}: cosine {cos:.5f}, SNR {snr:.2f} dB"


def test_triton_mxfp8_quantisers_bitwise_on_gpu_at_bench_sizes() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 7168, device="cuda", generator=g) * torch.exp2(
        torch.randint(-20, 21, (8192, 7168), device="cuda", generator=g).float()
    )
    x[0, :64] = torch.tensor([float("nan"), float("inf"), 1e-40, 0.0] * 16, device="cuda")
    for src in (x, x.bfloat16()):
        got, want = quantize_rows(src), quantize_mx(src, dim=1)
        assert torch.equal(got.scale, want.scale), _first_mismatch(got.scale, want.scale)
        a, b = got.data.view(torch.uint8), want.data.view(torch.uint8)
        assert torch.equal(a, b), _first_mismatch(a, b)
    w = (torch.randn(4, 4096, 7168, device="cuda", generator=g) / 7168**0.5).bfloat16()
    cache = weight_cache()
    for transposed in (False, True):
        got = cache.get(w, transposed=transposed)
        want = quantize_mx(w.transpose(1, 2) if transposed else w, dim=-1)
        assert torch.equal(got.scale, want.scale), f"transposed={transposed}"
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), (
            f"transposed={transposed}"
        )


def test_triton_mxfp8_deterministic_same_bits_every_run() -> None:
    inputs = _inputs(MODELS["Qwen3-30B-A3B"], "skewed", drop=0.05)
    first = _run("triton", "mxfp8", *inputs)
    for _ in range(2):
        again = _run("triton", "mxfp8", *inputs)
        for name in GRADS:
            assert torch.equal(first[name], again[name]), (
                f"{name}: {_first_mismatch(first[name], again[name])}"
            )


def test_triton_mxfp8_cuda_graph_capture_and_replay_equal_eager() -> None:
    static = [t.detach().clone() for t in _inputs(SMALL, "skewed", drop=0.1)]
    for i in (0, 2, 3, 4):
        static[i].requires_grad_()
    sx, sidx, stw, sw1, sw2, sdy = static

    def step():
        y = fused_mega_moe(sx, sidx, stw, sw1, sw2, backend="triton", precision="mxfp8")
        return (y, *torch.autograd.grad(y, [sx, stw, sw1, sw2], sdy))

    graph, outs = capture(step, warmup=2)
    for seed in (1, 2):  # new tokens, routing and weights: the replay re-quantises the weights too
        fresh = _inputs(SMALL, "uniform", drop=0.2, seed=seed)
        with torch.no_grad():
            for s, f in zip(static, fresh, strict=True):
                s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        eager = _run("triton", "mxfp8", *fresh)
        for name, got in zip(GRADS, outs, strict=True):
            assert torch.equal(got, eager[name]), f"{name}: {_first_mismatch(got, eager[name])}"
