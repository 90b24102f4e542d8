"""Sequence packing (megalab/core/packed_seq_params.py) through the real models, against each document run alone.

- helpers: boundaries and per-document positions of pack_documents; the document-causal mask against a loop over
  the documents and against Megatron's reset_attention_mask rule (cut the causal mask after every eod);
- models: a packed GPT and a packed LLaMA (RoPE, GQA, untied) give the per-token loss and the gradients of the
  documents run one by one, on every attention path (SDPA with the mask, unfused document by document), with
  recompute, and with several packed rows; RoPE and learned positions restart per document;
- data: GPTDataset's reset_position_ids / reset_attention_mask / eod_mask_loss give the right cu_seqlens, and a
  collated packed batch trains like its documents alone;
- tensor parallel (2 ranks): the packed TP model equals the packed single-device model; context parallel refuses;
- bad boundaries and unsupported paths give clear errors.
"""

import dataclasses
import traceback

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megalab.core.datasets.gpt_dataset import GPTDataset, cu_seqlens_from_eod
from megalab.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megalab.core.inference.text_generation_controllers.text_generation_controller import CachedAttention
from megalab.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.packed_seq_params import (
    PackedSeqParams,
    collate_packed,
    document_causal_mask,
    pack_batch,
    pack_documents,
    packed_position_ids,
)
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.extras.presets import llama_config
from megalab.kernels import flash_attn_available
from megalab.lab import launch
from tests.feedback import close, equal, require

DOC_LENGTHS = [(5,), (3, 1, 4), (1, 1), (7, 2, 6, 3)]
SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
             hidden_dropout=0.0, attention_dropout=0.0)
MODELS = {
    "gpt": TransformerConfig(**SMALL),
    "llama-gqa": llama_config(**SMALL, num_query_groups=2, ffn_hidden_size=48),
}


def _mask_by_loops(lengths):
    total = sum(lengths)
    mask = torch.zeros(total, total, dtype=torch.bool)
    start = 0
    for n in lengths:
        for i in range(n):
            mask[start + i, start:start + i + 1] = True
        start += n
    return mask


def _docs(lengths, vocab=64, seed=0):
    """Documents of lengths + 1 tokens: inputs d[:-1], labels d[1:]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n + 1,), generator=g) for n in lengths]


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _packed_vs_alone(config, docs, train=False):
    """(packed per-token loss, per-document losses concatenated, their gradients) from one model."""
    torch.manual_seed(0)
    model = GPTModel(config).train(train)
    tokens, _, cu_seqlens = pack_documents([d[:-1] for d in docs])
    labels, _, _ = pack_documents([d[1:] for d in docs])
    packed = model(tokens, labels=labels, packed_seq_params=PackedSeqParams.from_cu_seqlens(cu_seqlens))
    packed.sum().backward()
    packed_grads = _grads(model)
    model.zero_grad()
    alone = torch.cat([model(d[None, :-1], labels=d[None, 1:]) for d in docs], dim=1)
    alone.sum().backward()
    return packed, alone, packed_grads, _grads(model)


# ------------------------------------------------------------------ helpers
def test_pack_documents_positions_and_boundaries():
    docs = [torch.arange(3) + 10, torch.arange(2) + 20, torch.arange(4) + 30]
    tokens, position_ids, cu_seqlens = pack_documents(docs)
    assert tokens.tolist() == [[10, 11, 12, 20, 21, 30, 31, 32, 33]]
    assert position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert cu_seqlens.tolist() == [0, 3, 5, 9] and cu_seqlens.dtype == torch.int32
    params = PackedSeqParams.from_cu_seqlens(cu_seqlens)
    assert params.max_seqlen_q == params.max_seqlen_kv == 4 and params.qkv_format == "thd"
    assert torch.equal(packed_position_ids(tokens, None, params), position_ids)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        pack_documents([torch.arange(3), torch.zeros(0)])


def _require_mask(got, expected, where):
    """The mask's shape, then the first (query, key) it gets wrong, in words."""
    require(equal(tuple(got.shape), tuple(expected.shape), f"the shape of {where}"))
    wrong = (got.bool() != expected.bool()).nonzero().tolist()
    assert not wrong, (f"{where}: {len(wrong)} (query, key) entries wrong; the first, query {wrong[0][0]} key "
                       f"{wrong[0][1]}, is {bool(got[tuple(wrong[0])])}, expected {bool(expected[tuple(wrong[0])])} "
                       "(True: may attend; same document and key <= query)")


