"""Typed EP settings: defaults, the environment as the documented default, and errors that name the
variable; the fused ops' text form round-trips."""

from __future__ import annotations

import math

import pytest

from megamoe.errors import InvalidConfigError
from megamoe.settings import SYMM_ENV, EPSettings, SymmSettings


@pytest.mark.parametrize(("world", "mode"), [(2, "broadcast"), (4, "push"), (8, "push")])
def test_unset_dispatch_picks_the_mode_measured_fastest_at_that_ep_size(world, mode) -> None:
    assert SymmSettings().dispatch_mode(world) == mode
    assert SymmSettings.from_env({}).dispatch_mode(world) == mode


@pytest.mark.parametrize("mode", ["push", "pull", "broadcast"])
def test_a_set_dispatch_mode_wins_at_every_ep_size(mode) -> None:
    settings = SymmSettings.from_env({"MEGAMOE_SYMM_DISPATCH": mode})
    assert [settings.dispatch_mode(w) for w in (2, 4, 8)] == [mode] * 3


def test_an_unknown_dispatch_mode_names_the_choices_and_the_variable() -> None:
    with pytest.raises(InvalidConfigError, match=r"MEGAMOE_SYMM_DISPATCH.*push, pull, broadcast"):
        SymmSettings.from_env({"MEGAMOE_SYMM_DISPATCH": "scatter"})


@pytest.mark.parametrize(("raw", "expected"), [(None, 2.0), ("3", 3.0), ("1.5", 1.5), ("max", math.inf)])
def test_capacity_factor_from_the_environment(raw, expected) -> None:
    env = {} if raw is None else {"MEGAMOE_SYMM_CAPACITY": raw}
    assert SymmSettings.from_env(env).capacity_factor == expected


@pytest.mark.parametrize("raw", ["0", "-1", "lots", "nan"])
def test_a_bad_capacity_factor_names_the_variable(raw) -> None:
    with pytest.raises(InvalidConfigError, match="MEGAMOE_SYMM_CAPACITY"):
        SymmSettings.from_env({"MEGAMOE_SYMM_CAPACITY": raw})


def test_every_field_reads_its_variable() -> None:
    env = {
        "MEGAMOE_SYMM_DISPATCH": "pull", "MEGAMOE_SYMM_MAX_TOKENS": "64", "MEGAMOE_SYMM_CAPACITY": "max",
        "MEGAMOE_SYMM_COMM_PROGRAMS": "8", "MEGAMOE_SYMM_FLAT_WAIT": "0", "MEGAMOE_SYMM_TAIL": "40",
        "MEGAMOE_SYMM_WAIT_SPINS": "300", "MEGAMOE_SYMM_DEBUG": "1", "MEGAMOE_SYMM_TRACE": "1",
    }  # fmt: skip
    assert set(env) == set(SYMM_ENV.values())
    s = SymmSettings.from_env(env)
    assert s == SymmSettings(
        dispatch="pull", max_tokens=64, capacity_factor=math.inf, comm_programs=8, flat_wait=False,
        tail_percent=40, wait_spins=300, debug=True, trace=True,
    )  # fmt: skip
    assert s.max_spins() == 300
    assert SymmSettings.from_json(s.to_json()) == s


def test_debug_bounds_the_waits_unless_spins_are_given() -> None:
    assert SymmSettings(debug=True).max_spins() < SymmSettings().max_spins()
    assert SymmSettings(debug=True, wait_spins=7).max_spins() == 7


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"MEGAMOE_SYMM_MAX_TOKENS": "many"}, r"MEGAMOE_SYMM_MAX_TOKENS='many': must be a number"),
        ({"MEGAMOE_SYMM_MAX_TOKENS": "0"}, r"MEGAMOE_SYMM_MAX_TOKENS.*at least 1"),
        ({"MEGAMOE_SYMM_DEBUG": "yes"}, r"MEGAMOE_SYMM_DEBUG='yes': must be 0 or 1"),
        ({"MEGAMOE_SYMM_TAIL": "140"}, r"MEGAMOE_SYMM_TAIL.*\[0, 100\]"),
    ],
)
def test_bad_values_name_the_variable(env, match) -> None:
    with pytest.raises(InvalidConfigError, match=match):
        SymmSettings.from_env(env)


def test_ep_transport_defaults_per_device_and_rejects_unknown_values() -> None:
    assert EPSettings.from_env({}).transport_for("cuda") == "symm"
    assert EPSettings.from_env({}).transport_for("cpu") == "nccl"
    assert EPSettings.from_env({"MEGAMOE_EP_TRANSPORT": "nccl"}).transport_for("cuda") == "nccl"
    with pytest.raises(InvalidConfigError, match=r"MEGAMOE_EP_TRANSPORT='nvshmem'.*Use one of symm, nccl"):
        EPSettings.from_env({"MEGAMOE_EP_TRANSPORT": "nvshmem"})


def test_ep_settings_follow_the_environment_from_call_to_call(monkeypatch) -> None:
    """The layer reads the variables on every call given no settings; equal values reuse one parsed
    object, a change is seen at the next call, and a bad value raises every time (never cached)."""
    monkeypatch.delenv("MEGAMOE_EP_TRANSPORT", raising=False)
    monkeypatch.setenv("MEGAMOE_SYMM_DISPATCH", "pull")
    first = EPSettings.from_env()
    assert first.transport is None and first.symm.dispatch == "pull"
    assert EPSettings.from_env() is first
    monkeypatch.setenv("MEGAMOE_EP_TRANSPORT", "nccl")
    assert EPSettings.from_env() == EPSettings(transport="nccl", symm=SymmSettings(dispatch="pull"))
    monkeypatch.setenv("MEGAMOE_SYMM_DISPATCH", "scatter")
    for _ in range(2):
        with pytest.raises(InvalidConfigError, match="MEGAMOE_SYMM_DISPATCH"):
            EPSettings.from_env()
    assert EPSettings.from_env({"MEGAMOE_EP_TRANSPORT": "symm"}).transport == "symm"
