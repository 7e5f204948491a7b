"""The weight cache inside training loops: never a stale weight after an optimizer step, flat memory.

Every step runs the cached op (``mxfp8`` and ``fp8``) twice (the second run is an activation recompute,
served from the cache) and compares both, bit for bit, with a backend that has an empty cache and so
quantises the current weights: forward (``y``), dgrad (``dx``, ``d_topk_weights``) and wgrad (``dw1``,
``dw2``). MXFP8 caches two forms per weight (``W`` and ``W^T``), FP8 one (its 128×128 blocks serve both).
"""

from __future__ import annotations

import contextlib
import gc
import types
import weakref

import pytest
import torch

import megamoe.backends
from megamoe import advance_weight_generation, fused_mega_moe
from megamoe.backends.quantized_reference import QuantizedReferenceBackend
from megamoe.quant import fake_quantize_fp8_blocks, fake_quantize_mx
from megamoe.quant.recipes import FP8, MXFP8
from tests.megamoe.reference_math import make_case

NAMES = ("y", "dx", "d_topk_weights", "dw1", "dw2")
# (recipe, weight forms cached per weight, the direct quantisation of a cached form's source)
PRECISIONS = {
    "mxfp8": (MXFP8, 2, fake_quantize_mx),
    "fp8": (FP8, 1, fake_quantize_fp8_blocks),
}


@contextlib.contextmanager
def _using(backend):
    key = ("reference", backend.recipe.precision, "local", None)  # megamoe.backends._CACHE's key
    previous = megamoe.backends._CACHE.get(key)
    megamoe.backends._CACHE[key] = backend
    try:
        yield backend
    finally:
        if previous is None:
            megamoe.backends._CACHE.pop(key, None)
        else:
            megamoe.backends._CACHE[key] = previous


@pytest.fixture(params=PRECISIONS.keys())
def cached(request):
    """A backend with a cache of one precision; the trainer has started stepping."""
    advance_weight_generation()
    with _using(QuantizedReferenceBackend(PRECISIONS[request.param][0])) as backend:
        yield backend


def _forms(backend) -> int:
    """Weight forms the backend caches per weight."""
    return PRECISIONS[backend.recipe.precision][1]


class _Model:
    """Expert weights as parameters plus one fixed batch (H = 160: two FP8 tiles, the second short)."""

    def __init__(self, seed: int, precision: str) -> None:
        self.precision = precision
        c = make_case(tokens=[24], hidden=160, inter=32, experts=2, topk=2, seed=seed)
        self.w1 = torch.nn.Parameter(c["w1"].float())
        self.w2 = torch.nn.Parameter(c["w2"].float())
        self.x, self.idx, self.tw = c["x"][0].float(), c["topk_idx"][0], c["topk_weights"][0].float()
        self.dy = torch.randn(self.x.shape, generator=torch.Generator().manual_seed(seed + 1))

    def run(self) -> dict[str, torch.Tensor]:
        """Forward and backward; returns outputs and gradients without touching ``.grad``."""
        x, tw = self.x.clone().requires_grad_(), self.tw.clone().requires_grad_()
        y = fused_mega_moe(x, self.idx, tw, self.w1, self.w2, precision=self.precision)
        grads = torch.autograd.grad(y, (x, tw, self.w1, self.w2), self.dy)
        return dict(zip(NAMES, (y.detach(), *grads), strict=True))

    def fresh(self) -> dict[str, torch.Tensor]:
        with _using(QuantizedReferenceBackend(PRECISIONS[self.precision][0])):
            return self.run()


def _sgd(model, grads, lr=0.01):
    opt = torch.optim.SGD([model.w1, model.w2], lr=lr)
    model.w1.grad, model.w2.grad = grads["dw1"], grads["dw2"]
    opt.step()  # bumps w._version


def _through_data(model, grads, lr=0.01):
    model.w1.data.add_(grads["dw1"], alpha=-lr)  # megatron's distributed optimizer: no version bump
    model.w2.data.add_(grads["dw2"], alpha=-lr)


def _assert_same(got, expected, what):
    for name in NAMES:
        assert torch.equal(got[name], expected[name]), f"{what}: {name} differs from a fresh quantisation"


