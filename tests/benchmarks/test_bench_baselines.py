"""The layer bench's peers on a machine without a GPU: ``--baseline`` parsing and its errors, the skip
line when SonicMoE does not import, the tables with several baselines, and the SonicMoE adapter's
argument layout against a stand-in that computes SonicMoE's documented contract in PyTorch."""

from __future__ import annotations

import sys
import types
from enum import Enum

import pytest
import torch
from click.testing import CliRunner

from benchmarks import bench, layer_accuracy, sonic
from benchmarks.bench import Result, format_table, main
from benchmarks.common import ModelShape

TINY = ModelShape(hidden=32, inter=16, experts=4, topk=2, tokens=24)
SKIP_LINE = "sonic: skipped (sonicmoe not importable: "


@pytest.fixture
def sonic_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sonic, "import_error", lambda: None)


@pytest.fixture
def sonic_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sonicmoe", None)


@pytest.mark.parametrize(
    ("value", "parsed"),
    [("torch", ["torch"]), ("torch,sonic", ["torch", "sonic"]), (" sonic , torch,sonic", ["sonic", "torch"])],
)
def test_baseline_list_keeps_order_and_drops_repeats(value, parsed, sonic_importable) -> None:
    result = CliRunner().invoke(main, ["--models", "Qwen3-30B-A3B", "--baseline", value, "--dry-run"])
    assert result.exit_code == 0, result.output
    assert result.output.rstrip().endswith(f"baselines={parsed}")


