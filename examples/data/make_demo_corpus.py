"""The demo's real text and its tokenizer, made locally from what Python itself ships.

The corpus is the Python Language Reference's topic pages that CPython installs as
``pydoc_data.topics`` (what ``help("if")`` shows; Python Software Foundation License): 79 topics,
about 0.45 MB of English prose and grammar. Each blank-line-separated paragraph is one document
of a JSON-lines file. The tokenizer is a byte-level BPE trained on that corpus by the
``tokenizers`` library and saved as ``tokenizer.json`` plus a ``tokenizer_config.json`` that names
its end-of-document token, the folder ``--tokenizer-type HuggingFaceTokenizer`` loads.

    python examples/data/make_demo_corpus.py --output output/data --vocab-size 2048
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

END_OF_DOCUMENT = "<|endoftext|>"


def documents() -> list[str]:
    """The reference's paragraphs, in topic order, each with its topic name as context."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            text = paragraph.strip()
            if len(text) >= 40 and not set(text) <= set("*=-~^ \n"):
                out.append(text)
    return out


def train_tokenizer(texts: list[str], vocab_size: int, folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_DOCUMENT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END_OF_DOCUMENT}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="folder for corpus.jsonl and tokenizer/")
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args()
    texts = documents()
    args.output.mkdir(parents=True, exist_ok=True)
    corpus = args.output / "corpus.jsonl"
    partial = corpus.with_suffix(".jsonl.partial")
    with partial.open("w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    partial.replace(corpus)
    train_tokenizer(texts, args.vocab_size, args.output / "tokenizer")
    print(
        f"{len(texts)} documents, {corpus.stat().st_size / 2**20:.2f} MB -> {corpus}; tokenizer -> {args.output / 'tokenizer'}"
    )


if __name__ == "__main__":
    main()
