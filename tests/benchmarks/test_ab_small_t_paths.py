"""The small-T paths A/B on CPU: its arguments, its table, and that each setting holds only for its
call (its timings need a GPU)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from benchmarks import ab_small_t_paths as ab
from megamoe.backends.triton import routing, side_gather


def test_each_setting_holds_during_its_call_and_the_defaults_come_back() -> None:
    defaults = (side_gather.SIDE_STREAM_MIN_BYTES, routing.ONE_PROGRAM_CELLS)
    seen = {}
    for setting in ab.SETTINGS:
        step = ab._under(setting, lambda: (side_gather.SIDE_STREAM_MIN_BYTES, routing.ONE_PROGRAM_CELLS))
        seen[setting] = step()
        assert defaults == (side_gather.SIDE_STREAM_MIN_BYTES, routing.ONE_PROGRAM_CELLS)
    assert seen == {
        "side stream from 16 MiB": (16 << 20, defaults[1]),
        "gathers in order": (ab.NEVER, defaults[1]),
        "side stream from 16 MiB, plan in one program": (16 << 20, ab.NEVER),
        "gathers in order, plan in one program": (ab.NEVER, ab.NEVER),
    }


def test_a_failing_call_restores_the_defaults() -> None:
    defaults = (side_gather.SIDE_STREAM_MIN_BYTES, routing.ONE_PROGRAM_CELLS)

    def fails():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        ab._under("gathers in order, plan in one program", fails)()
    assert defaults == (side_gather.SIDE_STREAM_MIN_BYTES, routing.ONE_PROGRAM_CELLS)


def test_table_row_per_case_and_setting() -> None:
    rows = [ab.Row("H1024-E8-K2:4096", "gathers in order", 2.0451, 0.272, 1.9009, 18)]
    lines = ab.format_table(rows).splitlines()
    assert lines[0] == "| case | setting | eager ms | graph ms | host ms | launches |"
    assert lines[2] == "| H1024-E8-K2:4096 | gathers in order | 2.045 | 0.272 | 1.901 | 18 |"


def test_dry_run_lists_the_cases_and_bad_cases_are_named() -> None:
    runner = CliRunner()
    res = runner.invoke(ab.main, ["--dry-run", "--cases", "H4096-E64-K8:256"])
    assert res.exit_code == 0
    assert res.output == (
        "H4096-E64-K8:256: side stream from 16 MiB, gathers in order, side stream from 16 MiB, plan in one "
        "program, gathers in order, plan in one program, torch\n"
    )
    res = runner.invoke(ab.main, ["--dry-run", "--cases", "H9-E1-K1:256"])
    assert res.exit_code == 2 and "'H9-E1-K1:256': want SHAPE:T with SHAPE one of H1024-E8-K2" in res.output
    res = runner.invoke(ab.main, ["--dry-run", "--cases", "H1024-E8-K2"])
    assert res.exit_code == 2 and "want SHAPE:T" in res.output
