"""Tokenizers for `train prepare-data` and real-data training: megatron-core's own, from local files.

Megatron-LM's ``--tokenizer-type`` names map onto megatron-core's tokenizer libraries:
``HuggingFaceTokenizer`` (a local directory holding a ``tokenizer.json`` made by the ``tokenizers``
library, or any ``transformers`` tokenizer folder), ``SentencePieceTokenizer`` (a local ``.model``
file) and ``NullTokenizer`` (text of space-separated ids, ``vocab_size`` ids plus one EOD id).
Only local paths are accepted, so nothing is ever fetched from a model hub.

:func:`check_tokenizer` looks at files only (cheap: start-up validation and the launcher's preflight
call it); :func:`build_tokenizer` loads the tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megamoe.errors import InvalidConfigError, UnsupportedSettingError

HUGGINGFACE = "HuggingFaceTokenizer"
SENTENCEPIECE = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")
NULL = "NullTokenizer"
TOKENIZER_TYPES = (HUGGINGFACE, *SENTENCEPIECE, NULL)

_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_tokenizer(tokenizer_type: str | None, tokenizer_model: str | None, vocab_size: int | None) -> None:
    """Raise, naming the setting, when the tokenizer cannot be built from these values (files only)."""
    if tokenizer_type is None:
        raise InvalidConfigError(
            "tokenizer_type",
            None,
            "real data needs a tokenizer",
            f"Set tokenizer_type to one of {', '.join(TOKENIZER_TYPES)}",
        )
    if tokenizer_type not in TOKENIZER_TYPES:
        raise UnsupportedSettingError(
            "tokenizer_type",
            tokenizer_type,
            "not a tokenizer this trainer can load from local files (hub names such as Primus's need hub access)",
            f"Use one of {', '.join(TOKENIZER_TYPES)}, with tokenizer_model pointing at local files",
        )
    if tokenizer_type == NULL:
        if vocab_size is None or vocab_size < 1:
            raise InvalidConfigError(
                "vocab_size", vocab_size, "NullTokenizer needs the number of token ids", "Set vocab_size"
            )
        return
    if tokenizer_model is None:
        raise InvalidConfigError(
            "tokenizer_model", None, f"{tokenizer_type} needs local tokenizer files", "Set tokenizer_model"
        )
    path = Path(tokenizer_model)
    if tokenizer_type == HUGGINGFACE:
        if not path.is_dir():
            raise InvalidConfigError(
                "tokenizer_model",
                tokenizer_model,
                "no such directory (HuggingFaceTokenizer loads a local tokenizer folder, never the hub)",
                "Point it at a directory holding tokenizer.json",
            )
        if not any((path / name).is_file() for name in _HF_FILES):
            raise InvalidConfigError(
                "tokenizer_model",
                tokenizer_model,
                f"the directory holds no tokenizer (none of {', '.join(_HF_FILES)})",
                "Save the tokenizer there (tokenizers: Tokenizer.save('DIR/tokenizer.json'))",
            )
    elif not path.is_file():
        raise InvalidConfigError(
            "tokenizer_model",
            tokenizer_model,
            "no such file (SentencePieceTokenizer loads a local .model file)",
            "Point it at the SentencePiece model file",
        )


def build_tokenizer(tokenizer_type: str | None, tokenizer_model: str | None, vocab_size: int | None) -> Any:
    """megatron-core's tokenizer for these settings (checked first)."""
    from megatron.core.tokenizers import MegatronTokenizer

    check_tokenizer(tokenizer_type, tokenizer_model, vocab_size)
    if tokenizer_type == NULL:
        return null_tokenizer(vocab_size)
    library = "huggingface" if tokenizer_type == HUGGINGFACE else "sentencepiece"
    kwargs: dict[str, Any] = {"use_fast": True} if library == "huggingface" else {}
    try:
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=str(tokenizer_model), metadata_path={"library": library}, **kwargs
        )
    except (ValueError, OSError, RuntimeError) as e:
        raise InvalidConfigError(
            "tokenizer_model",
            tokenizer_model,
            f"{tokenizer_type} could not load it: {str(e).splitlines()[0][:300]}",
            "Check the files, or the tokenizer_type",
        ) from e


def null_tokenizer(vocab_size: int) -> Any:
    """megatron-core's null tokenizer; its metadata key changed from ``null`` (0.16) to ``null-text``."""
    from megatron.core.tokenizers import MegatronTokenizer

    try:
        return MegatronTokenizer.from_pretrained(
            metadata_path={"library": "null-text"}, vocab_size=vocab_size
        )
    except (AssertionError, ValueError, KeyError):
        return MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=vocab_size)


def end_of_document_id(tokenizer: Any, tokenizer_model: str | None) -> int:
    """The id appended after every document; an error when the tokenizer defines none."""
    eod = tokenizer.eod
    if eod is None or eod < 0:
        raise InvalidConfigError(
            "tokenizer_model",
            tokenizer_model,
            "the tokenizer defines no end-of-document token (eos_token)",
            'Add "eos_token": "<your end token>" to its tokenizer_config.json, or drop --append-eod',
        )
    return int(eod)