def test_default_baseline_is_the_torch_pipeline_and_prints_no_skip_line(sonic_missing) -> None:
    result = CliRunner().invoke(main, ["--models", "DeepSeek-V3", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "baselines=['torch']" in result.output and "skipped" not in result.output


@pytest.mark.parametrize("value", ["megatron", "torch,cutlass", ","])
def test_unknown_baseline_is_a_usage_error(value: str) -> None:
    result = CliRunner().invoke(main, ["--baseline", value, "--dry-run"])
    assert result.exit_code == 2, result.output
    assert "unknown baseline(s)" in result.output and "use a comma list of torch, sonic" in result.output


@pytest.mark.parametrize(
    "extra", [["--mode", "grouped_gemm_combine"], ["--precision", "mxfp8"], ["--num-processes", "2"]]
)
def test_sonic_outside_the_one_gpu_bf16_layer_is_a_usage_error(extra: list[str], sonic_importable) -> None:
    result = CliRunner().invoke(main, ["--baseline", "torch,sonic", *extra, "--dry-run"])
    assert result.exit_code == 2 and "--mode layer at --precision bf16 on one GPU only" in result.output


def test_unimportable_sonic_prints_one_skip_line_and_runs_the_rest(sonic_missing) -> None:
    result = CliRunner().invoke(
        main, ["--models", "DeepSeek-V3,Qwen3-30B-A3B", "--baseline", "torch,sonic", "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line for line in lines if "skipped" in line] == [
        SKIP_LINE + "ModuleNotFoundError: import of sonicmoe halted; None in sys.modules)"
    ]
    assert lines[0].startswith(SKIP_LINE)
    assert [line.split()[1] for line in lines[1:]] == ["DeepSeek-V3", "Qwen3-30B-A3B"]
    assert all(line.endswith("baselines=['torch']") for line in lines[1:])


def _result(impl: str, ms: float, gib: float, routing: str = "uniform") -> Result:
    return Result("DeepSeek-V3", routing, "layer", "fwd+bwd", impl, ms, 1000 / ms, gib)


def test_table_of_the_default_baseline() -> None:
    lines = format_table([_result("megamoe", 10.0, 1.5), _result("baseline", 13.0, 3.25)]).splitlines()
    assert lines[0] == (
        "| model | routing | mode | phase | ours ms | ours TFLOP/s | base ms | base TFLOP/s | base speed-up "
        "| ours GiB | base GiB |"
    )
    assert lines[1] == "|" + "---|" * 11
    assert (
        lines[2]
        == "| DeepSeek-V3 | uniform | layer | fwd+bwd | 10.000 | 100 | 13.000 | 77 | 1.300x | 1.50 | 3.25 |"
    )


def test_table_with_several_baselines_gives_each_its_columns_and_dashes_a_missing_one() -> None:
    results = [
        _result("megamoe", 10.0, 1.5),
        _result("baseline", 13.0, 3.25),
        _result("sonic", 8.0, 2.0),
        _result("megamoe", 20.0, 1.5, routing="skewed"),
        _result("baseline", 30.0, 3.5, routing="skewed"),
    ]
    lines = format_table(results).splitlines()
    assert lines[0] == (
        "| model | routing | mode | phase | ours ms | ours TFLOP/s | base ms | base TFLOP/s | base speed-up "
        "| sonic ms | sonic TFLOP/s | sonic speed-up | ours GiB | base GiB | sonic GiB |"
    )
    assert lines[2] == (
        "| DeepSeek-V3 | uniform | layer | fwd+bwd | 10.000 | 100 | 13.000 | 77 | 1.300x "
        "| 8.000 | 125 | 0.800x | 1.50 | 3.25 | 2.00 |"
    )
    assert lines[3] == (
        "| DeepSeek-V3 | skewed | layer | fwd+bwd | 20.000 | 50 | 30.000 | 33 | 1.500x | — | — | — | 1.50 | 3.50 | — |"
    )


def test_accuracy_table_names_impls_by_their_labels() -> None:
    snr = dict.fromkeys(layer_accuracy.OUTPUTS, 41.234)
    rows = [layer_accuracy.Accuracy("Qwen3-30B-A3B", "skewed", impl, snr) for impl in ("megamoe", "sonic")]
    rows.append(layer_accuracy.Accuracy("Qwen3-30B-A3B", "skewed", "megamoe", snr, against="fp8"))
    lines = layer_accuracy.format_table(rows, bench.LABELS).splitlines()
    assert lines[0] == "| model | routing | impl | against | y | dx | d(topk_weights) | dW1 | dW2 |"
    assert lines[2] == "| Qwen3-30B-A3B | skewed | ours | float32 | 41.2 | 41.2 | 41.2 | 41.2 | 41.2 |"
    assert lines[3].startswith("| Qwen3-30B-A3B | skewed | sonic | float32 | 41.2")
    assert lines[4].startswith("| Qwen3-30B-A3B | skewed | ours | fp8 emulation | 41.2")


def _stand_in_general_routing(
    x, scores_R, token_R, expert_R, w1_2IHE, b1, w2_HIE, b2, E, stream, activation, inference, concat_layout
):
    """SonicMoE's ``moe_general_routing_inputs`` as its source documents it, in PyTorch: R (token,
    expert, score) triples sorted by token; ``w1 [2I, H, E]`` gate rows then up rows (concat layout),
    ``w2 [H, I, E]``, both expert-last (stride order 2, 0, 1)."""
    assert concat_layout and activation.value == "swiglu" and b1 is None and b2 is None and not inference
    assert w1_2IHE.stride(2) == w1_2IHE.shape[0] * w1_2IHE.shape[1] and w1_2IHE.stride(1) == 1
    assert w2_HIE.stride(2) == w2_HIE.shape[0] * w2_HIE.shape[1] and w2_HIE.stride(1) == 1
    assert token_R.dtype == expert_R.dtype == torch.int32 and bool((token_R[1:] >= token_R[:-1]).all())
    assert w1_2IHE.shape[2] == E and scores_R.shape == token_R.shape
    h_R2I = torch.einsum("rh,ihr->ri", x[token_R.long()].float(), w1_2IHE[:, :, expert_R.long()].float())
    gate, up = h_R2I.chunk(2, dim=-1)
    o_RH = torch.einsum(
        "ri,hir->rh", torch.nn.functional.silu(gate) * up, w2_HIE[:, :, expert_R.long()].float()
    )
    y = torch.zeros(x.shape, dtype=torch.float32).index_add(0, token_R.long(), o_RH * scores_R[:, None])
    return y.to(x.dtype), None


@pytest.fixture
def stand_in_sonicmoe(monkeypatch: pytest.MonkeyPatch) -> None:
    package, functional, enums = (
        types.ModuleType(n) for n in ("sonicmoe", "sonicmoe.functional", "sonicmoe.enums")
    )
    functional.moe_general_routing_inputs = _stand_in_general_routing
    enums.ActivationType = Enum("ActivationType", {"SWIGLU": "swiglu"})
    for module in (package, functional, enums):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    stream = types.SimpleNamespace(cuda_stream=0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)


def test_sonic_adapter_passes_our_layouts_as_sonicmoes_contract(stand_in_sonicmoe) -> None:
    """Our ``w1 [G, 2I, H]`` (gate rows first) and ``w2 [G, H, I]`` permuted to SonicMoE's expert-last
    layout, the routing flattened token-major: the same function as the reference backend's, so the
    bench's SNR column of SonicMoE measures its kernels, not a layout slip."""
    inputs = bench._inputs(TINY, "skewed", torch.device("cpu"))
    cases = [
        c
        for c in bench._cases("layer", inputs, baselines=("torch", "sonic"))
        if c[0] != "megamoe"  # ours runs in Triton's interpreter: test_bench.py covers it
    ]
    assert [impl for impl, _, _ in cases] == ["baseline", "sonic"]
    report = {impl: snr for impl, _, snr in layer_accuracy.measure(cases, inputs)}
    for impl, snr in report.items():
        assert set(snr) == set(layer_accuracy.OUTPUTS), impl
        assert min(snr.values()) > 35, (impl, snr)  # bf16 inputs and outputs against float32


def test_snr_column_exposes_swapped_gate_and_up_halves(stand_in_sonicmoe) -> None:
    """A layer that reads the up rows as the gate (the layout slip the column is there to catch)."""
    inputs = bench._inputs(TINY, "uniform", torch.device("cpu"))
    x, idx, tw, w1, w2 = inputs

    def swapped():
        return sonic.sonic_layer(x, idx, tw, torch.cat(w1.chunk(2, dim=1)[::-1], dim=1), w2)

    ((_, _, snr),) = layer_accuracy.measure([("sonic", swapped, [x, tw, w1, w2])], inputs)
    assert snr["y"] < 10
