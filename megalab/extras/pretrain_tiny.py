"""A short, real pretraining run on the shipped corpus: the loop of pretrain_gpt.py in miniature.

    data/shakespeare.jsonl ─ tokenizer (data/tokenizer.json) ─> one long stream of token ids
    repeat: random windows [b, s+1] ─> (input ids [b, s], labels shifted by one) ─> model ─> loss
            ─> backward ─> AdamW step (─> update_expert_bias for aux-loss-free MoE routing)

One process, deterministic for a seed: enough to see a tiny LLaMA or MoE learn (the loss falls
from ln V towards the corpus's entropy). Chapter 05 builds the real data pipeline and chapter
06 the full training loop with parallelism; Megatron: pretrain_gpt.py and megatron/training/training.py.
"""

from __future__ import annotations

import json
import math

import torch
from torch import nn

from megalab.core.datasets import DATA_DIR
from megalab.training.tokenizer.tokenizer import Tokenizer


def corpus_tokens(max_chars: int = 200_000, path=DATA_DIR / "shakespeare.jsonl") -> torch.Tensor:
    """The first max_chars characters of the corpus, documents joined by <|endoftext|>, as token ids [n]."""
    tokenizer = Tokenizer.from_file()
    ids, chars = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"][: max_chars - chars]
            ids += tokenizer.tokenize(text) + [tokenizer.eod]
            chars += len(text)
            if chars >= max_chars:
                break
    return torch.tensor(ids, dtype=torch.long)


def pretrain(model: nn.Module, tokens: torch.Tensor, steps: int, micro_batch_size: int = 8, lr: float = 3e-3,
             seed: int = 0) -> list[float]:
    """Train on random windows of `tokens` with AdamW (cosine decay after 10% warmup); the loss of every step."""
    seq_length = model.config.seq_length
    if tokens.numel() <= seq_length + 1:
        raise ValueError(f"{tokens.numel()} tokens are too few for windows of seq_length+1={seq_length + 1}")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min((i + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(1.0, (i - warmup) / max(1, steps - warmup))))))
    needs_bias_update = any(getattr(m, "expert_bias", None) is not None for m in model.modules())
    model.train()
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - seq_length - 1, (micro_batch_size,), generator=generator)
        window = torch.stack([tokens[i:i + seq_length + 1] for i in starts.tolist()])  # [b, s+1]
        loss = model(window[:, :-1], labels=window[:, 1:]).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if needs_bias_update:
            from megalab.core.distributed.finalize_model_grads import update_expert_bias
            update_expert_bias(model)
        losses.append(loss.item())
    return losses
