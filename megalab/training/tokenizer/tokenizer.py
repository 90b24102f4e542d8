"""A byte-level BPE tokenizer, trained with Hugging Face `tokenizers` and wrapped in Megatron's tokenizer interface.

    "To be, or not" ──ByteLevel pre-tokenizer──► ["To", "Ġbe", ",", "Ġor", "Ġnot"] ──BPE merges──► [399, 312, 12, 424, 325]

Byte-level means the base alphabet is the 256 bytes, so any text encodes (no unknown token) and `detokenize(tokenize(s))
== s`. One special token, `<|endoftext|>` (GPT-2's), is the end-of-document id `eod` that preprocessing appends to
every document. The shipped `data/tokenizer.json` was trained on the course corpus:

    python -m megalab.training.tokenizer.tokenizer data/shakespeare.jsonl data/milton.jsonl --vocab-size 8192 -o data/tokenizer.json

Megatron-LM: `megatron/core/tokenizers/` (`MegatronTokenizer`; `build_tokenizer` in utils/build_tokenizer.py; the
`HuggingFaceTokenizer` of text/libraries/): the same `tokenize` / `detokenize` / `eod` / `vocab_size` names.
"""

import argparse
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from megalab.core.datasets import DATA_DIR

EOD_TOKEN = "<|endoftext|>"
DEFAULT_TOKENIZER = DATA_DIR / "tokenizer.json"


class Tokenizer:
    """Megatron-style wrapper around a `tokenizers.Tokenizer`: `tokenize`, `detokenize`, `eod`, `vocab_size`."""

    def __init__(self, hf_tokenizer: HFTokenizer):
        self.hf = hf_tokenizer
        eod = hf_tokenizer.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ValueError(f"the tokenizer has no {EOD_TOKEN!r} token: train it with megalab.training.tokenizer.tokenizer.train_tokenizer")
        self.eod = eod

    @classmethod
    def from_file(cls, path: str | Path = DEFAULT_TOKENIZER) -> "Tokenizer":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer file there; train one with `python -m megalab.training.tokenizer.tokenizer`")
        return cls(HFTokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def tokenize(self, text: str) -> list[int]:
        return self.hf.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once (the Rust side encodes them in parallel threads)."""
        return [e.ids for e in self.hf.encode_batch(texts)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)


def iter_jsonl_texts(paths: Iterable[str | Path], key: str = "text") -> Iterator[str]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)[key]


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Learn byte-level BPE merges on `texts` until the vocabulary (256 bytes + merges + `<|endoftext|>`) has `vocab_size` entries."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megalab.training.tokenizer.tokenizer", description="train a byte-level BPE tokenizer on JSONL files")
    parser.add_argument("inputs", nargs="+", help="JSONL files, one document per line")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("-o", "--output", default=str(DEFAULT_TOKENIZER))
    args = parser.parse_args(argv)
    tok = train_tokenizer(iter_jsonl_texts(args.inputs, args.json_key), args.vocab_size)
    tok.hf.save(args.output)
    print(f"wrote {args.output}: vocab_size={tok.vocab_size}, eod={tok.eod}")


if __name__ == "__main__":
    main()
