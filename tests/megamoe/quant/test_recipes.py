"""The recipes' weight forms: MXFP8 caches W and W^T, FP8 one 128×128 form that serves both."""

from __future__ import annotations

import pytest
import torch

from megamoe.quant import FP8Tensor, advance_weight_generation, fake_quantize_fp8_blocks, fake_quantize_mx
from megamoe.quant.recipes import FP8, MXFP8, RECIPES


@pytest.fixture
def weight():
    return torch.randn(2, 136, 200, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("transposed", [False, True], ids=["forward W", "dgrad W^T"])
def test_fp8_weight_forms_are_the_blocks_of_w_and_of_w_transposed(weight, transposed):
    cache = FP8.weight_cache()
    source = weight.transpose(1, 2) if transposed else weight
    got = FP8.weight(cache, weight, transposed=transposed, dtype=torch.float32)
    torch.testing.assert_close(got, fake_quantize_fp8_blocks(source), rtol=0, atol=0)


def test_fp8_one_cached_form_serves_forward_and_dgrad(weight):
    advance_weight_generation()
    cache = FP8.weight_cache()
    FP8.weight(cache, weight, transposed=False, dtype=torch.float32)
    FP8.weight(cache, weight, transposed=True, dtype=torch.float32)
    assert (len(cache), cache.misses, cache.hits) == (1, 1, 1)
    form = cache.get(weight, transposed=False)
    assert isinstance(form, FP8Tensor) and form.tile == (1, 128, 128) and form.scale.shape == (2, 2, 2)


def test_mxfp8_caches_one_form_per_direction(weight):
    advance_weight_generation()
    cache = MXFP8.weight_cache()
    for transposed in (False, True):
        source = weight.transpose(1, 2) if transposed else weight
        got = MXFP8.weight(cache, weight, transposed=transposed, dtype=torch.float32)
        torch.testing.assert_close(got, fake_quantize_mx(source), rtol=0, atol=0)
    assert (len(cache), cache.misses) == (2, 2)


def test_fp8_weight_cache_rewrites_its_buffers_in_place(weight):
    advance_weight_generation()
    cache = FP8.weight_cache()
    form = cache.get(weight, transposed=False)
    ptrs, before = cache.buffers(), form.dequantize()
    weight.data.mul_(3)
    advance_weight_generation()
    assert cache.get(weight, transposed=False) is form and cache.buffers() == ptrs
    torch.testing.assert_close(form.dequantize(), fake_quantize_fp8_blocks(weight), rtol=0, atol=0)
    assert not torch.equal(form.dequantize(), before)


@pytest.mark.parametrize("precision", RECIPES)
def test_recipe_operands_are_tiled_along_the_given_dim(precision):
    values = torch.randn(130, 150, generator=torch.Generator().manual_seed(1))
    recipe = RECIPES[precision]
    torch.testing.assert_close(
        recipe.operand(values, 0, torch.float64),
        recipe.operand(values.t(), 1, torch.float64).t(),
        rtol=0,
        atol=0,
    )
    assert recipe.operand(values, 1, torch.bfloat16).dtype == torch.bfloat16
