"""Tile settings are checked when they are made: a tile the kernels cannot compute fails at once, with
the field and the rule it broke."""

from __future__ import annotations

import pytest

from megamoe.backends.triton.configs import TileConfig
from megamoe.errors import InvalidConfigError


def _tile(**fields: int) -> TileConfig:
    return TileConfig(
        **{"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3, **fields}
    )


@pytest.mark.parametrize("block_n", [16, 128, 96, 192])
def test_block_n_is_a_power_of_two_or_a_wide_and_a_narrow_piece(block_n: int) -> None:
    assert _tile(block_n=block_n).block_n == block_n


@pytest.mark.parametrize(
    ("field", "value"), [("block_n", 80), ("block_n", 320), ("block_m", 192), ("block_k", 96)]
)
def test_other_widths_are_refused_with_the_field_named(field: str, value: int) -> None:
    with pytest.raises(InvalidConfigError, match=f"TileConfig.{field}"):
        _tile(**{field: value})


def test_a_count_must_be_positive() -> None:
    with pytest.raises(InvalidConfigError, match="positive integer"):
        _tile(num_stages=0)
