"""Megatron's indexed dataset: token ids in a flat `.bin`, where each sequence starts in a small `.idx`.

A tokenized corpus is far bigger than memory, so Megatron stores it as two files that are memory-mapped, never loaded:

    prefix.bin   the token ids of every sequence, back to back, in one dtype (uint16 when the vocab fits)
                 [ seq 0 ........ | seq 1 .... | seq 2 .............. | ... ]

    prefix.idx   (all integers little-endian)
        offset  size                 field
        0       9                    magic  b"MMIDIDX\\x00\\x00"
        9       8    uint64          version = 1
        17      1    uint8           dtype code of the .bin (DType below: 1 uint8 ... 8 uint16)
        18      8    uint64          S = sequence count
        26      8    uint64          D = document count + 1  (length of document_indices)
        34      4*S  int32[S]        sequence_lengths, in tokens
        ..      8*S  int64[S]        sequence_pointers, byte offset of each sequence in the .bin
        ..      8*D  int64[D]        document_indices: [0, end of doc 0, end of doc 1, ...] in sequences

A document is a run of sequences (sentences, when preprocessing splits them; for GPT a whole document is one
sequence). Reading sequence i is one `numpy.frombuffer` on the mapped .bin: no parsing, O(1) random access.

Writing is all-or-nothing here: `IndexedDatasetBuilder` writes `prefix.bin.tmpPID` and `prefix.idx.tmpPID` and renames
them only in `finalize`; any error before that deletes them, so a crash never leaves a half-written dataset behind.

Megatron-LM: `megatron/core/datasets/indexed_dataset.py` (`_INDEX_HEADER`, `DType`, `_IndexWriter`, `_IndexReader`,
`IndexedDataset`, `IndexedDatasetBuilder`): same names, same bytes, so files written here read there and back.
"""

import os
import struct
from enum import Enum
from pathlib import Path

import numpy as np

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count = 34


class DType(Enum):
    """The numpy dtype of the .bin, as the one-byte code stored in the .idx (Megatron's codes)."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype) -> int:
        return cls[np.dtype(dtype).name].value

    @classmethod
    def dtype_from_code(cls, code: int) -> type:
        return getattr(np, cls(code).name)

    @staticmethod
    def optimal_dtype(cardinality: int | None) -> type:
        """uint16 when every token id fits (vocab < 65500, Megatron's threshold), else int32."""
        return np.uint16 if cardinality is not None and cardinality < 65500 else np.int32


class DataFormatError(ValueError):
    """An input or dataset file is malformed; the message names the file (and line) and what to do."""


def data_file_path(prefix: str | Path) -> str:
    return f"{prefix}.bin"


def index_file_path(prefix: str | Path) -> str:
    return f"{prefix}.idx"


class _IndexWriter:
    """Writes the .idx layout in the module docstring."""

    def __init__(self, idx_path: str | Path, dtype: type):
        self.idx_path, self.dtype = idx_path, dtype

    def write(self, sequence_lengths: list[int], document_indices: list[int]) -> None:
        lengths = np.asarray(sequence_lengths, dtype=np.int32)  # [S]
        itemsize = np.dtype(self.dtype).itemsize
        pointers = np.zeros(len(lengths), dtype=np.int64)  # [S] byte offset of each sequence
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
        with open(self.idx_path, "wb") as f:
            f.write(_INDEX_HEADER)
            f.write(struct.pack("<Q", _VERSION))
            f.write(struct.pack("<B", DType.code_from_dtype(self.dtype)))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(document_indices)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(document_indices, dtype=np.int64).tobytes(order="C"))


class _IndexReader:
    """Memory-maps a .idx and checks it: magic, version, dtype code and that its size matches its counts."""

    def __init__(self, idx_path: str | Path):
        self.idx_path = str(idx_path)
        if not os.path.isfile(self.idx_path):
            raise FileNotFoundError(f"{self.idx_path}: no index file; build the dataset with `python -m megalab.tools.preprocess_data`")
        size = os.path.getsize(self.idx_path)
        with open(self.idx_path, "rb") as f:
            head = f.read(_HEADER_BYTES)
        if head[:9] == _INDEX_HEADER and len(head) < _HEADER_BYTES:
            raise DataFormatError(f"{self.idx_path}: truncated, {size} bytes, shorter than the {_HEADER_BYTES}-byte header; "
                                  "re-run preprocessing")
        if head[:9] != _INDEX_HEADER:
            raise DataFormatError(
                f"{self.idx_path}: not a Megatron index file (magic {head[:9]!r}, expected {_INDEX_HEADER!r}); "
                "re-run preprocessing to rebuild it")
        version, code, self.sequence_count, self.document_count = struct.unpack("<QBQQ", head[9:])
        if version != _VERSION:
            raise DataFormatError(f"{self.idx_path}: index version {version}, only version {_VERSION} is supported")
        try:
            self.dtype = DType.dtype_from_code(code)
        except ValueError:
            raise DataFormatError(f"{self.idx_path}: unknown dtype code {code} (valid: 1..8); the file is corrupt, rebuild it") from None
        expected = _HEADER_BYTES + 12 * self.sequence_count + 8 * self.document_count
        if size < expected:
            raise DataFormatError(
                f"{self.idx_path}: truncated, {size} bytes but its header promises {expected}; re-run preprocessing")
        buffer = np.memmap(self.idx_path, mode="r", dtype=np.uint8)
        offset, S, D = _HEADER_BYTES, self.sequence_count, self.document_count
        self.sequence_lengths = np.frombuffer(buffer, np.int32, S, offset)  # [S]
        self.sequence_pointers = np.frombuffer(buffer, np.int64, S, offset + 4 * S)  # [S]
        self.document_indices = np.frombuffer(buffer, np.int64, D, offset + 12 * S)  # [D]
        self._check(np.dtype(self.dtype).itemsize)

    def _check(self, itemsize: int) -> None:
        """What Megatron's reader asserts, and what would make later reads silently wrong: document
        boundaries from 0 to the sequence count, never decreasing; no negative length; each sequence
        starting where the one before it ends."""
        docs, S = self.document_indices, self.sequence_count
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != S or np.any(np.diff(docs) < 0):
            first, last = (int(docs[0]), int(docs[-1])) if len(docs) else (None, None)
            raise DataFormatError(
                f"{self.idx_path}: document_indices must run from 0 to the sequence count {S} without going "
                f"down (first {first}, last {last}, {len(docs)} entries); the index is corrupt, re-run preprocessing")
        if np.any(self.sequence_lengths < 0):
            bad = int(np.flatnonzero(self.sequence_lengths < 0)[0])
            raise DataFormatError(f"{self.idx_path}: sequence {bad} has a negative length "
                                  f"{int(self.sequence_lengths[bad])}; the index is corrupt, re-run preprocessing")
        starts = np.concatenate([[0], np.cumsum(self.sequence_lengths[:-1], dtype=np.int64)]) * itemsize if S else []
        if S and not np.array_equal(self.sequence_pointers, starts):
            bad = int(np.flatnonzero(self.sequence_pointers != starts)[0])
            raise DataFormatError(
                f"{self.idx_path}: sequence {bad} starts at byte {int(self.sequence_pointers[bad])} but the sequences "
                f"before it end at byte {int(starts[bad])}; the index is corrupt, re-run preprocessing")


