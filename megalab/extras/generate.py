"""Greedy decoding: append the most likely next token, again and again.

    ids [b, s] ─ model ─> logits [b, s, V] ─ argmax of the last position ─> ids [b, s+1] ─ ...

The whole prefix is recomputed at every step (no KV cache: the inference chapter adds one);
enough to check token for token against Hugging Face's generate(do_sample=False).
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def greedy_generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """[b, s] prompt -> [b, s + max_new_tokens]; the model must return logits [b, s, V]."""
    limit = model.config.seq_length
    if input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt {input_ids.shape[1]} + {max_new_tokens} new tokens exceed seq_length={limit}")
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        next_id = model(input_ids)[:, -1].argmax(dim=-1, keepdim=True)  # [b, 1]
        input_ids = torch.cat([input_ids, next_id], dim=1)
    model.train(was_training)
    return input_ids
