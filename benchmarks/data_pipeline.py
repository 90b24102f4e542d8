"""The data pipeline: preprocessing throughput and random sample access, each against the plain way.

    python benchmarks/data_pipeline.py            # the whole corpus (Shakespeare + Milton), 2000 samples
    python benchmarks/data_pipeline.py --quick    # CI smoke: Milton only, 200 samples

1. preprocessing, tokens/s: ours (`preprocess`: batches of lines through the Rust tokenizer's parallel `encode_batch`,
   into `IndexedDatasetBuilder`) vs a plain loop (one `tokenize` call per line, same builder);
2. a random training sample, us/sample: ours (`GPTDataset[i]`: slices of the memory-mapped .bin) vs without an
   indexed dataset (re-tokenize, from the JSONL text, the documents the sample spans).
The batched encode gains with free cores (Megatron's tools/preprocess_data.py uses a pool of --workers for the same
reason); on a busy 2-core machine it is at par or behind. Medians of interleaved runs after one warm-up; writes benchmarks/results/data_pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, report  # noqa: E402

from megalab.core.datasets import DATA_DIR  # noqa: E402
from megalab.core.datasets.gpt_dataset import GPTDataset  # noqa: E402
from megalab.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder  # noqa: E402
from megalab.tools.preprocess_data import preprocess  # noqa: E402
from megalab.training.tokenizer.tokenizer import Tokenizer  # noqa: E402


def tok_threads() -> str:
    return os.environ.get("RAYON_NUM_THREADS", str(os.cpu_count()))


def plain_preprocess(path: Path, prefix: str, tok: Tokenizer) -> None:
    """The reference: one document at a time."""
    with IndexedDatasetBuilder(prefix, dtype=DType.optimal_dtype(tok.vocab_size)) as builder:
        for line in open(path, encoding="utf-8"):
            ids = tok.tokenize(json.loads(line)["text"]) + [tok.eod]
            builder.add_document(np.asarray(ids), lengths=[len(ids)])
        builder.finalize()


def timed_pair(ours, plain, repeats: int) -> tuple[float, float]:
    """Median seconds of each, runs interleaved (so a change in machine load hits both) after one warm-up each."""
    times = ([], [])
    for r in range(repeats + 1):
        for fn, ts in zip((ours, plain), times):
            t0 = time.perf_counter()
            fn()
            if r:
                ts.append(time.perf_counter() - t0)
    return median(times[0]), median(times[1])


def bench_dataset(name: str, tok: Tokenizer, work: str, samples: int, repeats: int) -> list[list]:
    source = DATA_DIR / f"{name}.jsonl"
    t_ours, t_plain = timed_pair(lambda: preprocess(source, f"{work}/{name}", tok),
                                 lambda: plain_preprocess(source, f"{work}/{name}_plain_text_document", tok), repeats)
    ours = IndexedDataset(f"{work}/{name}_text_document")
    plain = IndexedDataset(f"{work}/{name}_plain_text_document")
    assert all(np.array_equal(ours[i], plain[i]) for i in range(len(ours))), "the two preprocessings disagree"
    n_tokens = int(ours.sequence_lengths.sum())

    texts = [json.loads(line)["text"] for line in open(source, encoding="utf-8")]
    gpt = GPTDataset(ours, seq_length=256, num_samples=samples, seed=0, eod=tok.eod)
    order = np.random.default_rng(0).permutation(samples)

    def retokenize(i: int) -> np.ndarray:
        """Sample i without an indexed dataset: tokenize the documents it spans, cut its 257 tokens."""
        j = gpt.shuffle_index[i]
        (beg, beg_offset), (end, _) = gpt.sample_index[j], gpt.sample_index[j + 1]
        docs = [tok.tokenize(texts[d]) + [tok.eod] for d in gpt.document_index[beg:end + 1]]
        return np.concatenate(docs)[beg_offset:][:257]

    assert all(np.array_equal(retokenize(i), gpt.get_text(i)) for i in order[:5]), "re-tokenized sample differs"
    few = order[: max(10, samples // 50)]  # re-tokenizing is slow: time fewer samples
    t_index, t_text = timed_pair(lambda: [gpt[int(i)] for i in order], lambda: [retokenize(int(i)) for i in few], repeats)
    t_index, t_text = t_index / len(order), t_text / len(few)
    return [[f"preprocess {name} (tokens/s)", n_tokens / t_ours, n_tokens / t_plain, t_plain / t_ours],
            [f"sample {name} (us/sample)", t_index * 1e6, t_text * 1e6, t_text / t_index]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke: Milton only, 200 samples, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    names = ["milton"] if args.quick else ["shakespeare", "milton"]
    samples, repeats = (200, 1) if args.quick else (2000, args.repeats)
    print(f"{tok_threads()} tokenizer threads; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    tok = Tokenizer.from_file()
    work = tempfile.mkdtemp()
    rows = [row for name in names for row in bench_dataset(name, tok, work, samples, repeats)]
    report("data_pipeline", ["what", "ours", "plain", "ratio (ours faster by)"], rows,
           extra={"quick": args.quick, "samples": samples, "repeats": repeats, "load_average": os.getloadavg()[0],
                  "cpus": os.cpu_count()})


if __name__ == "__main__":
    main()
