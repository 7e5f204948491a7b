"""The MXFP8 Triton backend against the exact emulation (:class:`MXFP8ReferenceBackend`), on the CPU.

Under ``TRITON_INTERPRET=1`` (float32 inputs) every kernel runs: quantisers, the MX GEMMs with the
gather, the SwiGLU passes, the wgrad and the combine. Both sides quantise the same float32 values to
the same bytes (tested bitwise in test_quantize.py), so what differs is the fp32 summation order and
``silu``'s last bit: SNR >= 60 dB against the emulation, per output. Ragged cases: H and I multiples
of 16 but not of 32 (short last blocks), empty experts, dropped slots, all slots dropped, no tokens.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.accuracy import snr_db
from megamoe import dispatch_grouped_gemm, fused_mega_moe
from megamoe.backends import get_backend, resolve_backend_name
from megamoe.backends.quantized_reference import MXFP8ReferenceBackend
from megamoe.backends.quantized_triton import QuantizedTritonBackend
from megamoe.errors import UnsupportedSettingError
from tests.megamoe.triton_mx.test_quantize import DEVICE

FLOOR_DB = 60.0 if DEVICE.type == "cpu" else 40.0
"""SNR against the emulation: fp32 summation order only (CPU); the tensor core's accumulation (GPU:
52-59 dB on an H100)."""

GRADS = ("y", "dx", "d_topk_weights", "dw1", "dw2")


def _case(
    T: int, H: int, I: int, G: int, K: int, *, drop: float, empty: int = 0, seed: int = 0, device=DEVICE
):
    """Inputs spread over 2**±6 per element, so a block or scale mix-up cannot hide in the noise."""
    g = torch.Generator().manual_seed(seed)

    def spread(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-6, 7, shape, generator=g).float())

    x = spread(T, H)
    idx = torch.randint(0, G, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < drop] = -1
    idx[idx < empty] = -1
    tw = torch.rand(T, K, generator=g)
    w1 = spread(G, 2 * I, H) / H**0.5
    w2 = spread(G, H, I) / I**0.5
    dy = spread(T, H)
    return tuple(t.to(device) for t in (x, idx, tw, w1, w2, dy))


def _run(backend: str, x, idx, tw, w1, w2, dy) -> dict[str, torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in (x, tw, w1, w2)]
    y = fused_mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], backend=backend, precision="mxfp8")
    grads = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    return dict(zip(GRADS, (y.detach(), *grads), strict=True))


@pytest.mark.parametrize(
    ("T", "H", "I", "G", "K", "drop", "empty"),
    [
        pytest.param(23, 48, 80, 5, 3, 0.15, 2, marks=pytest.mark.slow),
        (40, 64, 32, 3, 2, 0.0, 0),
        (9, 16, 16, 4, 4, 1.0, 0),
        (0, 32, 16, 3, 2, 0.0, 0),
    ],
    ids=["ragged-drops-empty-experts", "full-blocks", "all-slots-dropped", "no-tokens"],
)
def test_triton_mxfp8_matches_emulation(
    T: int, H: int, I: int, G: int, K: int, drop: float, empty: int
) -> None:
    case = _case(T, H, I, G, K, drop=drop, empty=empty)
    ours, ref = _run("triton", *case), _run("reference", *case)
    for name in GRADS:
        got, want = ours[name], ref[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.isfinite(got).all(), name
        if want.numel() == 0 or want.abs().max() == 0:
            assert (got == 0).all(), f"{name}: expected zeros"
            continue
        assert snr_db(got, want) >= FLOOR_DB, f"{name}: {snr_db(got, want):.1f} dB"


def test_triton_mxfp8_stage1_pads_dropped_rows_with_zeros_and_matches_emulation() -> None:
    x, idx, tw, w1, *_ = _case(21, 32, 48, 4, 2, drop=0.3)
    h, weights, _ = dispatch_grouped_gemm(x, idx, tw, w1, backend="triton", precision="mxfp8")
    h_ref, weights_ref, _ = dispatch_grouped_gemm(x, idx, tw, w1, backend="reference", precision="mxfp8")
    rows = h_ref.shape[0]
    assert h.shape == (21 * 2, 96) and (h[rows:] == 0).all()
    assert snr_db(h[:rows], h_ref) >= 60.0
    torch.testing.assert_close(weights[:rows], weights_ref)


@pytest.mark.slow
def test_triton_mxfp8_same_bits_on_repeat() -> None:
    case = _case(30, 32, 32, 3, 2, drop=0.1)
    first, again = _run("triton", *case), _run("triton", *case)
    for name in GRADS:
        assert torch.equal(first[name], again[name]), name


def test_triton_mxfp8_width_not_a_multiple_of_16_names_the_setting() -> None:
    x, idx, tw, w1, w2, _ = _case(4, 24, 16, 2, 1, drop=0.0)
    with pytest.raises(UnsupportedSettingError, match=r"^hidden size H=24: .*Use a multiple of 16"):
        fused_mega_moe(x, idx, tw, w1, w2, backend="triton", precision="mxfp8")


def test_mxfp8_backend_selection() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend_name("auto", device=cpu, dtype=torch.bfloat16, precision="mxfp8") == "reference"
    want = "reference" if torch.version.hip is not None else "triton"
    assert resolve_backend_name("auto", device=cuda, dtype=torch.bfloat16, precision="mxfp8") == want
    triton_mx = get_backend("triton", device=cpu, dtype=torch.float32, precision="mxfp8")
    assert isinstance(triton_mx, QuantizedTritonBackend) and triton_mx.name == "triton_mxfp8"
    assert isinstance(
        get_backend("auto", device=cpu, dtype=torch.float32, precision="mxfp8"), MXFP8ReferenceBackend
    )


def _ep_rank(rank: int, world: int, case: tuple) -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed as dist

    from tests.megamoe.triton.interpreter_compat import install

    install()
    x, idx, tw, w1, w2, dy = (t[rank] for t in case)
    G = w1.shape[0] // world
    local = [w[rank * G : (rank + 1) * G] for w in (w1, w2)]
    out = {}
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (x, tw, *local)]
        y = fused_mega_moe(
            *leaves[:1], idx, *leaves[1:], group=dist.group.WORLD, backend=backend, precision="mxfp8"
        )
        grads = torch.autograd.grad(y, leaves, dy)
        out[backend] = dict(zip(GRADS, (y.detach(), *grads), strict=True))
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors need TRITON_INTERPRET=1")
def test_triton_mxfp8_ep2_over_gloo_matches_emulation_at_ep2(tmp_path) -> None:
    """EP = 2 through the NCCL/gloo TokenExchange (bf16 rows exchanged, quantised after), ragged T."""
    from tests._dist import run_ranks

    per_rank = [_case(T, 32, 16, 4, 2, drop=0.1, seed=s, device="cpu") for s, T in ((1, 11), (2, 6))]
    w1, w2 = per_rank[0][3], per_rank[0][4]
    case = tuple([c[i] if i not in (3, 4) else (w1, w2)[i - 3] for c in per_rank] for i in range(6))
    for rank, got in enumerate(run_ranks(_ep_rank, 2, tmp_path, case)):
        for name in GRADS:
            ours, ref = got["triton"][name], got["reference"][name]
            assert snr_db(ours, ref) >= 60.0, f"rank {rank} {name}: {snr_db(ours, ref):.1f} dB"