@pytest.mark.exercise("packed_seq.document_causal_mask")
def test_document_causal_mask_names_the_mistake():
    lengths = [3, 1, 4]  # cu_seqlens [0, 3, 4, 8]; a one-token document in the middle
    _, _, cu_seqlens = pack_documents([torch.zeros(n, dtype=torch.long) for n in lengths])
    positions = torch.arange(8)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    doc_shifted = torch.bucketize(positions, cu_seqlens[1:])  # a document's first token in the previous one
    same = _mask_by_loops(lengths) | _mask_by_loops(lengths).T
    require(close(document_causal_mask(cu_seqlens).int(), _mask_by_loops(lengths).int(),
                  "document_causal_mask(cu_seqlens [0, 3, 4, 8]) (1: query i may attend key j)", rtol=0, atol=0, mistakes={
                      "a plain causal mask: queries attend across documents": causal.int(),
                      "no causal part: queries see later tokens of their document": same.int(),
                      "each document's first token counted in the previous document (bucketize needs right=True)":
                          ((doc_shifted[:, None] == doc_shifted[None, :]) & causal).int(),
                      "the upper triangle: queries see later keys instead of earlier ones": (same & ~causal.tril(-1)).int(),
                  }))


@pytest.mark.exercise("packed_seq.document_causal_mask")
@pytest.mark.parametrize("lengths", DOC_LENGTHS, ids=lambda ls: "-".join(map(str, ls)))
def test_document_causal_mask_matches_per_document_loops(lengths):
    _, _, cu_seqlens = pack_documents([torch.zeros(n, dtype=torch.long) for n in lengths])
    _require_mask(document_causal_mask(cu_seqlens), _mask_by_loops(lengths),
                  f"document_causal_mask(cu_seqlens {cu_seqlens.tolist()})")


@pytest.mark.exercise("packed_seq.document_causal_mask")
def test_document_mask_attention_equals_each_document_alone():
    lengths = [4, 1, 6, 3]
    _, _, cu_seqlens = pack_documents([torch.zeros(n, dtype=torch.long) for n in lengths])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, sum(lengths), 8, generator=g) for _ in range(3))
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(cu_seqlens))
    alone = [F.scaled_dot_product_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], is_causal=True)
             for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    require(close(masked, torch.cat(alone, dim=2), f"SDPA with document_causal_mask over documents of {lengths} tokens "
                                                   "vs causal SDPA on each document alone"))


@pytest.mark.exercise("packed_seq.document_causal_mask")
@pytest.mark.parametrize("tokens", [[5, 0, 7, 8, 0, 9], [0, 0, 3, 4], [1, 2, 3, 0], [4, 5, 6]])
def test_eod_boundaries_give_megatrons_reset_attention_mask(tokens):
    tokens = torch.tensor(tokens)
    s = tokens.numel()
    megatron = torch.ones(s, s).tril()  # Megatron's rule: causal, then cut after every eod
    for i in (tokens == 0).nonzero().flatten().tolist():
        megatron[i + 1:, :i + 1] = 0
    cu_seqlens = cu_seqlens_from_eod(tokens, eod=0)
    assert cu_seqlens[0] == 0 and cu_seqlens[-1] == s, (
        f"cu_seqlens_from_eod({tokens.tolist()}) is {cu_seqlens.tolist()}: it should start at 0 and end at {s}")
    _require_mask(document_causal_mask(cu_seqlens), megatron.bool(),
                  f"document_causal_mask for tokens {tokens.tolist()} (eod 0; cu_seqlens {cu_seqlens.tolist()}) vs "
                  "Megatron's reset_attention_mask")


