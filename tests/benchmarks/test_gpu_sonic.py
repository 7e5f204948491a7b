"""The layer bench's SonicMoE comparison on a CUDA GPU at a tiny shape (device machine, with SonicMoE's
wheels installed as benchmarks/run_sonic_compare.sh does): every implementation timed in both phases
and within 35 dB of the float32 reference on y and every gradient, the bound the Triton backend's GPU
tests hold (tests/megamoe/triton/test_gpu_backend.py). The first call autotunes SonicMoE's six GEMMs
for the shape: minutes on a fresh machine, unless QUACK_CACHE_AUTOTUNING=1 finds its choices on disk."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import bench, layer_accuracy, sonic
from benchmarks.common import ModelShape

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TINY = ModelShape(hidden=512, inter=256, experts=8, topk=4, tokens=1024)


def test_sonic_is_timed_beside_ours_and_the_torch_pipeline_and_matches_the_reference() -> None:
    reason = sonic.import_error()
    if reason:
        pytest.skip(f"sonicmoe not importable: {reason}")
    results, accuracy = bench.run("layer", {"tiny": TINY}, ["skewed"], False, baselines=("torch", "sonic"))
    assert sorted((r.phase, r.impl) for r in results) == [
        (phase, impl) for phase in ("fwd", "fwd+bwd") for impl in ("baseline", "megamoe", "sonic")
    ]
    assert all(math.isfinite(r.ms) and r.ms > 0 and r.peak_gib >= 0 for r in results)
    assert [a.impl for a in accuracy] == ["megamoe", "baseline", "sonic"]
    for a in accuracy:
        print(a.impl, a.snr_db)
        assert set(a.snr_db) == set(layer_accuracy.OUTPUTS)
        assert min(a.snr_db.values()) >= 35.0, (a.impl, a.snr_db)
    print(bench.format_table(results))
