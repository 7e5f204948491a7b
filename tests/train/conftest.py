"""The real-text corpus of the demo, its locally trained BPE tokenizer and the prepared dataset,
made once per test session (examples/data/make_demo_corpus.py, then `train prepare-data`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with corpus.jsonl, tokenizer/ and pydoc_text_document.{bin,idx} (the demo's layout)."""
    folder = tmp_path_factory.mktemp("demo-data")
    subprocess.run(
        [sys.executable, str(ROOT / "examples/data/make_demo_corpus.py"), "--output", str(folder)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    from megamoe.train.prepare_data import PrepareSettings, prepare

    prepare(
        PrepareSettings(
            inputs=(folder / "corpus.jsonl",),
            output_prefix=str(folder / "pydoc"),
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_model=str(folder / "tokenizer"),
            append_eod=True,
            workers=1,
        )
    )
    return folder
