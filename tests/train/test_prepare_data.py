"""`train prepare-data` on the demo's real corpus: what megatron-core reads back equals tokenizing the
documents directly, workers do not change the output, bad input stops with its line number (or is
skipped and counted), and no run — failed or killed — leaves a pair that looks valid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megamoe.errors import InvalidConfigError
from megamoe.train.indexed import check_prefix
from megamoe.train.prepare_data import PrepareSettings, prepare

ROOT = Path(__file__).resolve().parents[2]


def _settings(demo_data: Path, inputs: list[Path], prefix: Path, **extra: object) -> PrepareSettings:
    base = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(demo_data / "tokenizer"),
            "append_eod": True}  # fmt: skip
    return PrepareSettings(inputs=tuple(inputs), output_prefix=str(prefix), **{**base, **extra})


def _read_back(prefix: str) -> list[np.ndarray]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    return [np.array(dataset[i]) for i in range(len(dataset))]  # copies: the mmap closes with the dataset


def test_megatron_reads_back_the_token_ids_of_each_document(demo_data: Path) -> None:
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(demo_data / "tokenizer/tokenizer.json"))
    eod = reference.token_to_id("<|endoftext|>")
    texts = [json.loads(line)["text"] for line in (demo_data / "corpus.jsonl").read_text().splitlines()]
    documents = _read_back(str(demo_data / "pydoc_text_document"))
    assert len(documents) == len(texts) > 1000
    for text, ids in zip(texts, documents, strict=True):
        assert ids.tolist() == [*reference.encode(text, add_special_tokens=False).ids, eod]
    assert documents[0].dtype == np.uint16  # a 2048-token vocabulary fits in two bytes, as Megatron picks


def test_two_workers_write_the_same_files_as_one(demo_data: Path, tmp_path: Path) -> None:
    summary = prepare(_settings(demo_data, [demo_data / "corpus.jsonl"], tmp_path / "w2", workers=2))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w2_text_document{suffix}").read_bytes() == (
            demo_data / f"pydoc_text_document{suffix}"
        ).read_bytes()
    assert summary.documents > 1000 and summary.tokens > 100_000 and summary.bad_lines == summary.empty == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w2_text_document.bin", "w2_text_document.idx"]


def test_text_files_give_one_document_a_line_and_several_inputs_and_keys_concatenate(
    demo_data: Path, tmp_path: Path
) -> None:
    (tmp_path / "a.txt").write_text("first document\n\nsecond document\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "third", "title": "T"}) + "\n")
    summary = prepare(_settings(demo_data, [tmp_path / "a.txt"], tmp_path / "txt", append_eod=False))
    assert summary.documents == 2 and len(_read_back(str(tmp_path / "txt_text_document"))) == 2
    keys = prepare(_settings(demo_data, [tmp_path / "b.jsonl"], tmp_path / "k", json_keys=("text", "title")))
    assert keys.outputs == [str(tmp_path / "k_text_document"), str(tmp_path / "k_title_document")]


def test_bad_lines_stop_with_their_line_number_or_are_skipped_and_counted(
    demo_data: Path, tmp_path: Path
) -> None:
    corpus = tmp_path / "c.jsonl"
    good = json.dumps({"text": "a real document"})
    corpus.write_text(
        "\n".join([good, "{not json", json.dumps({"body": "x"}), json.dumps({"text": "  "}), good]) + "\n"
    )
    with pytest.raises(
        InvalidConfigError, match=r"^--input='.*c.jsonl:2': not valid JSON .*--skip-bad-lines"
    ):
        prepare(_settings(demo_data, [corpus], tmp_path / "out"))
    assert list(tmp_path.iterdir()) == [corpus]  # nothing written half-way
    summary = prepare(_settings(demo_data, [corpus], tmp_path / "out", skip_bad_lines=True))
    assert (summary.documents, summary.bad_lines, summary.empty) == (2, 2, 1)


def test_a_failed_run_leaves_the_previous_output_untouched(demo_data: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "one document"}) + "\n")
    prepare(_settings(demo_data, [corpus], tmp_path / "out"))
    before = {p.name: p.read_bytes() for p in tmp_path.glob("out_*")}
    corpus.write_text(json.dumps({"text": "another"}) + "\n" + json.dumps({"txt": "no key"}) + "\n")
    with pytest.raises(InvalidConfigError, match=r"c.jsonl:2': no key 'text'"):
        prepare(_settings(demo_data, [corpus], tmp_path / "out"))
    assert {p.name: p.read_bytes() for p in tmp_path.glob("out_*")} == before


@pytest.mark.slow
def test_a_killed_run_leaves_no_pair_that_looks_valid(demo_data: Path, tmp_path: Path) -> None:
    big = tmp_path / "big.jsonl"
    text = (demo_data / "corpus.jsonl").read_text()
    big.write_text(text * 30)
    command = [sys.executable, "-m", "megamoe.train", "prepare-data", "--input", str(big), "--output-prefix",
               str(tmp_path / "out"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
               str(demo_data / "tokenizer"), "--append-eod"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("out_text_document.partial-*.bin")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # well inside the tokenizing of 30 copies of the corpus
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob("out_text_document.partial-*.bin")), "the run ended before it was killed"
    with pytest.raises(InvalidConfigError, match="missing"):
        check_prefix(str(tmp_path / "out_text_document"), "data_path")


def test_the_command_line_gives_one_error_line_and_status_2(demo_data: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "megamoe.train", "prepare-data", "--input", str(tmp_path / "none.jsonl"),
         "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
         str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: --input='{tmp_path / 'none.jsonl'}': no such file."]


def test_the_command_line_prints_a_summary(demo_data: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "megamoe.train", "prepare-data", "--input", str(demo_data / "corpus.jsonl"),
         "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
         str(demo_data / "tokenizer"), "--json-keys", "text", "--append-eod", "--workers", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("prepare-data: 1,9") and "tokens/s" in proc.stdout
    assert "Traceback" not in proc.stderr and "warn" not in proc.stderr.lower(), proc.stderr