class IndexedDataset:
    """Read-only view of `prefix.bin` + `prefix.idx`; item i is sequence i as a numpy array (a view of the mmap)."""

    def __init__(self, path_prefix: str | Path):
        self.path_prefix = str(path_prefix)
        self.index = _IndexReader(index_file_path(path_prefix))
        bin_path = data_file_path(path_prefix)
        if not os.path.isfile(bin_path):
            raise FileNotFoundError(f"{bin_path}: data file missing next to its index; re-run preprocessing")
        itemsize = np.dtype(self.index.dtype).itemsize
        expected = int(self.index.sequence_lengths.astype(np.int64).sum()) * itemsize
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise DataFormatError(
                f"{bin_path}: {actual} bytes but {index_file_path(path_prefix)} describes {expected} "
                f"({'truncated' if actual < expected else 'extra bytes'}); re-run preprocessing")
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if expected else np.zeros(0, np.uint8)

    @property
    def dtype(self) -> type:
        return self.index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    def __len__(self) -> int:
        return self.index.sequence_count

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        """ds[i] (negative counts from the end) is sequence i; ds[a:b] the list of sequences a..b-1, as in
        Megatron (contiguous slices only)."""
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices of an IndexedDataset must be contiguous (step 1), got step {step}")
            return [self.get(i) for i in range(start, stop)]
        return self.get(idx)

    def _sequence(self, idx) -> int:
        if isinstance(idx, bool) or not isinstance(idx, (int, np.integer)):
            raise TypeError(f"an IndexedDataset takes an integer or a slice, not {type(idx).__name__} ({idx!r})")
        i = int(idx) + len(self) if idx < 0 else int(idx)
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {int(idx)} out of range for {self.path_prefix} ({len(self)} sequences)")
        return i

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `idx` (negative: from the end; to its end when
        length is None)."""
        idx = self._sequence(idx)
        seq_length = int(self.index.sequence_lengths[idx])
        if length is None:
            length = seq_length - offset
        if offset < 0 or length < 0 or offset + length > seq_length:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {idx} of length {seq_length}")
        pointer = int(self.index.sequence_pointers[idx]) + offset * np.dtype(self.dtype).itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=pointer)


class IndexedDatasetBuilder:
    """Append sequences and document boundaries, then `finalize` writes the .idx and publishes both files.

        with IndexedDatasetBuilder(prefix, dtype=np.uint16) as builder:
            builder.add_document(ids, lengths=[len(ids)])
            builder.finalize()
    """

    def __init__(self, path_prefix: str | Path, dtype: type = np.int32):
        self.path_prefix, self.dtype = str(path_prefix), dtype
        self._bin_tmp = f"{data_file_path(path_prefix)}.tmp{os.getpid()}"  # per process: ranks may build side by side
        self._idx_tmp = f"{index_file_path(path_prefix)}.tmp{os.getpid()}"
        self._bin = open(self._bin_tmp, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens) -> None:
        """One sequence (a 1-D array, list or tensor of token ids)."""
        array = np.asarray(tokens, dtype=self.dtype)
        if array.ndim != 1:
            raise ValueError(f"a sequence is 1-D, got shape {array.shape}")
        self._bin.write(array.tobytes(order="C"))
        self.sequence_lengths.append(len(array))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths: list[int]) -> None:
        """A document of several sequences laid end to end in `tokens`, their lengths in `lengths`."""
        array = np.asarray(tokens, dtype=self.dtype)
        if sum(lengths) != len(array):
            raise ValueError(f"sequence lengths sum to {sum(lengths)}, but the document has {len(array)} tokens")
        self._bin.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.end_document()

    def finalize(self) -> None:
        self._bin.close()
        _IndexWriter(self._idx_tmp, self.dtype).write(self.sequence_lengths, self.document_indices)
        os.replace(self._bin_tmp, data_file_path(self.path_prefix))
        os.replace(self._idx_tmp, index_file_path(self.path_prefix))

    def abort(self) -> None:
        """Close and delete the temporary files: nothing half-written is left."""
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or os.path.exists(self._bin_tmp):
            self.abort()  # an error, or left without finalize()
