"""Training throughput on real-length documents: padded batches vs packed batches (megalab/core/packed_seq_params.py).

The documents are paragraphs of the shipped corpus (data/*.jsonl split at blank lines: speeches, stanzas,
sonnets; at least 8 tokens), tokenized and cut to at most seq_length + 1 tokens, in corpus order. The same
GPTModel trains on them (forward, backward, AdamW step) two ways, `batch` rows per step:

    padded  rows of one document each, padded to the longest document of the batch (dynamic padding);
            the padding is masked out of the loss but still costs every matmul
    packed  documents back to back in rows of seq_length tokens (greedy, in order; a row's unused tail is
            a padding "document"), GPTModel(..., packed_seq_params=) keeps the documents apart

Reported: real (non-padding) tokens per second of each, the packed/padded ratio, the share of padding, and
the check that both give the same loss before training (the mean over the same real tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import report  # noqa: E402

from megalab.core.datasets import DATA_DIR  # noqa: E402
from megalab.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megalab.core.packed_seq_params import PackedSeqParams, pack_batch  # noqa: E402
from megalab.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megalab.training.tokenizer.tokenizer import Tokenizer  # noqa: E402


def corpus_documents(seq_length: int, count: int) -> list[torch.Tensor]:
    """`count` paragraphs (speeches, stanzas, sonnets) spread evenly over the corpus: token tensors of
    8 .. seq_length + 1 tokens."""
    tokenizer = Tokenizer.from_file()
    sections = [section for name in ("shakespeare.jsonl", "milton.jsonl")
                for line in (DATA_DIR / name).read_text().splitlines()
                for section in re.split(r"\n\s*\n", json.loads(line)["text"])]
    docs = [torch.tensor(tokenizer.tokenize(s)[:seq_length + 1]) for s in sections]
    docs = [d for d in docs if len(d) >= 8]  # a heading is not a document
    return docs[::max(1, len(docs) // count)][:count]


def padded_batches(docs, batch: int) -> list[dict]:
    """Rows of one document each, padded to the batch's longest; loss_mask 0 on the padding."""
    out = []
    for i in range(0, len(docs), batch):
        group = docs[i:i + batch]
        longest = max(len(d) for d in group) - 1
        tokens = torch.stack([F.pad(d[:-1], (0, longest - len(d) + 1)) for d in group])  # [b, longest]
        labels = torch.stack([F.pad(d[1:], (0, longest - len(d) + 1)) for d in group])
        mask = (torch.arange(longest)[None] < torch.tensor([len(d) - 1 for d in group])[:, None]).float()
        out.append(dict(tokens=tokens, labels=labels, loss_mask=mask))
    return out


def packed_batches(docs, batch: int, seq_length: int) -> list[dict]:
    """Documents in order, greedily packed into rows of seq_length tokens (pack_batch); `batch` rows per step."""
    rows = pack_batch(docs, seq_length)
    params = rows["packed_seq_params"].cu_seqlens_q
    out = []
    for i in range(0, rows["tokens"].shape[0], batch):
        start, stop = i * seq_length, min(i + batch, rows["tokens"].shape[0]) * seq_length
        cu = params[(params >= start) & (params <= stop)] - start  # these rows' boundaries, from 0
        out.append({key: rows[key][i:i + batch] for key in ("tokens", "labels", "loss_mask")}
                   | dict(packed_seq_params=PackedSeqParams.from_cu_seqlens(cu)))
    return out


def loss_of(model, batch, device) -> torch.Tensor:
    """Sum of the per-token losses over the batch's real tokens."""
    params = batch.get("packed_seq_params")
    if params is not None and device != "cpu":
        params = PackedSeqParams.from_cu_seqlens(params.cu_seqlens_q.to(device))
    loss = model(batch["tokens"].to(device), labels=batch["labels"].to(device), packed_seq_params=params)
    return (loss.float() * batch["loss_mask"].to(device)).sum()


def epoch_seconds(model, optimizer, batches, device) -> float:
    """One pass over the batches: forward, backward, optimizer step."""
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in batches:
        loss = loss_of(model, batch, device) / batch["loss_mask"].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-length", type=int, default=None)
    parser.add_argument("--docs", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="CI smoke: 128 documents, a tiny model, 2 passes")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype, backend = ("cuda", torch.bfloat16, "auto") if cuda else ("cpu", torch.float32, "sdpa")
    if args.quick:
        defaults, size = (128, 128, 2), dict(num_layers=2, hidden_size=64, num_attention_heads=4)
    else:
        defaults, size = (256, 512, 3), dict(num_layers=4, hidden_size=128, num_attention_heads=4)
    seq_length, count, reps = (a if a is not None else d for a, d in zip((args.seq_length, args.docs, args.reps), defaults))
    docs = corpus_documents(seq_length, count)
    config = TransformerConfig(**size, vocab_size=Tokenizer.from_file().vocab_size, seq_length=seq_length,
                               hidden_dropout=0.0, attention_dropout=0.0, attention_backend=backend)
    variants = {"padded": padded_batches(docs, args.batch), "packed": packed_batches(docs, args.batch, seq_length)}
    real = sum(len(d) - 1 for d in docs)
    positions = {name: sum(b["tokens"].numel() for b in batches) for name, batches in variants.items()}

    models, optimizers = {}, {}
    for name in variants:  # one model per variant, from the same weights
        torch.manual_seed(0)
        models[name] = GPTModel(config).to(device, dtype)
        optimizers[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4)
    with torch.no_grad():  # the same weights, the same real tokens: the same mean loss
        losses = {name: sum(loss_of(models[name], b, device).item() for b in batches) / real
                  for name, batches in variants.items()}
    same_loss = abs(losses["packed"] - losses["padded"]) < (1e-2 if cuda else 1e-4) * losses["padded"]
    seconds = {name: [] for name in variants}
    for _ in range(reps + 1):  # the first pass warms up; the variants interleave so they share the machine's state
        for name, batches in variants.items():
            seconds[name].append(epoch_seconds(models[name], optimizers[name], batches, device))
    best = {name: min(ts[1:]) for name, ts in seconds.items()}  # the least disturbed pass
    rows = [[name, len(variants[name]), positions[name], f"{1 - real / positions[name]:.0%}", 1e3 * best[name],
             real / best[name], best["padded"] / best[name]] for name in variants]
    print(f"{len(docs)} corpus documents, {real} real tokens, seq_length {seq_length}, batch {args.batch} rows, "
          f"{size}, {device} {dtype}, attention {backend}; load average {os.getloadavg()[0]:.1f}")
    print(f"loss before training, packed == padded: {same_loss} ({losses['packed']:.4f} vs {losses['padded']:.4f})")
    report("sequence_packing", ["batches", "steps", "positions", "padding", "ms per pass", "real tokens/s",
                                "speed-up vs padded"], rows,
           extra=dict(device=device, dtype=str(dtype), seq_length=seq_length, documents=len(docs),
                      real_tokens=real, same_loss=same_loss, losses=losses, model=size))
    if not same_loss:
        raise SystemExit("packed and padded losses differ")


if __name__ == "__main__":
    main()
