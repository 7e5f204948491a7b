"""Tokenizers from local files only: megatron-core's HuggingFace (a `tokenizers`-made tokenizer.json),
SentencePiece and null tokenizers, and the error for each way the settings can be wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megamoe.errors import InvalidConfigError, UnsupportedSettingError
from megamoe.train.tokenizer import build_tokenizer, check_tokenizer, end_of_document_id


def test_huggingface_tokenizer_from_a_tokenizers_json_matches_the_tokenizers_library(demo_data: Path) -> None:
    from tokenizers import Tokenizer

    folder = demo_data / "tokenizer"
    tok = build_tokenizer("HuggingFaceTokenizer", str(folder), None)
    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = 'The "if" statement is used for conditional execution: if x > 0:\n    pass'
    assert tok.tokenize(text) == reference.encode(text, add_special_tokens=False).ids
    assert tok.vocab_size == reference.get_vocab_size() == 2048
    assert end_of_document_id(tok, str(folder)) == reference.token_to_id("<|endoftext|>")


def test_a_tokenizer_without_an_end_token_is_refused_for_append_eod(demo_data: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((demo_data / "tokenizer/tokenizer.json").read_bytes())
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path), None)
    with pytest.raises(InvalidConfigError, match="defines no end-of-document token"):
        end_of_document_id(tok, str(tmp_path))


def test_sentencepiece_model_file(demo_data: Path, tmp_path: Path) -> None:
    import sentencepiece as spm

    texts = [json.loads(line)["text"] for line in (demo_data / "corpus.jsonl").read_text().splitlines()[:400]]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(tmp_path / "sp"), vocab_size=300, minloglevel=2
    )
    tok = build_tokenizer("SentencePieceTokenizer", str(tmp_path / "sp.model"), None)
    reference = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert tok.tokenize("conditional execution") == reference.encode("conditional execution")
    assert end_of_document_id(tok, str(tmp_path / "sp.model")) == reference.eos_id()


def test_null_tokenizer_reads_ids_and_appends_its_own_eod() -> None:
    tok = build_tokenizer("NullTokenizer", None, 100)
    assert tok.tokenize("5 7 99") == [5, 7, 99]
    assert (tok.vocab_size, end_of_document_id(tok, None)) == (101, 100)


@pytest.mark.parametrize(
    ("tokenizer_type", "model", "vocab", "error", "match"),
    [
        (None, None, None, InvalidConfigError, r"^tokenizer_type=None: real data needs a tokenizer"),
        ("DeepSeekV3Tokenizer", "x", None, UnsupportedSettingError, r"^tokenizer_type='DeepSeekV3Tokenizer'"),
        ("HuggingFaceTokenizer", None, None, InvalidConfigError, r"^tokenizer_model=None"),
        ("HuggingFaceTokenizer", "{tmp}/nope", None, InvalidConfigError, "no such directory"),
        ("HuggingFaceTokenizer", "{tmp}", None, InvalidConfigError, "the directory holds no tokenizer"),
        ("SentencePieceTokenizer", "{tmp}/sp.model", None, InvalidConfigError, "no such file"),
        ("NullTokenizer", None, None, InvalidConfigError, r"^vocab_size=None: NullTokenizer"),
    ],
)
def test_bad_tokenizer_settings_name_the_setting(
    tokenizer_type, model, vocab, error, match, tmp_path: Path
) -> None:
    with pytest.raises(error, match=match):
        check_tokenizer(tokenizer_type, model and model.format(tmp=tmp_path), vocab)
