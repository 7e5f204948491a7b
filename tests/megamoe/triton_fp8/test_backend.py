"""The FP8 Triton backend against the exact emulation (:class:`FP8ReferenceBackend`), on the CPU.

Under ``TRITON_INTERPRET=1`` (float32 inputs) every kernel runs: the quantisers, the FP8 GEMMs with
the gather, the SwiGLU passes, the wgrad and the combine. Both sides quantise the same float32 values
to the same bytes (test_quantize.py), so what differs is the fp32 summation order and ``silu``'s last
bit: SNR >= 60 dB against the emulation, per output. On a GPU the floor is 40 dB, the bar of the
bench shapes: Hopper's FP8 MMA adds its 128 products in reduced precision before they reach the fp32
accumulator (measured 48 dB at the largest case here). Ragged cases: H and I multiples of 16 but not of
128 (short last K tiles; experts whose rows end inside a 128-row wgrad tile), more than one K tile,
empty experts, dropped slots, all slots dropped, no tokens; EP = 2 over gloo.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.accuracy import snr_db
from megamoe import fused_mega_moe
from megamoe.backends import get_backend, resolve_backend_name
from megamoe.backends.quantized_reference import FP8ReferenceBackend
from megamoe.backends.quantized_triton import QuantizedTritonBackend
from megamoe.errors import UnsupportedSettingError
from megamoe.quant import advance_weight_generation
from megamoe.settings import EPSettings
from tests.megamoe.triton_mx.test_backend import GRADS, _case
from tests.megamoe.triton_mx.test_quantize import DEVICE

FLOOR_DB = 60.0 if DEVICE.type == "cpu" else 40.0
"""SNR against the emulation: fp32 summation order only (CPU); the tensor core's FP8 accumulation (GPU)."""


def _run(backend: str, x, idx, tw, w1, w2, dy, **kwargs) -> dict[str, torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in (x, tw, w1, w2)]
    y = fused_mega_moe(leaves[0], idx, *leaves[1:], backend=backend, precision="fp8", **kwargs)
    grads = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    return dict(zip(GRADS, (y.detach(), *grads), strict=True))


