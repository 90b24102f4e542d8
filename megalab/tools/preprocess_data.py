"""Preprocessing: JSONL documents ──tokenize + <|endoftext|>──► `{prefix}_text_document.bin/.idx`.

    {"text": "ACT I. Scene I. ..."}      ──►  [1033, 317, ..., 0]   one sequence per document, eod appended
    {"text": "Sonnet ..."}               ──►  [881, 45, ..., 0]
              ... (batches of lines, tokenized in parallel by the Rust tokenizer, a progress bar in bytes read)

The output is written through `IndexedDatasetBuilder`, so it appears only when every line was good: a malformed
line stops the run with `file:line: what is wrong` and leaves no .bin/.idx behind.

    python -m megalab.tools.preprocess_data --input data/shakespeare.jsonl --output-prefix corpus/shakespeare

Megatron-LM: `tools/preprocess_data.py` (`Encoder.encode`, `--json-keys`, `--append-eod`, output
`{output_prefix}_{key}_document.bin/.idx`), which fans lines out over a multiprocessing pool; here the Rust
tokenizer's own threads (`encode_batch`) do that.
"""

import argparse
import json
import os
import uuid
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from megalab.core.datasets import DATA_DIR
from megalab.core.datasets.indexed_dataset import DataFormatError, DType, IndexedDatasetBuilder
from megalab.lab.dist import cache_dir
from megalab.training.tokenizer.tokenizer import DEFAULT_TOKENIZER, Tokenizer


def read_jsonl_batches(path: str | Path, json_key: str = "text", batch_size: int = 64, progress: bool = False):
    """Yields lists of document texts; a bad line raises DataFormatError naming the file and line number."""
    size = os.path.getsize(path)
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"tokenizing {Path(path).name}",
                                     disable=not progress) as bar:
        batch = []
        for line_number, raw in enumerate(f, start=1):
            bar.update(len(raw))
            if not raw.strip():
                continue
            try:
                document = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataFormatError(f"{path}:{line_number}: not a JSON object ({e}); fix or delete that line") from None
            if not isinstance(document, dict) or not isinstance(document.get(json_key), str):
                raise DataFormatError(
                    f"{path}:{line_number}: expected an object with a string {json_key!r} field; fix the line "
                    "or pass --json-key")
            batch.append(document[json_key])
            if len(batch) == batch_size:
                yield batch
                batch = []
        if batch:
            yield batch


def preprocess(input_path: str | Path, output_prefix: str | Path, tokenizer: Tokenizer, json_key: str = "text",
               append_eod: bool = True, progress: bool = False) -> str:
    """Tokenize every document of a JSONL file into `{output_prefix}_{json_key}_document.bin/.idx`; returns that prefix."""
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"{input_path}: no such input file")
    prefix = f"{output_prefix}_{json_key}_document"
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetBuilder(prefix, dtype=DType.optimal_dtype(tokenizer.vocab_size)) as builder:
        for texts in read_jsonl_batches(input_path, json_key, progress=progress):
            for ids in tokenizer.tokenize_batch(texts):
                if append_eod:
                    ids.append(tokenizer.eod)
                builder.add_document(np.asarray(ids), lengths=[len(ids)])
        builder.finalize()
    return prefix


def prepare_corpus(names: tuple[str, ...] = ("shakespeare", "milton"), out_dir: str | Path | None = None,
                   tokenizer_path: str | Path = DEFAULT_TOKENIZER) -> list[str]:
    """The shipped corpus files `data/{name}.jsonl`, preprocessed once into `out_dir` (default: this user's and
    this tree's cache, megalab.lab.dist.cache_dir("data")) and reused while newer than the JSONL and the
    tokenizer. Each pair is written under a name of its own, then renamed into place (.idx last), so ranks or
    runs preparing it at the same time never read a half-written file. Returns the dataset prefixes."""
    out_dir = Path(out_dir or cache_dir("data"))
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, prefixes = None, []
    for name in names:
        source = DATA_DIR / f"{name}.jsonl"
        prefix = out_dir / name
        idx = Path(f"{prefix}_text_document.idx")
        if not idx.exists() or idx.stat().st_mtime < max(source.stat().st_mtime, Path(tokenizer_path).stat().st_mtime):
            tokenizer = tokenizer or Tokenizer.from_file(tokenizer_path)
            private = out_dir / f".{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}_text_document"
            try:
                preprocess(source, str(private).removesuffix("_text_document"), tokenizer)
                os.replace(f"{private}.bin", f"{prefix}_text_document.bin")
                os.replace(f"{private}.idx", idx)
            finally:  # a failed build leaves no half-written private files behind in the shared cache
                for suffix in (".bin", ".idx"):
                    Path(f"{private}{suffix}").unlink(missing_ok=True)
        prefixes.append(f"{prefix}_text_document")
    return prefixes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megalab.tools.preprocess_data",
                                     description="tokenize a JSONL corpus into Megatron's .bin/.idx indexed dataset")
    parser.add_argument("--input", required=True, help="JSONL file, one document per line")
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}_{json_key}_document.bin/.idx")
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="tokenizer JSON (default: data/tokenizer.json)")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--no-append-eod", action="store_true", help="do not end each document with <|endoftext|>")
    args = parser.parse_args(argv)
    try:
        prefix = preprocess(args.input, args.output_prefix, Tokenizer.from_file(args.tokenizer), args.json_key,
                            append_eod=not args.no_append_eod, progress=True)
    except (DataFormatError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {prefix}.bin and {prefix}.idx")


if __name__ == "__main__":
    main()
