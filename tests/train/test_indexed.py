"""Blend and split strings as Megatron-LM writes them, and the integrity checks of a .bin/.idx pair."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megamoe.errors import InvalidConfigError
from megamoe.train.indexed import Blend, check_prefix, parse_blend, parse_split


@pytest.mark.parametrize(
    ("text", "blend"),
    [
        ("data/a_text_document", Blend(prefixes=("data/a_text_document",), weights=None)),
        ("a b", Blend(prefixes=("a", "b"), weights=None)),
        ("0.7 a 0.3 b", Blend(prefixes=("a", "b"), weights=(0.7, 0.3))),
        ("  2 a\n1e-1 b ", Blend(prefixes=("a", "b"), weights=(2.0, 0.1))),
    ],
)
def test_blends_parse(text: str, blend: Blend) -> None:
    assert parse_blend(text, "data_path") == blend


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty"),
        ("0.7 a 0.3", "a weight before every prefix"),
        ("0.7 a b c", "weight 'b' is not a number"),
        ("a 0.3 b", "looks like a weight"),
        ("0 a 0 b", "sum to more than 0"),
        ("-1 a 2 b", "must be >= 0"),
    ],
)
def test_bad_blends_name_the_setting(text: str, match: str) -> None:
    with pytest.raises(InvalidConfigError, match=rf"^data_path=.*{match}"):
        parse_blend(text, "data_path")


def test_split_strings() -> None:
    assert parse_split("969,30,1") == (969.0, 30.0, 1.0)
    assert parse_split("99/1") == (99.0, 1.0, 0.0)
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2,0"):
        with pytest.raises(InvalidConfigError, match=r"^split="):
            parse_split(bad)


def test_a_complete_pair_passes_and_each_broken_one_is_named(demo_data: Path, tmp_path: Path) -> None:
    source = demo_data / "pydoc_text_document"
    check_prefix(str(source), "data_path")

    missing = tmp_path / "gone_text_document"
    with pytest.raises(
        InvalidConfigError, match=r"gone_text_document.bin and gone_text_document.idx missing"
    ):
        check_prefix(str(missing), "data_path")

    only_bin = tmp_path / "half_text_document"
    shutil.copy(source.with_suffix(".bin"), only_bin.with_suffix(".bin"))
    with pytest.raises(InvalidConfigError, match=r"half_text_document.idx missing in .*Make it with"):
        check_prefix(str(only_bin), "data_path")

    truncated = tmp_path / "cut_text_document"
    shutil.copy(source.with_suffix(".idx"), truncated.with_suffix(".idx"))
    data = source.with_suffix(".bin").read_bytes()
    truncated.with_suffix(".bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidConfigError, match=r"the pair does not match. Re-run `train prepare-data`"):
        check_prefix(str(truncated), "data_path")

    not_index = tmp_path / "junk_text_document"
    not_index.with_suffix(".idx").write_bytes(b"hello")
    not_index.with_suffix(".bin").write_bytes(b"")
    with pytest.raises(InvalidConfigError, match="not a megatron index file"):
        check_prefix(str(not_index), "data_path")
