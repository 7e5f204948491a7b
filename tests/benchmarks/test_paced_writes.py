"""The paced writes of ``sweep_tiles.py --beside inbound``, in Triton's interpreter (unpaced there: the
pace is the GPU's global timer, which the interpreter has not), and the sweep's argument errors.
The pace itself is seen on the GPU, where the sweep times the writes alone beside the legs."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import paced_writes, sweep_tiles
from benchmarks.paced_writes import PacedWrites


@pytest.mark.parametrize("nbytes", [1, 4 * paced_writes.CHUNK, 37 * 4 * paced_writes.CHUNK + 5])
def test_every_chunk_is_written_and_the_bytes_round_up_to_chunks(nbytes: int) -> None:
    writes = PacedWrites(nbytes, 1e-3, torch.device("cpu"))
    writes.buffer.zero_()
    writes.launch()
    chunks = -(-nbytes // (4 * paced_writes.CHUNK))
    assert writes.num_chunks == chunks and writes.nbytes == chunks * 4 * paced_writes.CHUNK
    assert torch.equal(writes.buffer, torch.ones_like(writes.buffer))
    assert writes.interval_ns == int(1e6 / chunks)


@pytest.mark.parametrize(("nbytes", "seconds"), [(0, 1e-3), (1024, 0.0)])
def test_nothing_to_write_or_no_time_is_refused(nbytes: int, seconds: float) -> None:
    with pytest.raises(ValueError, match="nbytes > 0 and seconds > 0"):
        PacedWrites(nbytes, seconds, torch.device("cpu"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--out", "x.json", "--beside", "gather,noise"], "unknown ops or --beside values \\['noise'\\]"),
        (["--out", "x.json", "--ops", "gemm3"], "unknown ops or --beside values \\['gemm3'\\]"),
        (["--beside", "inbound"], "--out FILE is needed"),
    ],
)
def test_the_sweep_names_a_bad_argument_before_touching_a_gpu(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["sweep_tiles.py", *argv])
    with pytest.raises(SystemExit, match=message):
        sweep_tiles.main()


def test_the_inbound_bytes_are_defined_for_every_m_grouped_op() -> None:
    assert set(sweep_tiles.INBOUND_AT_EP2) == set(sweep_tiles.OPS) - {"wgrad"}
