"""Launch settings read from the environment: the dispatch mode's default per EP size and its errors."""

from __future__ import annotations

import pytest

from megamoe.backends.symm.launch import dispatch_mode
from megamoe.errors import InvalidConfigError


@pytest.mark.parametrize(("world", "mode"), [(2, "broadcast"), (4, "push"), (8, "push")])
def test_unset_picks_the_mode_measured_fastest_at_that_ep_size(monkeypatch, world, mode) -> None:
    monkeypatch.delenv("MEGAMOE_SYMM_DISPATCH", raising=False)
    assert dispatch_mode(world) == mode


@pytest.mark.parametrize("mode", ["push", "pull", "broadcast"])
def test_a_set_mode_wins_at_every_ep_size(monkeypatch, mode) -> None:
    monkeypatch.setenv("MEGAMOE_SYMM_DISPATCH", mode)
    assert [dispatch_mode(w) for w in (2, 4, 8)] == [mode] * 3


def test_an_unknown_mode_names_the_choices(monkeypatch) -> None:
    monkeypatch.setenv("MEGAMOE_SYMM_DISPATCH", "scatter")
    with pytest.raises(InvalidConfigError, match="push, pull, broadcast"):
        dispatch_mode(2)
