"""Sliding-window attention: every query sees only the last W keys (Mistral 7B; Gemma 2/3's local layers).

    causal (W >= s)              sliding window W = 3            key j is visible to query i
    q0  ■ . . . . . .            ■ . . . . . .                   iff  i - W < j <= i
    q1  ■ ■ . . . . .            ■ ■ . . . . .
    q2  ■ ■ ■ . . . .            ■ ■ ■ . . . .
    q3  ■ ■ ■ ■ . . .            . ■ ■ ■ . . .
    q4  ■ ■ ■ ■ ■ . .            . . ■ ■ ■ . .
    q5  ■ ■ ■ ■ ■ ■ .            . . . ■ ■ ■ .

One layer sees W tokens back, L stacked layers L(W - 1) + 1: information still travels the whole
sequence, layer by layer, while each layer's cost (and its KV cache) stops growing with s.

Two implementations of the same numbers:

    masked   SDPA with the [s, s] band mask: s^2 scores, most of them thrown away (dropout works)
    blocked  queries in blocks of W; block c needs only keys of blocks c-1 and c:
             [n, W] queries x [n, 2W] keys = 2 s W scores, linear in s

    keys      | block c-1 | block c |
    block c   |  . ■ ■ ■  | ■ . . . |    the same [W, 2W] band for every block
    queries   |  . . ■ ■  | ■ ■ . . |    (block 0's "block -1" is padding, masked out)
              |  . . . ■  | ■ ■ ■ . |
              |  . . . .  | ■ ■ ■ ■ |

SlidingWindowAttention has CoreAttention's signature, so it enters any GPTModel (or the tensor-parallel
one: attention heads are local to a rank) through the layer spec: `sliding_window_spec(W)`; no model code
changes. Megatron: TransformerConfig.window_size = (W - 1, 0) (`--window-size`, flash-attn's
(left, right) convention), honoured by TEDotProductAttention; Hugging Face: MistralConfig.sliding_window.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.transformer_config import TransformerConfig


def _check_window(window: int) -> None:
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window_size must be a positive integer (keys each query sees, itself included), got {window!r}")


def sliding_window_mask(seq_length: int, window: int, device=None) -> torch.Tensor:
    """[s, s] bool, True where query i may attend key j: i - window < j <= i."""
    _check_window(window)
    # EXERCISE sliding_window.mask: True where 0 <= i - j < window (causal, and at most window - 1 tokens back)
    ### BEGIN SOLUTION
    # HINT 1: Query i sees key j when j is not in the future and at most window - 1 tokens back:
    #         0 <= i - j < window (the window counts the query's own token).
    # HINT 2: Broadcast a column of query positions [s, 1] against a row of key positions [1, s]
    #         (torch.arange), take the distance i - j and combine the two comparisons with &.
    # HINT 3: Off by one: window=1 must leave only the diagonal.
    i = torch.arange(seq_length, device=device)[:, None]
    j = torch.arange(seq_length, device=device)[None, :]
    distance = i - j
    return (distance >= 0) & (distance < window)
    ### END SOLUTION


def masked_sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                                    dropout_p: float = 0.0) -> torch.Tensor:
    """[b, h, s, d] -> [b, h, s, d]: SDPA with the band mask (all s^2 scores are computed)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=sliding_window_mask(q.shape[2], window, q.device),
                                          dropout_p=dropout_p)


def blocked_sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """[b, h, s, d] -> [b, h, s, d]: each block of W queries against its 2W candidate keys (2 s W scores)."""
    _check_window(window)
    b, h, s, d = q.shape
    n = -(-s // window)  # blocks; the sequence is padded to n * W
    # EXERCISE sliding_window.blocked: blocks of W queries, keys/values of the previous + own block, one band mask, SDPA
    ### BEGIN SOLUTION
    # HINT 1: Cut the (padded) sequence into n blocks of W queries; every key a query in block c may see
    #         lies in block c-1 or block c, so each block attends to 2W candidate keys with one shared band mask.
    # HINT 2: Pad to n * W and view as [b, h, n, W, d]; build keys/values of [previous block; own
    #         block] -> [b, h, n, 2W, d] (block -1 = zeros); a [W, 2W] band (key offset t vs query offset r:
    #         r < t <= r + W), masked off over block 0's fake previous block; one SDPA; reshape and cut the padding.
    # HINT 3: Block 0's previous block is padding: leave it visible and the zero keys join the softmax.
    pad = n * window - s
    q, k, v = (F.pad(t, (0, 0, 0, pad)).view(b, h, n, window, d) for t in (q, k, v))  # [b, h, n, W, d]

    def with_previous_block(t):  # [b, h, n, W, d] -> [b, h, n, 2W, d]; block -1 is zeros
        return torch.cat([F.pad(t, (0, 0, 0, 0, 1, 0))[:, :, :-1], t], dim=3)

    r = torch.arange(window, device=q.device)[:, None]  # query offset in its block
    t = torch.arange(2 * window, device=q.device)[None, :]  # key offset from the previous block's start
    band = (t > r) & (t <= r + window)  # key position - query position in (-W, 0]
    mask = band.expand(n, window, 2 * window).clone()
    mask[0, :, :window] = False  # block 0 has no previous block
    q, k, v = (x.flatten(0, 1) for x in (q, with_previous_block(k), with_previous_block(v)))  # [b*h, n, W or 2W, d]
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [b*h, n, W, d], mask [n, W, 2W] broadcast
    return context.reshape(b, h, n * window, d)[:, :, :s]
    ### END SOLUTION


class SlidingWindowAttention(nn.Module):
    """CoreAttention with a sliding window: q [s, b, np, hn], k/v [s, b, ng, hn] -> context [s, b, np * hn].

    Blocked (linear in s) when it saves work and there is no attention dropout; masked SDPA otherwise.
    """

    def __init__(self, config: TransformerConfig, window_size: int):
        super().__init__()
        _check_window(window_size)
        self.window_size, self.attention_dropout = window_size, config.attention_dropout

    def extra_repr(self) -> str:
        return f"window_size={self.window_size}, attention_dropout={self.attention_dropout}"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        s, b, np_, hn = query.shape
        if key.shape[2] != np_:  # GQA: each key/value head serves np/ng query heads (as in CoreAttention)
            key = key.repeat_interleave(np_ // key.shape[2], dim=2)
            value = value.repeat_interleave(np_ // value.shape[2], dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, hn]
        dropout_p = self.attention_dropout if self.training else 0.0
        if dropout_p == 0.0 and s > 2 * self.window_size:
            context = blocked_sliding_window_attention(q, k, v, self.window_size)
        else:
            context = masked_sliding_window_attention(q, k, v, self.window_size, dropout_p)
        return context.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)


def sliding_window_spec(window_size: int, spec: LayerSpec | None = None) -> LayerSpec:
    """`spec` (default: chapter 02's) with SlidingWindowAttention as its core attention."""
    _check_window(window_size)
    return replace(spec or LayerSpec(), core_attention=partial(SlidingWindowAttention, window_size=window_size))
