"""WeightCache: served only while (generation, version, storage) is unchanged; rewritten in place."""

from __future__ import annotations

import gc

import pytest
import torch

from megamoe.quant import WeightCache, advance_weight_generation, fake_quantize_mx, weight_generation
from megamoe.quant import cache as cache_module
from megamoe.quant.mx import quantize_mx


@pytest.fixture
def weight():
    return torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def armed():
    """The trainer has called advance_weight_generation() at least once."""
    advance_weight_generation()


@pytest.mark.parametrize("transposed", [False, True], ids=["rowwise", "transposed"])
def test_weight_cache_forms_equal_direct_quantisation(weight, transposed):
    mx = WeightCache().get(weight, transposed=transposed)
    source = weight.transpose(1, 2) if transposed else weight
    assert mx.data.is_contiguous() and mx.shape == source.shape
    torch.testing.assert_close(mx.dequantize(), fake_quantize_mx(source), rtol=0, atol=0)


def test_weight_cache_never_serves_before_first_generation_advance(weight, monkeypatch):
    monkeypatch.setattr(cache_module, "_generation", 0)
    cache = WeightCache()
    for _ in range(3):
        cache.get(weight, transposed=False)
    assert (cache.hits, cache.misses) == (0, 3)


def test_weight_cache_serves_unchanged_weight(weight, armed):
    cache = WeightCache()
    first = cache.get(weight, transposed=False)
    assert cache.get(weight, transposed=False) is first
    assert (cache.hits, cache.misses) == (1, 1)


@pytest.mark.parametrize("transposed", [False, True], ids=["rowwise", "transposed"])
def test_weight_cache_refreshes_after_versioned_update(weight, armed, transposed):
    cache = WeightCache()
    cache.get(weight, transposed=transposed)
    with torch.no_grad():
        weight.mul_(-2)  # bumps weight._version, as torch.optim does
    got = cache.get(weight, transposed=transposed).dequantize()
    source = weight.transpose(1, 2) if transposed else weight
    torch.testing.assert_close(got, fake_quantize_mx(source), rtol=0, atol=0)


@pytest.mark.parametrize("transposed", [False, True], ids=["rowwise", "transposed"])
def test_weight_cache_refreshes_after_data_update_and_generation_advance(weight, armed, transposed):
    cache = WeightCache()
    cache.get(weight, transposed=transposed)
    version = weight._version
    weight.data.mul_(-2)  # megatron's distributed optimizer writes like this: no version bump
    assert weight._version == version
    advance_weight_generation()
    got = cache.get(weight, transposed=transposed).dequantize()
    source = weight.transpose(1, 2) if transposed else weight
    torch.testing.assert_close(got, fake_quantize_mx(source), rtol=0, atol=0)


def test_weight_cache_without_generation_advance_misses_data_updates(weight, armed):
    """Why the trainer must call advance_weight_generation(): `.data` writes are invisible otherwise."""
    cache = WeightCache()
    before = cache.get(weight, transposed=False).dequantize()
    weight.data.mul_(-2)
    torch.testing.assert_close(cache.get(weight, transposed=False).dequantize(), before, rtol=0, atol=0)


def test_weight_cache_rewrites_buffers_in_place(weight, armed):
    cache = WeightCache()
    mx = cache.get(weight, transposed=True)
    ptrs, before = cache.buffers(), mx.dequantize()
    weight.data.add_(1)
    advance_weight_generation()
    assert cache.get(weight, transposed=True) is mx and cache.buffers() == ptrs
    assert not torch.equal(mx.dequantize(), before)


def test_weight_cache_entry_dies_with_its_weight(armed):
    cache = WeightCache()
    w = torch.randn(2, 8, 64)
    cache.get(w, transposed=False)
    cache.get(w, transposed=True)
    assert len(cache) == 2
    del w
    gc.collect()
    assert len(cache) == 0 and cache.nbytes == 0


def test_weight_cache_keeps_separate_entries_for_tensors_sharing_storage(weight, armed):
    cache = WeightCache()
    view = weight.detach()
    cache.get(weight, transposed=False)
    cache.get(view, transposed=False)
    assert len(cache) == 2


def test_weight_cache_reallocates_when_the_shape_changes(weight, armed):
    cache = WeightCache()
    cache.get(weight, transposed=False)
    weight.data = torch.randn(3, 8, 64)
    advance_weight_generation()
    torch.testing.assert_close(
        cache.get(weight, transposed=False).dequantize(), fake_quantize_mx(weight), rtol=0, atol=0
    )
    assert len(cache) == 1


def test_weight_cache_requantises_during_graph_capture(weight, armed, monkeypatch):
    monkeypatch.setattr(cache_module, "_capturing", lambda device: True)
    cache = WeightCache()
    cache.get(weight, transposed=False)
    cache.get(weight, transposed=False)
    assert (cache.hits, cache.misses) == (0, 2)


def test_weight_cache_inference_tensors_are_requantised(armed):
    with torch.inference_mode():
        w = torch.randn(2, 8, 64)
    cache = WeightCache()
    cache.get(w, transposed=False)
    cache.get(w, transposed=False)
    assert (cache.hits, cache.misses) == (0, 2)


def test_weight_cache_rejects_non_expert_shapes():
    with pytest.raises(ValueError, match=r"expected an expert weight \[G, Y, X\], got shape \(8, 64\)"):
        WeightCache().get(torch.zeros(8, 64), transposed=False)


def test_advance_weight_generation_counts_up():
    start = weight_generation()
    assert advance_weight_generation() == start + 1 == weight_generation()


class _Pairs:
    """A ``quantize_both`` that records its calls (the MX forms, one after the other)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, w, out, out_t) -> None:
        self.calls += 1
        quantize_mx(w, dim=-1, out=out)
        quantize_mx(w.transpose(1, 2), dim=-1, out=out_t)


@pytest.mark.parametrize("first", [False, True], ids=["forward-first", "transposed-first"])
def test_weight_cache_quantises_both_forms_together_when_it_can_keep_them(weight, armed, first):
    pairs = _Pairs()
    cache = WeightCache(quantize_both=pairs)
    a = cache.get(weight, transposed=first)
    b = cache.get(weight, transposed=not first)
    assert (pairs.calls, cache.misses, cache.hits) == (1, 2, 1)
    for form, transposed in ((a, first), (b, not first)):
        source = weight.transpose(1, 2) if transposed else weight
        torch.testing.assert_close(form.dequantize(), fake_quantize_mx(source), rtol=0, atol=0)
    weight.data.mul_(-2)
    advance_weight_generation()
    cache.get(weight, transposed=True)
    torch.testing.assert_close(
        cache.get(weight, transposed=False).dequantize(), fake_quantize_mx(weight), rtol=0, atol=0
    )
    assert (pairs.calls, cache.misses, cache.hits) == (2, 4, 2)


def test_weight_cache_quantises_one_form_when_it_cannot_keep_it(weight, monkeypatch):
    """Before the first generation advance (and during capture) nothing is kept: a twin would be waste."""
    monkeypatch.setattr(cache_module, "_generation", 0)
    pairs = _Pairs()
    cache = WeightCache(quantize_both=pairs)
    cache.get(weight, transposed=False)
    cache.get(weight, transposed=True)
    assert (pairs.calls, cache.misses, cache.hits) == (0, 2, 0)