# ------------------------------------------------------------------ the models
@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
@pytest.mark.parametrize("name", list(MODELS))
def test_packed_model_equals_documents_alone(name, backend):
    config = dataclasses.replace(MODELS[name], attention_backend=backend)
    packed, alone, packed_grads, alone_grads = _packed_vs_alone(config, _docs([5, 9, 1, 12, 3]))
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    assert packed.shape == (1, 30)  # 30 tokens: longer than seq_length=16, fine since positions restart
    for key in alone_grads:
        torch.testing.assert_close(packed_grads[key], alone_grads[key], atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("recompute", [dict(recompute_granularity="selective"),
                                       dict(recompute_granularity="full", recompute_method="uniform",
                                            recompute_num_layers=1)], ids=["selective", "full"])
def test_packed_model_with_recompute(recompute):
    config = dataclasses.replace(MODELS["llama-gqa"], **recompute)
    packed, alone, packed_grads, alone_grads = _packed_vs_alone(config, _docs([4, 7, 2]), train=True)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    for key in alone_grads:
        torch.testing.assert_close(packed_grads[key], alone_grads[key], atol=1e-5, rtol=1e-4, msg=key)


def test_positions_restart_for_rope_and_learned_embeddings():
    lengths = [3, 5, 2]
    cu_seqlens = torch.tensor([0, 3, 8, 10])
    params = PackedSeqParams.from_cu_seqlens(cu_seqlens)
    rope = RotaryEmbedding(kv_channels=8)
    angles = rope(10, params)  # [s, b, 1, d]
    assert angles.shape == (10, 1, 1, 8)
    expected = torch.cat([rope(n)[:, 0] for n in lengths])  # each document's angles from position 0
    torch.testing.assert_close(angles[:, 0], expected)
    # two rows of 5: row 0 = [3, 2 of doc 1], row 1 needs a document start at 5
    two_rows = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 3, 5, 8, 10]))
    assert packed_position_ids(torch.zeros(2, 5), None, two_rows).tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 0, 1]]
    torch.testing.assert_close(rope(5, two_rows)[:, 1], rope(5, two_rows)[:, 0])
    # learned absolute positions: position 3 of a document is embedding row 3, wherever the document sits
    torch.manual_seed(0)
    model = GPTModel(TransformerConfig(**SMALL))
    seen = []
    model.embedding.position_embeddings.register_forward_hook(lambda m, args, out: seen.append(args[0].clone()))
    tokens, position_ids, cu = pack_documents([torch.arange(n) for n in lengths])
    model(tokens, packed_seq_params=PackedSeqParams.from_cu_seqlens(cu))
    assert torch.equal(seen[0], position_ids)


def test_several_packed_rows_equal_one_row():
    docs = _docs([4, 3, 5, 2])  # rows of 7: [4 + 3], [5 + 2]
    torch.manual_seed(0)
    model = GPTModel(MODELS["llama-gqa"])
    inputs, _, cu = pack_documents([d[:-1] for d in docs])
    labels = pack_documents([d[1:] for d in docs])[0]
    one_row = model(inputs, labels=labels, packed_seq_params=PackedSeqParams.from_cu_seqlens(cu))
    two_rows = model(inputs.view(2, 7), labels=labels.view(2, 7), packed_seq_params=PackedSeqParams.from_cu_seqlens(cu))
    torch.testing.assert_close(two_rows.view(1, 14), one_row, atol=1e-6, rtol=1e-5)


