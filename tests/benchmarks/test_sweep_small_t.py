"""The small-T sweep's arguments, table and re-plot on CPU (its timings need a GPU)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from click.testing import CliRunner

from benchmarks import sweep_small_t as sweep


def _rows() -> list[sweep.Row]:
    rows = []
    for t in (256, 1024):
        rows.append(sweep.Row("H1024-E8-K2", t, "megamoe", 2.0, 0.1, 1.9, 27))
        rows.append(sweep.Row("H1024-E8-K2", t, "torch", 1.0, 0.2, 0.9, 57))
    return rows


def test_table_has_both_ratios_per_point() -> None:
    lines = sweep.format_table(_rows()).splitlines()
    assert lines[0].startswith("| shape | T | ours eager ms | torch eager ms | **eager speed-up** |")
    assert lines[2] == (
        "| H1024-E8-K2 | 256 | 2.000 | 1.000 | 0.50x | 0.100 | 0.200 | 2.00x | 1.900 | 0.900 | 27 | 57 |"
    )
    assert len(lines) == 4


def test_dry_run_lists_the_grid_and_bad_values_are_named() -> None:
    runner = CliRunner()
    res = runner.invoke(sweep.main, ["--dry-run", "--tokens", "256,512", "--shapes", "H4096-E64-K8"])
    assert res.exit_code == 0 and res.output == "H4096-E64-K8 (4096, 1536, 64, 8) T=[256, 512]\n"
    res = runner.invoke(sweep.main, ["--dry-run", "--shapes", "H9-E1-K1"])
    assert res.exit_code == 2 and "unknown shape(s) ['H9-E1-K1']; choose from H1024-E8-K2" in res.output
    res = runner.invoke(sweep.main, ["--dry-run", "--cprofile", "H1024-E8-K2"])
    assert res.exit_code == 2 and "want SHAPE:T, e.g. H1024-E8-K2:1024" in res.output
    assert runner.invoke(sweep.main, ["--help"]).exit_code == 0


def test_replot_draws_the_figure_from_results_json(tmp_path: Path) -> None:
    record = {"device": "NVIDIA H200", "torch": "2.11.0", "rows": [asdict(r) for r in _rows()]}
    (tmp_path / "results.json").write_text(json.dumps(record))
    res = CliRunner().invoke(sweep.main, ["--replot", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| H1024-E8-K2 | 1024 |" in (tmp_path / "table.md").read_text()