def _assert_matches(ours: dict, ref: dict, floor: float = FLOOR_DB, where: str = "") -> None:
    for name in GRADS:
        got, want = ours[name], ref[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.isfinite(got).all(), name
        if want.numel() == 0 or want.abs().max() == 0:
            assert (got == 0).all(), f"{where}{name}: expected zeros"
            continue
        assert snr_db(got, want) >= floor, f"{where}{name}: {snr_db(got, want):.1f} dB"


@pytest.mark.parametrize(
    ("T", "H", "I", "G", "K", "drop", "empty"),
    [
        pytest.param(150, 144, 160, 3, 2, 0.1, 1, marks=pytest.mark.slow),
        (23, 48, 80, 5, 3, 0.15, 2),
        (9, 16, 16, 4, 4, 1.0, 0),
        (0, 32, 16, 3, 2, 0.0, 0),
    ],
    ids=["two-k-tiles-ragged-wgrad-tiles", "ragged-drops-empty-experts", "all-slots-dropped", "no-tokens"],
)
def test_triton_fp8_matches_emulation(
    T: int, H: int, I: int, G: int, K: int, drop: float, empty: int
) -> None:
    case = _case(T, H, I, G, K, drop=drop, empty=empty)
    _assert_matches(_run("triton", *case), _run("reference", *case))


def test_dw1_from_t_x_made_in_column_chunks_has_the_same_bits(monkeypatch) -> None:
    """``t(x)`` along R for dW1 in three column chunks (the last one ragged): the same gradients, bit
    for bit, as from one quantisation of every column."""
    from megamoe.backends.triton import configs

    case = _case(23, 48, 80, 5, 3, drop=0.15, empty=2)
    whole = _run("triton", *case)
    monkeypatch.setattr(configs, "WGRAD_OPERAND_CHUNK_BYTES", 1)
    assert configs.column_chunks(69, 48, 1, 16) == [(0, 16), (16, 32), (32, 48)]
    chunked = _run("triton", *case)
    for name in GRADS:
        assert torch.equal(chunked[name], whole[name]), name


@pytest.mark.parametrize("room", [None, 16])
def test_dw1_operands_made_in_grad_h_bytes_have_the_same_bits(monkeypatch, room) -> None:
    """When stage 2 wrote ``dh`` over the layer's private ``h``, dW1's operands live in those bytes once
    ``t(dh)`` is made: ``t(dh)`` moved to their start, ``t(x)`` after it in as few column chunks as fit
    (``room``: the bytes cut short to fit 16 of its 48 columns). The same gradients, bit for bit, as
    from their own buffers (a retained graph keeps ``h``, so there they get them)."""
    from megamoe.backends.triton_fp8 import experts

    spans, operands = [], []
    moved_into, wgrad = experts._moved_into, experts.FP8Experts._wgrad

    def spy_moved_into(p, scratch, num_blocks):
        raw = scratch.view(-1).view(torch.uint8)
        if room:
            need = experts.segments_bytes(p.data.shape[0], num_blocks)
            raw = raw[: need + experts.segments_bytes(room, num_blocks)]
        spans.append((raw.data_ptr(), raw.data_ptr() + raw.numel()))
        return moved_into(p, raw, num_blocks)

    def spy_wgrad(self, p, q, out, plan):
        operands.append((p.data.data_ptr(), q.data.data_ptr(), q.data.shape[0]))
        return wgrad(self, p, q, out, plan)

    monkeypatch.setattr(experts, "_moved_into", spy_moved_into)
    monkeypatch.setattr(experts.FP8Experts, "_wgrad", spy_wgrad)
    # enough rows per expert for t(dh) along R (128-row tiles) to fit in dh's bytes with room after it
    x, idx, tw, w1, w2, dy = _case(300, 48, 80, 2, 2, drop=0.05, empty=0)

    def grads(retain_graph: bool) -> tuple[torch.Tensor, ...]:
        leaves = [t.clone().requires_grad_() for t in (x, tw, w1, w2)]
        y = fused_mega_moe(leaves[0], idx, *leaves[1:], backend="triton", precision="fp8")
        return torch.autograd.grad(y, leaves, dy, retain_graph=retain_graph)

    in_scratch = grads(retain_graph=False)
    (lo, hi), dw1_operands = spans[0], operands[1:]  # operands[0]: dW2's
    widths = [cols for *_, cols in dw1_operands]
    assert len(spans) == 1 and sum(widths) == 48 and (widths == [16] * 3 if room else len(widths) < 3)
    for p_at, q_at, _ in dw1_operands:
        assert p_at == lo and lo < q_at < hi
    own_buffers = grads(retain_graph=True)
    assert len(spans) == 1  # not asked: grad_h was not scratch
    for name, a, b in zip(GRADS[1:], in_scratch, own_buffers, strict=True):
        assert torch.equal(a, b), name


def test_t_x_goes_in_scratch_bytes_only_where_it_fits() -> None:
    """``segments_in`` lays the operand out in the buffer (data, then scales 16-byte aligned) or says no."""
    from megamoe.backends.triton_fp8.quantize import segments_in

    cols, blocks = 48, 3  # data 48 * 384 = 18432 bytes, scales 576 bytes from 18432
    fits = torch.empty(19008 // 2, dtype=torch.bfloat16)
    op = segments_in(fits, cols, blocks)
    assert op.data.shape == (cols, 384) and op.scale.shape == (cols, blocks)
    assert op.data.data_ptr() == fits.data_ptr() and op.scale.data_ptr() == fits.data_ptr() + 18432
    assert segments_in(fits[:-1], cols, blocks) is None
    assert segments_in(torch.empty(200, 100, dtype=torch.bfloat16)[:, :96], cols, blocks) is None  # strided


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
def test_backward_frees_its_largest_temporaries_before_the_weight_gradients(monkeypatch, precision) -> None:
    """Stage 2's fp32 ``da [R, I]`` is freed before dW2's wgrad, and stage 1's ``dx`` rows ``[R, H]``
    before dW1's: neither is alive beside a weight gradient and its operands (each held there as much
    memory as the operand itself)."""
    import weakref

    from megamoe.backends.triton_fp8.experts import FP8Experts
    from megamoe.backends.triton_mx.experts import MXExperts

    cls = FP8Experts if precision == "fp8" else MXExperts
    temporaries: dict[str, list[weakref.ref]] = {}
    checked: list[str] = []

    def tracking(name: str, fn, grab):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            temporaries.setdefault(name, []).append(weakref.ref(grab(args, out)))
            return out

        return wrapped

    def tracking_sink(fn):
        def wrapped(self, grad_h, w1, plan, sink):
            def tracked(rows, first):
                temporaries.setdefault("dx rows", []).append(weakref.ref(rows))
                sink(rows, first)

            return fn(self, grad_h, w1, plan, tracked)

        return wrapped

    def freed_before(temporary: str, fn):
        def wrapped(*args, **kwargs):
            if temporary in temporaries:
                alive = any(ref() is not None for ref in temporaries[temporary])
                assert not alive, f"{temporary} is alive at {fn.__name__}"
                checked.append(temporary)
            return fn(*args, **kwargs)

        return wrapped

    swiglu_backward = tracking("da", cls.swiglu_backward_quant, lambda a, out: a[1])
    monkeypatch.setattr(cls, "swiglu_backward_quant", staticmethod(swiglu_backward))
    monkeypatch.setattr(cls, "dgrad1", tracking_sink(cls.dgrad1))
    monkeypatch.setattr(cls, "_along_r", freed_before("da", cls._along_r))
    monkeypatch.setattr(cls, "wgrad1", freed_before("dx rows", cls.wgrad1))
    x, idx, tw, w1, w2, dy = _case(23, 48, 80, 5, 3, drop=0.15, empty=2)
    leaves = [t.clone().requires_grad_() for t in (x, tw, w1, w2)]
    y = fused_mega_moe(leaves[0], idx, *leaves[1:], backend="triton", precision=precision)
    torch.autograd.grad(y, leaves, dy)
    assert {"da", "dx rows"} <= set(checked)


def test_dgrad1_output_ranges_are_no_larger_than_dw1() -> None:
    from megamoe.backends.triton_fp8.experts import dgrad1_columns

    assert dgrad1_columns(65536, 7168, 32 * 4096) == [(0, 7168)]  # DeepSeek-V3: dW1 is larger
    assert dgrad1_columns(65536, 4096, 16 * 3072) == [(0, 2048), (2048, 4096)]  # Qwen3-235B-A22B
    assert dgrad1_columns(128, 300, 64) == [(0, 256), (256, 300)]  # 128-wide but the last
    assert dgrad1_columns(1000, 256, 1) == [(0, 128), (128, 256)]  # never narrower than a weight block
    assert dgrad1_columns(0, 256, 64) == [(0, 256)]


def test_dx_rows_made_in_column_ranges_have_the_bits_of_one_range(monkeypatch) -> None:
    """More rows than dW1 has: fc1's dgrad makes its ``[R, H]`` output in two column ranges, each freed
    before the next is made, and every gradient has the bits of making it whole (and matches the
    emulation)."""
    import weakref

    from megamoe.backends.triton_fp8 import experts

    T, H, I, G, K = 64, 256, 16, 2, 2
    case = _case(T, H, I, G, K, drop=0.0, empty=0)
    assert len(experts.dgrad1_columns(T * K, H, G * 2 * I)) == 2
    ranges: list[tuple[weakref.ref, int, int]] = []
    dgrad1 = experts.FP8Experts.dgrad1

    def recording(self, grad_h, w1, plan, sink):
        def sink_checking(rows, first):
            assert all(ref() is None for ref, *_ in ranges), "an earlier range is alive"
            ranges.append((weakref.ref(rows), first, rows.shape[1]))
            sink(rows, first)

        dgrad1(self, grad_h, w1, plan, sink_checking)

    monkeypatch.setattr(experts.FP8Experts, "dgrad1", recording)
    in_ranges = _run("triton", *case)
    assert [r[1:] for r in ranges] == [(0, 128), (128, 128)]
    _assert_matches(in_ranges, _run("reference", *case))
    monkeypatch.setattr(experts, "dgrad1_columns", lambda rows, cols, weight_rows: [(0, cols)])
    whole = _run("triton", *case)
    assert [r[1:] for r in ranges[2:]] == [(0, 256)]
    for name in GRADS:
        assert torch.equal(in_ranges[name], whole[name]), name


def test_triton_fp8_weight_cache_follows_an_optimizer_step() -> None:
    """After an in-place update and ``advance_weight_generation`` (what the trainer does per step), the
    kernels read the new weights forward and backward: every output equals the emulation on them, not
    on the cached old ones. Each step's forward quantises both forms of a weight in one pass (2 misses),
    and its backward is served the transposed form (a hit)."""
    x, idx, tw, w1, w2, dy = _case(12, 32, 32, 2, 2, drop=0.0, seed=4)
    w1, w2 = w1.requires_grad_(), w2.requires_grad_()  # one parameter tensor each, as in training
    cache = get_backend("triton", device=x.device, dtype=x.dtype, precision="fp8").weight_cache

    def step() -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
        before = cache.misses, cache.hits
        leaves = x.clone().requires_grad_(), tw.clone().requires_grad_()
        y = fused_mega_moe(leaves[0], idx, leaves[1], w1, w2, backend="triton", precision="fp8")
        grads = torch.autograd.grad(y, (*leaves, w1, w2), dy)
        outputs = dict(zip(GRADS, (y.detach(), *grads), strict=True))
        return outputs, (cache.misses - before[0], cache.hits - before[1])

    advance_weight_generation()
    first, counts = step()
    assert counts == (4, 2)  # W1, W2: both forms in the forward; W1^T, W2^T served in the backward
    again, counts = step()
    assert counts == (0, 4)
    for name in GRADS:
        assert torch.equal(again[name], first[name]), name
    with torch.no_grad():
        w1.mul_(-0.5)
        w2.add_(0.25)
    advance_weight_generation()
    ours, counts = step()
    assert counts == (4, 2)
    _assert_matches(ours, _run("reference", x, idx, tw, w1.detach(), w2.detach(), dy))


def test_triton_fp8_width_not_a_multiple_of_16_names_the_setting() -> None:
    x, idx, tw, w1, w2, _ = _case(4, 24, 16, 2, 1, drop=0.0)
    with pytest.raises(UnsupportedSettingError, match=r"^hidden size H=24: .*Use a multiple of 16"):
        fused_mega_moe(x, idx, tw, w1, w2, backend="triton", precision="fp8")


def test_fp8_backend_selection() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend_name("auto", device=cpu, dtype=torch.bfloat16, precision="fp8") == "reference"
    want = "reference" if torch.version.hip is not None else "triton"
    assert resolve_backend_name("auto", device=cuda, dtype=torch.bfloat16, precision="fp8") == want
    ours = get_backend("triton", device=cpu, dtype=torch.float32, precision="fp8")
    assert isinstance(ours, QuantizedTritonBackend) and ours.name == "triton_fp8"
    assert isinstance(
        get_backend("auto", device=cpu, dtype=torch.float32, precision="fp8"), FP8ReferenceBackend
    )
    # EP > 1 on CUDA: FP8 moves its rows over NCCL unless a transport is set; symm when asked for
    from megamoe.backends import transport_name
    from megamoe.backends.triton_fp8.ep_symm import FP8SymmBackend

    default = EPSettings.from_env({})
    assert transport_name("triton", device=cuda, ep_size=2, settings=default, precision="fp8") == "nccl"
    symm = EPSettings.from_env({"MEGAMOE_EP_TRANSPORT": "symm"})
    assert transport_name("triton", device=cuda, ep_size=2, settings=symm, precision="fp8") == "symm"
    over_symm = get_backend(
        "triton", device=cpu, dtype=torch.float32, precision="fp8", ep_size=2, settings=symm
    )
    assert isinstance(over_symm, FP8SymmBackend) and over_symm.name == "triton_fp8_symm"


def _ep_rank(rank: int, world: int, case: tuple) -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed as dist

    from tests.megamoe.triton.interpreter_compat import install

    install()
    x, idx, tw, w1, w2, dy = (t[rank] for t in case)
    G = w1.shape[0] // world
    local = [w[rank * G : (rank + 1) * G] for w in (w1, w2)]
    return {
        backend: _run(backend, x, idx, tw, *local, dy, group=dist.group.WORLD)
        for backend in ("triton", "reference")
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors need TRITON_INTERPRET=1")
def test_triton_fp8_ep2_over_gloo_matches_emulation_at_ep2(tmp_path) -> None:
    """EP = 2 through the NCCL/gloo TokenExchange (bf16 rows exchanged, quantised after), ragged T."""
    from tests._dist import run_ranks

    per_rank = [_case(T, 32, 16, 4, 2, drop=0.1, seed=s, device="cpu") for s, T in ((1, 11), (2, 6))]
    w1, w2 = per_rank[0][3], per_rank[0][4]
    case = tuple([c[i] if i not in (3, 4) else (w1, w2)[i - 3] for c in per_rank] for i in range(6))
    for rank, got in enumerate(run_ranks(_ep_rank, 2, tmp_path, case)):
        _assert_matches(got["triton"], got["reference"], where=f"rank {rank} ")


def _ep_wire_rank(rank: int, world: int, case: tuple) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """The dtype and row shape of every all-to-all payload of one FP8 forward at EP = 2."""
    import torch.distributed as dist

    from megamoe.backends.exchange import TokenExchange
    from tests.megamoe.triton.interpreter_compat import install

    install()
    x, idx, tw, w1, w2, _ = (t[rank] for t in case)
    G = w1.shape[0] // world
    sent = []
    dispatch = TokenExchange.dispatch

    def recording(self, rows):
        sent.append((rows.dtype, tuple(rows.shape[1:])))
        return dispatch(self, rows)

    TokenExchange.dispatch = recording
    fused_mega_moe(x, idx, tw, w1[rank * G : (rank + 1) * G], w2[rank * G : (rank + 1) * G],
                   group=dist.group.WORLD, backend="triton", precision="fp8")  # fmt: skip
    return sent


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors need TRITON_INTERPRET=1")
def test_triton_fp8_ep2_moves_e4m3_rows_and_their_scales(tmp_path) -> None:
    """At EP > 1 the forward's tokens travel quantised (1 byte an element plus one fp32 scale per 128),
    not in the activations' dtype."""
    from tests._dist import run_ranks

    T, H = 9, 272  # three 128-wide tiles along H, the last one short
    per_rank = [_case(T, H, 32, 4, 2, drop=0.0, seed=s, device="cpu") for s in (1, 2)]
    case = tuple([c[i] for c in per_rank] for i in range(6))
    for sent in run_ranks(_ep_wire_rank, 2, tmp_path, case):
        assert (torch.uint8, (H,)) in sent, sent
        assert (torch.float32, (3,)) in sent, sent
        assert not any(shape == (H,) and dtype != torch.uint8 for dtype, shape in sent), sent