def test_pack_batch_rows_train_like_their_documents():
    docs = _docs([5, 9, 3, 12, 7, 4, 6])  # rows of 16 inputs: [5 + 9 + pad 2], [3 + 12 + pad 1], [7 + 4 + pad 5], ...
    rows = pack_batch(docs, 16)
    assert rows["tokens"].shape == (4, 16) and rows["packed_seq_params"].cu_seqlens_q.tolist() == [
        0, 5, 14, 16, 19, 31, 32, 39, 43, 48, 54, 64]
    assert rows["loss_mask"].sum() == 46 and rows["loss_mask"][0].tolist() == [1.0] * 14 + [0.0] * 2
    torch.manual_seed(0)
    model = GPTModel(MODELS["llama-gqa"])
    packed = model(rows["tokens"], labels=rows["labels"], packed_seq_params=rows["packed_seq_params"])
    alone = torch.cat([model(d[None, :-1], labels=d[None, 1:])[0] for d in docs])
    torch.testing.assert_close(packed[rows["loss_mask"].bool()], alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cut longer ones"):
        pack_batch([torch.arange(18)], 16)


# ------------------------------------------------------------------ the dataset side
def _dataset(tmp_path, lengths, eod=0, **flags):
    """An indexed dataset of documents 1..n-1 followed by eod (as preprocess --append-eod writes them)."""
    builder = IndexedDatasetBuilder(tmp_path / "docs", dtype=np.int32)
    rng = np.random.default_rng(0)
    for n in lengths:
        builder.add_item(np.append(rng.integers(1, 60, n - 1), eod))
        builder.end_document()
    builder.finalize()
    return GPTDataset(IndexedDataset(tmp_path / "docs"), seq_length=16, num_samples=6, seed=1, eod=eod, **flags)


def test_gpt_dataset_flags_give_cu_seqlens(tmp_path):
    gpt = _dataset(tmp_path, [5, 9, 3, 12, 7, 4, 6], reset_position_ids=True, reset_attention_mask=True,
                   eod_mask_loss=True)
    for i in range(len(gpt)):
        item = gpt[i]
        tokens, cu = item["tokens"], item["cu_seqlens"].tolist()
        ends = [j + 1 for j in range(16) if tokens[j] == 0 and j + 1 < 16]
        assert cu == [0, *ends, 16], (i, tokens.tolist(), cu)  # each document ends with its eod
        for a, b in zip(cu[:-1], cu[1:]):
            assert item["position_ids"][a:b].tolist() == list(range(b - a))
        assert item["loss_mask"].tolist() == [float(t != 0) for t in tokens.tolist()]
    (tmp_path / "plain").mkdir()
    assert "cu_seqlens" not in _dataset(tmp_path / "plain", [5, 9, 3, 12, 7, 4, 6])[0]


def test_collated_gpt_dataset_batch_trains_like_its_documents(tmp_path):
    gpt = _dataset(tmp_path, [5, 9, 3, 12, 7, 4, 6], reset_position_ids=True, reset_attention_mask=True,
                   eod_mask_loss=True)
    batch = collate_packed([gpt[i] for i in range(3)])  # [3, 16] and the boundaries of the 48 tokens
    params = batch["packed_seq_params"]
    assert batch["tokens"].shape == (3, 16) and params.cu_seqlens_q[-1] == 48
    torch.manual_seed(0)
    model = GPTModel(MODELS["gpt"])
    packed = model(batch["tokens"], batch["position_ids"], batch["labels"], packed_seq_params=params).flatten()
    tokens, labels = batch["tokens"].flatten(), batch["labels"].flatten()
    bounds = params.cu_seqlens_q.tolist()
    alone = torch.cat([model(tokens[None, a:b], labels=labels[None, a:b])[0] for a, b in zip(bounds[:-1], bounds[1:])])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    mask = batch["loss_mask"].flatten()
    torch.testing.assert_close((packed * mask).sum() / mask.sum(), (alone * mask).sum() / mask.sum())


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("cu_seqlens, message", [
    ([0, 3, 3, 9], "strictly increase"),
    ([0, 5, 3, 9], "strictly increase"),
    ([1, 3, 9], "start at 0"),
    ([[0, 9]], "1-D integer"),
    ([0.0, 9.0], "1-D integer"),
])
def test_bad_cu_seqlens_are_refused(cu_seqlens, message):
    with pytest.raises(ValueError, match=message):
        PackedSeqParams(cu_seqlens_q=torch.tensor(cu_seqlens))


def test_packed_batch_must_match_its_boundaries():
    model = GPTModel(MODELS["gpt"])
    tokens = torch.zeros(1, 9, dtype=torch.long)
    with pytest.raises(ValueError, match="end at the number of packed tokens, 9; got 8"):
        model(tokens, packed_seq_params=PackedSeqParams.from_cu_seqlens(torch.tensor([0, 3, 8])))
    with pytest.raises(ValueError, match="must start a document"):
        model(tokens.view(1, 9)[:, :8].reshape(2, 4), packed_seq_params=PackedSeqParams.from_cu_seqlens(torch.tensor([0, 3, 8])))
    with pytest.raises(ValueError, match="cu_seqlens_kv == cu_seqlens_q"):
        model(tokens, packed_seq_params=PackedSeqParams(torch.tensor([0, 9]), torch.tensor([0, 4, 9])))
    with pytest.raises(ValueError, match="qkv_format"):
        PackedSeqParams(torch.tensor([0, 9]), qkv_format="sbhd")
    with pytest.raises(ValueError, match="longer than config.seq_length"):  # one document past the positions
        model(torch.zeros(1, 20, dtype=torch.long), packed_seq_params=PackedSeqParams.from_cu_seqlens(torch.tensor([0, 20])))


def test_unsupported_paths_say_so():
    params = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="Triton kernels take no document boundaries"):
        GPTModel(dataclasses.replace(MODELS["gpt"], attention_backend="triton"))(
            torch.zeros(1, 4, dtype=torch.long), packed_seq_params=params)
    q = torch.zeros(4, 1, 2, 8)
    with pytest.raises(ValueError, match="KV-cache inference"):
        CachedAttention(0, cache=None, segments=[])(q, q, q, params)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["sdpa", "flash_attn"])
