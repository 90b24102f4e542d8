"""Sequence packing: documents back to back in one row, kept apart by `cu_seqlens` boundaries.

Padding each document to the longest wastes every padded position's compute; packing puts them
end to end and tells the model where each one starts (cumulative lengths, the flash-attn varlen
and Megatron `PackedSeqParams` convention):

    docs   [a a a] [b b] [c c c c]        padded:  a a a _    packed:  a a a b b c c c c
    cu_seqlens = [0, 3, 5, 9]                      b b _ _    position_ids 0 1 2 0 1 0 1 2 3
                                                   c c c c    attention: block-diagonal, causal in each block

Two things keep the documents apart, so the packed loss equals the per-document loss:
positions restart at 0 in every document (learned position embeddings and RoPE), and a token
attends only to the earlier tokens of its own document (`document_causal_mask`).

Megatron's "thd" format is one stream of T tokens (input_ids [1, T]). Here a batch [b, s] is read
row by row as T = b * s tokens, so b > 1 is allowed when every row starts a document
(GPTDataset samples with reset_attention_mask, one per row).

Megatron-LM: `PackedSeqParams` (megatron/core/packed_seq_params.py) passed as `packed_seq_params=`
from GPTModel.forward down to the core attention (TEDotProductAttention -> flash/cuDNN varlen
kernels); RoPE restarts per document in `_apply_rotary_pos_emb_thd` (rope_utils.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

QKV_FORMATS = ("thd",)


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int | None = None) -> None:
    """cu_seqlens must be a 1-D integer tensor 0 = c_0 < c_1 < ... < c_n (= total, when given)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [0, ..., total] of n_documents + 1 entries, "
                         f"got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and strictly increase (every document has a token), got {bounds}")
    if total is not None and bounds[-1] != total:
        raise ValueError(f"cu_seqlens must end at the number of packed tokens, {total}; got {bounds[-1]} "
                         f"(cu_seqlens={bounds})")


@dataclass
class PackedSeqParams:
    """Where the packed documents start and end (Megatron's names). Self-attention: q and kv alike.

    cu_seqlens_q/kv  [n + 1] int32   0, end of doc 0, end of doc 1, ..., T
    max_seqlen_q/kv  int             the longest document (flash_attn_varlen_func sizes its grid by it)
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    qkv_format: str = "thd"
    _masks: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # attention_mask's cache

    def __post_init__(self):
        if self.qkv_format not in QKV_FORMATS:
            raise ValueError(f"qkv_format must be one of {QKV_FORMATS} (tokens of the batch read row by row), got "
                             f"{self.qkv_format!r}; a padded [s, b] batch needs no PackedSeqParams")
        if self.cu_seqlens_kv is None:
            self.cu_seqlens_kv = self.cu_seqlens_q
        for name in ("q", "kv"):
            cu = getattr(self, f"cu_seqlens_{name}")
            check_cu_seqlens(cu)
            if getattr(self, f"max_seqlen_{name}") is None:
                setattr(self, f"max_seqlen_{name}", int((cu[1:] - cu[:-1]).max()))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor) -> PackedSeqParams:
        """Self-attention over packed documents: the same boundaries for queries and keys."""
        return cls(cu_seqlens_q=cu_seqlens.to(torch.int32))

    def check_batch(self, input_ids: torch.Tensor) -> None:
        """input_ids [b, s]: the boundaries cover all b * s tokens and every row starts a document."""
        b, s = input_ids.shape
        if not torch.equal(self.cu_seqlens_q.cpu(), self.cu_seqlens_kv.cpu()):
            raise ValueError("self-attention over packed documents needs cu_seqlens_kv == cu_seqlens_q")
        check_cu_seqlens(self.cu_seqlens_q, total=b * s)
        row_starts = set(range(0, b * s, s))
        if not row_starts <= set(self.cu_seqlens_q.tolist()):
            raise ValueError(f"each of the {b} rows of {s} tokens must start a document: put {sorted(row_starts)} "
                             "in cu_seqlens, or pack the documents into one row [1, T]")

    def attention_mask(self, b: int, s: int, device: torch.device) -> torch.Tensor:
        """[b, 1, s, s] bool for SDPA: each row's document-causal mask (rows never see each other), built once
        per batch and shared by every layer."""
        key = (b, s, str(device))
        if key not in self._masks:
            bounds = self.cu_seqlens_q.tolist()
            rows = [torch.tensor([c - r * s for c in bounds if r * s <= c <= (r + 1) * s], device=device)
                    for r in range(b)]
            self._masks[key] = torch.stack([document_causal_mask(cu) for cu in rows])[:, None]
        return self._masks[key]

    def position_ids(self, shape: torch.Size) -> torch.Tensor:
        """[b, s] positions restarting at 0 in every document."""
        return position_ids_from_cu_seqlens(self.cu_seqlens_q).view(shape)


def packed_position_ids(input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                        params: PackedSeqParams) -> torch.Tensor:
    """Check a packed batch input_ids [b, s] against params; its position ids: the given ones, or
    restarting at 0 in every document."""
    params.check_batch(input_ids)
    return params.position_ids(input_ids.shape).to(input_ids.device) if position_ids is None else position_ids


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] int64: 0, 1, ... within every document (Megatron's reset_position_ids)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)  # [T] start of each token's document
    return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts


def pack_documents(docs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1-D token tensors -> (tokens [1, T], position_ids [1, T] restarting at 0 per document, cu_seqlens [n+1]),
    all on the documents' device."""
    if not docs or any(d.dim() != 1 or d.numel() == 0 for d in docs):
        raise ValueError("pack_documents needs a non-empty list of non-empty 1-D token tensors")
    cu_seqlens = F.pad(torch.tensor([d.numel() for d in docs], device=docs[0].device).cumsum(0), (1, 0)).to(torch.int32)
    return torch.cat(list(docs))[None], position_ids_from_cu_seqlens(cu_seqlens)[None], cu_seqlens


def pack_batch(docs: Sequence[torch.Tensor], row_length: int) -> dict:
    """Training rows from documents of n + 1 tokens each (inputs, and labels shifted by one): the documents in
    order, greedily into rows of row_length inputs; a row's unused tail is one padding document (loss_mask 0).

    Returns {"tokens", "labels", "loss_mask", "position_ids"} [b, row_length] and "packed_seq_params"."""
    if not docs or any(d.dim() != 1 or not 2 <= d.numel() <= row_length + 1 for d in docs):
        raise ValueError(f"pack_batch needs 1-D documents of 2 .. row_length + 1 = {row_length + 1} tokens; "
                         "cut longer ones")
    rows, used = [[]], 0
    for d in docs:
        if used + d.numel() - 1 > row_length:
            rows, used = rows + [[]], 0
        rows[-1].append(d)
        used += d.numel() - 1
    inputs, labels, masks = [], [], []
    for row in rows:
        free = row_length - sum(d.numel() - 1 for d in row)
        pieces = row + ([torch.zeros(free + 1, dtype=row[0].dtype, device=row[0].device)] if free else [])  # padding
        inputs += [d[:-1] for d in pieces]
        labels += [d[1:] for d in pieces]
        masks += [torch.full((d.numel() - 1,), float(i < len(row)), device=d.device) for i, d in enumerate(pieces)]
    tokens, position_ids, cu_seqlens = pack_documents(inputs)
    shape = (len(rows), row_length)
    return dict(tokens=tokens.view(shape), labels=torch.cat(labels).view(shape), loss_mask=torch.cat(masks).view(shape),
                position_ids=position_ids.view(shape), packed_seq_params=PackedSeqParams.from_cu_seqlens(cu_seqlens))


def document_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T, T] bool, True where query i may attend key j: same document (by cu_seqlens) and j <= i."""
    total = int(cu_seqlens[-1])
    # EXERCISE packed_seq.document_causal_mask: document id of every token, then same-document AND causal
    ### BEGIN SOLUTION
    # HINT 1: Token i may attend token j only if both belong to the same document AND j <= i: the
    #         causal mask cut into blocks along the diagonal, one per document.
    # HINT 2: Give every position its document index from cu_seqlens (torch.bucketize against the
    #         ends cu_seqlens[1:], with right=True so a document's first token is not counted in the previous one),
    #         compare the indices pairwise, and AND with a lower-triangular (tril) mask.
    # HINT 3: The boundaries: check the first token of each document, and a document of one token.
    positions = torch.arange(total, device=cu_seqlens.device)
    doc = torch.bucketize(positions, cu_seqlens[1:], right=True)  # [T] document index
    same = doc[:, None] == doc[None, :]
    causal = torch.ones(total, total, dtype=torch.bool, device=cu_seqlens.device).tril()
    return same & causal
    ### END SOLUTION


def document_slices(params: PackedSeqParams) -> list[slice]:
    """One slice of the T packed tokens per document."""
    bounds = params.cu_seqlens_q.tolist()
    return [slice(a, e) for a, e in zip(bounds[:-1], bounds[1:])]


def collate_packed(samples: list[dict]) -> dict:
    """GPTDataset items with "cu_seqlens" (reset_attention_mask) -> one batch: every other key stacked to [b, s],
    and "packed_seq_params" whose boundaries run over the b * s tokens row by row. A DataLoader collate_fn."""
    s = samples[0]["tokens"].numel()
    batch = {key: torch.stack([x[key] for x in samples]) for key in samples[0] if key != "cu_seqlens"}
    starts = [x["cu_seqlens"][:-1].long() + r * s for r, x in enumerate(samples)]  # each row's documents, shifted
    end = torch.tensor([len(samples) * s], device=starts[0].device)
    batch["packed_seq_params"] = PackedSeqParams.from_cu_seqlens(torch.cat([*starts, end]))
    return batch