@pytest.mark.parametrize("update", [_sgd, _through_data], ids=["torch.optim.SGD", "through .data"])
def test_no_stale_quantised_weight_after_optimizer_steps(cached, update):
    model = _Model(seed=1, precision=cached.recipe.precision)
    for step in range(5):
        first, recompute = model.run(), model.run()
        expected = model.fresh()
        _assert_same(first, expected, f"step {step}")
        _assert_same(recompute, expected, f"step {step} recompute")
        update(model, first)
        advance_weight_generation()
    # per step: each form of w1 and w2 quantised once, then served; 2 runs x 4 GEMMs with a weight
    forms = 2 * _forms(cached)
    assert (cached.weight_cache.misses, cached.weight_cache.hits) == (forms * 5, (8 - forms) * 5)


def test_eval_forward_between_steps_is_served_from_the_cache(cached):
    model = _Model(seed=2, precision=cached.recipe.precision)
    model.run()
    misses = cached.weight_cache.misses
    with torch.no_grad():
        fused_mega_moe(model.x, model.idx, model.tw, model.w1, model.w2, precision=model.precision)
    assert cached.weight_cache.misses == misses


def test_data_update_without_generation_advance_serves_stale_weights(cached):
    """The failure advance_weight_generation() exists to prevent (the original's dgrad bug, on purpose)."""
    model = _Model(seed=3, precision=cached.recipe.precision)
    _through_data(model, model.run())
    stale, fresh = model.run(), model.fresh()
    assert not torch.equal(stale["y"], fresh["y"]) and not torch.equal(stale["dx"], fresh["dx"])


def _tensors_held_by(cache) -> list[torch.Tensor]:
    """Every tensor reachable from ``cache``'s own state (its entries' MX buffers and anything else it
    keeps), not through callables, classes, modules or weak references: the cache's memory, whatever
    other tests left alive in the process."""
    found: dict[int, torch.Tensor] = {}
    seen, stack = set(), [cache]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[id(obj)] = obj
        elif not (callable(obj) or isinstance(obj, (type, types.ModuleType, weakref.ref))):
            stack.extend(gc.get_referents(obj))
    return list(found.values())


def _memory(tensors) -> tuple[list[tuple[int, int, int]], int]:
    """``(data_ptr, storage data_ptr, storage bytes)`` of each tensor, sorted, and the bytes of their storages."""
    layout = sorted(
        (t.data_ptr(), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors
    )
    return layout, sum({storage: nbytes for _, storage, nbytes in layout}.values())


def test_cache_memory_flat_and_rewritten_in_place_over_200_steps(cached):
    """200 optimizer steps re-quantise every form each step into the buffers allocated at step 0: the
    tensors the cache holds stay the same objects, storages and bytes (only the cache is measured, so
    tensors other tests leave alive or free in this process don't count), and end up holding the last
    weights' quantisation."""
    model = _Model(seed=4, precision=cached.recipe.precision)
    cache, forms = cached.weight_cache, 2 * _forms(cached)
    for step in range(200):
        grads = model.run()
        model.w1.data.add_(grads["dw1"].sign(), alpha=-1e-3)  # bounded steps: finite for 200 steps
        model.w2.data.add_(grads["dw2"].sign(), alpha=-1e-3)
        advance_weight_generation()
        held = _tensors_held_by(cache)
        if step == 0:
            # kept alive here, so a cache that re-allocated could not get the same addresses back
            first, (layout, nbytes) = held, _memory(held)
            entries, cache_nbytes, buffers = len(cache), cache.nbytes, cache.buffers()
            assert (entries, len(first)) == (forms, 2 * forms), "each form of w1 and w2: data and scale"
            misses = cache.misses
            continue
        assert {id(t) for t in held} == {id(t) for t in first}, f"step {step}: the cache's tensors changed"
        assert _memory(held) == (layout, nbytes), f"step {step}: the cache's storages moved or grew"
        assert (len(cache), cache.nbytes, cache.buffers()) == (entries, cache_nbytes, buffers), f"step {step}"
        assert cache.misses == misses + forms * step, f"step {step}: every form re-quantised once per step"
    model.run()  # the last refresh, into the same buffers
    assert _memory(_tensors_held_by(cache)) == (layout, nbytes)
    sources = {
        (id(w), t): (w.transpose(1, 2) if t else w) for w in (model.w1, model.w2) for t in (False, True)
    }
    direct = PRECISIONS[cached.recipe.precision][2]
    for key, entry in cache._entries.items():
        torch.testing.assert_close(entry.form.dequantize(), direct(sources[key]), rtol=0, atol=0)