def test_packed_model_on_gpu(backend):
    if backend == "flash_attn" and not flash_attn_available():
        pytest.skip("flash-attn is not installed")
    config = dataclasses.replace(MODELS["llama-gqa"], attention_backend=backend)
    torch.manual_seed(0)
    model = GPTModel(config).cuda().to(torch.bfloat16)
    docs = [d.cuda() for d in _docs([30, 70, 5, 40])]
    tokens, _, cu = pack_documents([d[:-1] for d in docs])
    labels = pack_documents([d[1:] for d in docs])[0]
    packed = model(tokens, labels=labels, packed_seq_params=PackedSeqParams.from_cu_seqlens(cu))
    alone = torch.cat([model(d[None, :-1], labels=d[None, 1:]) for d in docs], dim=1)
    torch.testing.assert_close(packed, alone, atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------ parallel models (2 ranks)
def _parallel_worker():
    from megalab.core import parallel_state as ps
    from megalab.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
    from megalab.core.models.gpt.gpt_layer_specs import context_parallel_layer_spec, tensor_parallel_layer_spec
    from megalab.core.models.gpt.gpt_model import GPTModel
    from megalab.core.tensor_parallel import layers as tp
    from megalab.lab import dist as mdist

    rank, _ = mdist.init()
    docs = _docs([5, 9, 1, 12, 3])
    tokens, _, cu = pack_documents([d[:-1] for d in docs])
    labels = pack_documents([d[1:] for d in docs])[0]
    params = PackedSeqParams.from_cu_seqlens(cu)
    out = {}
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    for name, config in MODELS.items():
        for sp in (False, True):
            try:
                torch.manual_seed(0)
                ref = GPTModel(config)
                torch.manual_seed(0)
                model = GPTModel(dataclasses.replace(config, sequence_parallel=sp), tensor_parallel_layer_spec())
                ref_loss, loss = (m(tokens, labels=labels, packed_seq_params=params) for m in (ref, model))
                ref_loss.sum().backward()
                loss.sum().backward()
                allreduce_sequence_parallel_grads(model)
                ref_params = dict(ref.named_parameters())
                worst = (loss - ref_loss).abs().max().item()
                for key, p in model.named_parameters():
                    stride = 2 if config.gated_linear_unit and "linear_fc1" in key else 1
                    worst = max(worst, (p.grad - tp.full_shard_of(ref_params[key].grad, p, rank, stride)).abs().max().item())
                out[f"tp {name} sp={sp}"] = worst
            except Exception:
                out[f"tp {name} sp={sp}"] = traceback.format_exc(limit=-3)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=2)
    try:
        GPTModel(MODELS["gpt"], context_parallel_layer_spec())(tokens[:, :16], packed_seq_params=params)
        out["cp"] = "no error"
    except ValueError as e:
        out["cp"] = str(e)
    ps.destroy_model_parallel()
    torch.distributed.barrier()
    return out


def test_packed_tensor_parallel_equals_single_device_and_cp_refuses():
    result = launch.run_function(_parallel_worker, 2, launch=dict(timeout=300))
    for rank, out in result.returns.items():
        assert "context parallelism here takes whole sequences" in out.pop("cp"), (rank, out)
        for case, worst in out.items():
            assert isinstance(worst, float) and worst < 1e-5, (rank, case, worst)


def test_custom_core_attention_without_packing_support_says_so():
    from megalab.extras.sliding_window import sliding_window_spec

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, seq_length=8,
                               hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = GPTModel(config, spec=sliding_window_spec(4))
    tokens = torch.randint(0, 32, (1, 8))
    model(tokens)  # unpacked: the three-tensor signature is enough
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 3, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="SlidingWindowAttention .* takes no packed_seq_params"):
        model(tokens, packed_seq_params=packed)
