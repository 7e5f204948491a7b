"""Host facts helpers: Slurm node lists expand like `scontrol show hostnames`."""

from __future__ import annotations

import pytest

from runner.host import expand_nodelist


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu[01-02,07],login", ["gpu01", "gpu02", "gpu07", "login"]),
        ("a[1-2]-ib", ["a1-ib", "a2-ib"]),
    ],
)
def test_expand_nodelist_matches_scontrol_order(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts
