"""Megatron's GPT dataset: fixed-length training samples cut from a stream of shuffled documents.

Three small index arrays, built once from the document lengths, turn "sample i" into a few slices of the .bin:

    document_index  the documents in visiting order: every document once per epoch, shuffled      [epochs * docs]
                    e.g. [2, 0, 1 | 1, 2, 0]
    stream          their tokens end to end:  d2 d2 d2 d2 | d0 d0 | d1 d1 d1 d1 d1 | d1 ...
    sample_index    where sample j starts in that stream, as (position in document_index, offset),
                    every seq_length tokens; sample j is the seq_length + 1 tokens from entry j
                    to entry j + 1 inclusive (the extra token gives the last label)           [samples + 1, 2]
    shuffle_index   a permutation of the samples: item i of the dataset is sample shuffle_index[i]  [samples]

    item i ─► j = shuffle_index[i] ─► sample_index[j], sample_index[j + 1] ─► tokens from 1-3 documents
          ─► {"tokens": text[:-1], "labels": text[1:], "loss_mask", "position_ids"}   each [seq_length]
             (+ "cu_seqlens" [n + 1] with reset_attention_mask: where the sample's documents start)

Samples run across document boundaries (the <|endoftext|> token between them tells the model, or, with Megatron's
reset_position_ids / reset_attention_mask, positions restart and attention stops there: a packed sample,
megalab/core/packed_seq_params.py; `collate_packed` batches them for GPTModel(..., packed_seq_params=)); enough epochs are
visited to provide `num_samples`, and a short final epoch is shuffled on its own so its documents do not all
crowd into the last few samples (`separate_final_epoch`). All shuffles come from one `numpy.random.RandomState(seed)`,
so every rank builds identical indices.

Megatron-LM: `megatron/core/datasets/gpt_dataset.py` (`GPTDataset`, `_build_document_sample_shuffle_indices`,
`_build_document_index`, `_build_shuffle_index`, `_get_ltor_masks_and_position_ids`) and `helpers.cpp`
(`build_sample_idx`): the same algorithm and the same random stream (Megatron also caches the arrays on disk).
"""

import numpy as np
import torch

from megalab.core.datasets.indexed_dataset import IndexedDataset
from megalab.core.packed_seq_params import position_ids_from_cu_seqlens

_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80  # Megatron's: a final epoch with < 80% of an epoch's samples is shuffled apart


def get_num_epochs(num_tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """The fewest epochs whose tokens cover num_samples * seq_length + 1 (the +1: the last sample's last label)."""
    num_epochs, num_tokens = 1, num_tokens_per_epoch
    while num_tokens < num_samples * seq_length + 1:
        num_epochs += 1
        num_tokens += num_tokens_per_epoch
    return num_epochs


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """`documents` repeated num_epochs times and shuffled (the last epoch apart when separate_final_epoch)."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)  # [num_epochs * len(documents)]
        rng.shuffle(document_index)
        return document_index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """[num_samples + 1, 2] int64: row j = (position in document_index, token offset) where sample j starts.

    Sample j covers the seq_length + 1 tokens from row j to row j + 1 inclusive, so consecutive samples share one
    token: the last label of sample j is the first input of sample j + 1. Row j + 1 is the document (and offset)
    holding the stream token (j + 1) * seq_length, found by walking the documents from row j.
    """
    sample_index = np.zeros((num_samples + 1, 2), dtype=np.int64)
    # EXERCISE data.build_sample_index: walk the documents in document_index, one row per seq_length tokens
    ### BEGIN SOLUTION
    # HINT 1: The idea. A sample reads seq_length + 1 tokens (its inputs and one more label); the next sample starts
    #         AT that last token, so row j is the (document, offset) of stream token j * seq_length.
    # HINT 2: The approach. Walk with a (position in document_index, offset) pair. For each new row, count down
    #         seq_length + 1 tokens through the documents, using what is LEFT of the current one (its size minus the
    #         offset): if it holds the last token, the offset moves to that token; else go to the next document at 0.
    # HINT 3: A pitfall. Documents may be empty or shorter than a sample: one sample can cross several of them.
    doc_pos, doc_offset = 0, 0  # row 0: the first document, offset 0
    for j in range(1, num_samples + 1):
        remaining = seq_length + 1  # tokens sample j - 1 still needs, its extra label token included
        while remaining != 0:
            doc_length = int(sizes[document_index[doc_pos]]) - doc_offset
            remaining -= doc_length
            if remaining <= 0:  # this document holds the sample's last token
                doc_offset += remaining + doc_length - 1  # the next sample starts AT that token
                remaining = 0
            else:
                doc_pos, doc_offset = doc_pos + 1, 0
        sample_index[j] = doc_pos, doc_offset
    ### END SOLUTION
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A shuffled arange(num_samples), then a separately shuffled arange(num_samples, total_size)."""
    first = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=np.int64)
    rng.shuffle(last)
    return np.concatenate((first, last))


def cu_seqlens_from_eod(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[n + 1] int32: the sample's documents, each ending with (and including) an <|endoftext|> token.

    Megatron's reset_attention_mask cuts the causal mask after every eod (attention_mask[i+1:, :i+1] = 0);
    these are the same boundaries in the cu_seqlens form that PackedSeqParams and the varlen kernels take."""
    seq_length = tokens.numel()
    ends = (tokens == eod).nonzero().flatten() + 1
    ends = ends[ends < seq_length]  # an eod at the very end closes the last document anyway
    return torch.cat([torch.zeros(1, dtype=ends.dtype), ends, torch.tensor([seq_length])]).to(torch.int32)


def get_ltor_masks_and_position_ids(tokens: torch.Tensor, eod: int, reset_position_ids: bool, eod_mask_loss: bool):
    """loss_mask [s] float (0 on <|endoftext|> inputs if eod_mask_loss), position_ids [s] (restart after each
    <|endoftext|> if reset_position_ids). The causal attention mask itself is implicit (Megatron's default)."""
    seq_length = tokens.numel()
    loss_mask = torch.ones(seq_length, dtype=torch.float)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    if reset_position_ids:
        return loss_mask, position_ids_from_cu_seqlens(cu_seqlens_from_eod(tokens, eod))
    return loss_mask, torch.arange(seq_length, dtype=torch.long)


class GPTDataset(torch.utils.data.Dataset):
    """`num_samples` samples of `seq_length` tokens from `indexed_dataset`; item i is a dict of [seq_length] tensors.

    documents: the document ids this split uses (all by default; see `get_split_ranges`).
    eod: the end-of-document token id (`Tokenizer.eod`), for eod_mask_loss / reset_position_ids / reset_attention_mask.
    reset_attention_mask: items also carry "cu_seqlens", the sample's document boundaries (a packed sample).
    """

    def __init__(self, indexed_dataset: IndexedDataset, seq_length: int, num_samples: int, seed: int, eod: int,
                 documents: np.ndarray | None = None, reset_position_ids: bool = False, eod_mask_loss: bool = False,
                 reset_attention_mask: bool = False):
        if not np.array_equal(indexed_dataset.document_indices, np.arange(len(indexed_dataset) + 1)):
            raise ValueError(f"{indexed_dataset.path_prefix}: GPTDataset needs one sequence per document; "
                             "preprocess without sentence splitting")
        self.dataset, self.seq_length, self.num_samples, self.seed, self.eod = indexed_dataset, seq_length, num_samples, seed, eod
        self.reset_position_ids, self.eod_mask_loss = reset_position_ids, eod_mask_loss
        self.reset_attention_mask = reset_attention_mask
        self.documents = np.arange(len(indexed_dataset)) if documents is None else np.asarray(documents)
        if len(self.documents) == 0 or seq_length < 1 or num_samples < 1:
            raise ValueError(f"need documents, seq_length >= 1 and num_samples >= 1 (got {len(self.documents)} documents, "
                             f"seq_length={seq_length}, num_samples={num_samples})")
        self.document_index, self.sample_index, self.shuffle_index = self._build_indices()

    def _build_indices(self):
        """Megatron's `_build_document_sample_shuffle_indices`, without the on-disk cache."""
        sizes = self.dataset.sequence_lengths
        num_tokens_per_epoch = int(sizes[self.documents].astype(np.int64).sum())
        if num_tokens_per_epoch < 2:
            raise ValueError(f"{self.dataset.path_prefix}: {num_tokens_per_epoch} tokens, too few for any sample")
        num_epochs = get_num_epochs(num_tokens_per_epoch, self.seq_length, self.num_samples)
        separate_final_epoch = False
        if num_epochs > 1:
            num_samples_sans_final_epoch = ((num_epochs - 1) * num_tokens_per_epoch - 1) // self.seq_length
            num_samples_per_epoch = (num_tokens_per_epoch - 1) // self.seq_length
            num_samples_from_final_epoch = self.num_samples - num_samples_sans_final_epoch
            separate_final_epoch = num_samples_from_final_epoch < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * num_samples_per_epoch)
        rng = np.random.RandomState(self.seed)
        document_index = build_document_index(self.documents, num_epochs, rng, separate_final_epoch)
        num_samples_total = (num_epochs * num_tokens_per_epoch - 1) // self.seq_length  # every full sample available
        sample_index = build_sample_index(sizes, document_index, self.seq_length, num_samples_total)
        first = num_samples_sans_final_epoch if separate_final_epoch else num_samples_total
        shuffle_index = build_shuffle_index(first, num_samples_total, rng)
        return document_index, sample_index, shuffle_index

    def __len__(self) -> int:
        return self.num_samples

    def get_text(self, idx: int) -> np.ndarray:
        """The seq_length + 1 token ids of item `idx` (inputs and the labels shifted by one)."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range ({self.num_samples} samples)")
        j = self.shuffle_index[idx]
        (beg, beg_offset), (end, end_offset) = self.sample_index[j], self.sample_index[j + 1]
        if beg == end:
            return self.dataset.get(self.document_index[beg], beg_offset, end_offset - beg_offset + 1)
        parts = [self.dataset.get(self.document_index[beg], beg_offset)]
        parts += [self.dataset.get(self.document_index[k]) for k in range(beg + 1, end)]
        parts.append(self.dataset.get(self.document_index[end], 0, end_offset + 1))
        return np.concatenate(parts)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        text = torch.from_numpy(self.get_text(idx).astype(np.int64))  # [seq_length + 1]
        tokens, labels = text[:-1].contiguous(), text[1:].contiguous()  # [seq_length] each
        loss_mask, position_ids = get_ltor_masks_and_position_ids(tokens, self.eod, self.reset_position_ids, self.eod_mask_loss)
        item = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if self.reset_attention_mask:
            item["cu_seqlens"] = cu_seqlens_from_eod(tokens, self.eod)  # [n + 1], varies per sample
        return item


def get_split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Megatron's `--split "969,30,1"`: contiguous document ranges for train/valid/test, in proportion."""
    weights = [float(w) for w in split.replace("/", ",").split(",")]
    if not weights or any(w < 0 for w in weights) or sum(weights) == 0:
        raise ValueError(f"split {split!r}: give non-negative weights like '969,30,1' (train,valid,test)")
    weights += [0.0] * (3 - len(weights))
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / sum(weights) * num_documents)))
    bounds = [0] + [b - (bounds[-1] - num_documents) for b in bounds[1:]]  # rounding slack off every bound
    return list(zip(bounds[:-1], bounds[1:]))
