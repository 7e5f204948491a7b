"""Launcher config: layers merge key by key, unknown keys are errors with a suggestion, show attributes."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner import config
from runner.errors import ConfigError


def _resolve(
    tmp_path: Path, home: str = "", project: str = "", file: str = "", cli=()
) -> config.ResolvedConfig:
    (tmp_path / "home").mkdir(exist_ok=True)
    (tmp_path / "proj").mkdir(exist_ok=True)
    if home:
        (tmp_path / "home" / ".primus.yaml").write_text(home)
    if project:
        (tmp_path / "proj" / ".primus.yaml").write_text(project)
    cfg = None
    if file:
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(file)
    return config.resolve(
        home=tmp_path / "home", cwd=tmp_path / "proj", config_file=cfg, env_layer=[], cli_layer=list(cli)
    )


def test_layers_merge_key_by_key_and_later_layers_win(tmp_path: Path) -> None:
    res = _resolve(
        tmp_path,
        home="slurm: {partition: home}\ncontainer: {image: home-img}\n",
        project="slurm: {partition: proj}\n",
        file="slurm: {account: acct}\n",
        cli=[("container.image", "cli-img")],
    )
    assert res.config.slurm.partition == "proj"
    assert res.config.slurm.account == "acct"
    assert res.config.container.image == "cli-img"
    assert res.config.container.ipc == "host"  # a default the user files did not touch
    assert res.sources["slurm.partition"].endswith("proj/.primus.yaml")
    assert res.sources["container.image"] == "command line"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("slurm: {partiton: x}\n", "Did you mean 'slurm.partition'"),
        ("contianer: {image: x}\n", "Did you mean 'container'"),
        ("direct: {master_port: abc}\n", "direct.master_port must be a positive integer"),
        ("direct: {gpus_per_node: 0}\n", "direct.gpus_per_node must be a positive integer, got 0"),
        ("container: {runtime: lxc}\n", "not one of: auto, docker, podman"),
        ("slurm: [1, 2]\n", "section 'slurm' must be a mapping"),
    ],
    ids=["unknown-key", "unknown-section", "bad-int", "zero-count", "bad-choice", "bad-section"],
)
def test_bad_config_is_an_error_naming_the_key(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _resolve(tmp_path, file=text)


def test_missing_config_file_is_an_error_with_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        config.resolve(
            home=None, cwd=tmp_path, config_file=tmp_path / "nope.yaml", env_layer=[], cli_layer=[]
        )


def test_show_prints_every_key_with_its_source(tmp_path: Path) -> None:
    text = _resolve(tmp_path, file="slurm: {partition: gpu}\n").show()
    lines = {line.split(":")[0]: line for line in text.splitlines()}
    assert lines["slurm.partition"].endswith("cfg.yaml")
    assert "gpu" in lines["slurm.partition"]
    assert lines["container.ipc"].endswith("# default")
    assert "env.forward" in lines


def test_values_arrive_literally(tmp_path: Path) -> None:
    res = _resolve(tmp_path, file="slurm: {job_name: '$(touch /tmp/pwned)'}\n")
    assert res.config.slurm.job_name == "$(touch /tmp/pwned)"
