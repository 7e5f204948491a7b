"""Job templates: the seed's three jobs render to runnable scripts with every value quoted."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from runner import templates
from runner.errors import ConfigError


@pytest.mark.parametrize("name", sorted(templates.TEMPLATES))
def test_template_renders_valid_bash(name: str) -> None:
    text = templates.render_job(name, {})
    assert subprocess.run(["bash", "-n"], input=text, text=True, check=False).returncode == 0
    assert "--use_turbo_mega_moe True" in text


def test_template_cudagraph_captures_the_full_step_with_the_seed_flags() -> None:
    text = templates.render_job("ep8-cudagraph", {})
    assert "--external_cuda_graph True" in text and "--cuda_graph_scope full" in text
    assert "--cuda_graph_warmup_steps 3" in text and "--train_iters 15" in text


def test_template_pp8_layout_is_quoted_as_one_word() -> None:
    text = templates.render_job("pp8-8node", {})
    layout = "Ett" + "|tttt" * 14 + "|tttL"  # 61 layers on 16 stages: PP=8 x 2 virtual stages
    assert f"--pipeline_model_parallel_layout '{layout}'" in text
    assert "-N 8" in text


def test_template_hostile_value_is_quoted() -> None:
    text = templates.render_job("ep8", {"config": "$(touch /tmp/pwned)", "extra": ["a b", "`id`"]})
    assert "--config '$(touch /tmp/pwned)'" in text
    assert "'a b' '`id`'" in text


def test_template_unknown_key_and_name_are_errors() -> None:
    with pytest.raises(ConfigError, match="unknown --set key 'nodez'"):
        templates.render_job("ep8", {"nodez": "2"})
    with pytest.raises(ConfigError, match="Known: ep8"):
        templates.render_job("nope", {})


@pytest.mark.parametrize("name", sorted(templates.TEMPLATES))
def test_examples_are_the_rendered_templates(name: str) -> None:
    example = Path(__file__).parents[2] / "examples" / f"{name.replace('-', '_')}.sh"
    assert example.read_text() == templates.render_job(name, {}), (
        f"re-render: primus-cli template render {name} -o {example}"
    )
