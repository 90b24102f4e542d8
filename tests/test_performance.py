"""megalab/profiling.py: profiler traces and their summary, comm/compute overlap read from a trace,
sequence packing (cu_seqlens, document-causal mask, varlen attention == each document alone)."""

import json

import pytest
import torch
import torch.nn.functional as F

from megalab import launch
from megalab.profiling import (
    document_causal_mask,
    overlap_from_trace,
    pack_documents,
    profile_ddp_step,
    profile_step,
    top_ops,
    varlen_attention,
)

DOC_LENGTHS = [(5,), (3, 1, 4), (1, 1), (7, 2, 6, 3)]


def _mask_by_loops(lengths):
    total = sum(lengths)
    mask = torch.zeros(total, total, dtype=torch.bool)
    start = 0
    for n in lengths:
        for i in range(n):
            mask[start + i, start:start + i + 1] = True
        start += n
    return mask


def test_pack_documents_positions_and_boundaries():
    docs = [torch.arange(3) + 10, torch.arange(2) + 20, torch.arange(4) + 30]
    tokens, position_ids, cu_seqlens = pack_documents(docs)
    assert tokens.tolist() == [[10, 11, 12, 20, 21, 30, 31, 32, 33]]
    assert position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert cu_seqlens.tolist() == [0, 3, 5, 9]
    with pytest.raises(ValueError, match="non-empty 1-D"):
        pack_documents([torch.arange(3), torch.zeros(0)])


@pytest.mark.exercise("profiling.document_causal_mask")
@pytest.mark.parametrize("lengths", DOC_LENGTHS, ids=lambda ls: "-".join(map(str, ls)))
def test_document_causal_mask_matches_per_document_loops(lengths):
    _, _, cu_seqlens = pack_documents([torch.zeros(n, dtype=torch.long) for n in lengths])
    assert torch.equal(document_causal_mask(cu_seqlens), _mask_by_loops(lengths))


@pytest.mark.exercise("profiling.document_causal_mask")
def test_document_mask_attention_equals_each_document_alone():
    lengths = [4, 1, 6, 3]
    _, _, cu_seqlens = pack_documents([torch.zeros(n, dtype=torch.long) for n in lengths])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, sum(lengths), 8, generator=g) for _ in range(3))
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(cu_seqlens))
    alone = [F.scaled_dot_product_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], is_causal=True)
             for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    torch.testing.assert_close(masked, torch.cat(alone, dim=2))
    torch.testing.assert_close(varlen_attention(q, k, v, cu_seqlens), masked)


def test_overlap_from_trace_counts_merged_intervals():
    events = [dict(ph="X", name="gloo:all_reduce", ts=0, dur=10), dict(ph="X", name="gloo:all_reduce", ts=5, dur=10),
              dict(ph="X", name="MmBackward0", ts=12, dur=8), dict(ph="X", name="MmBackward0", ts=30, dur=5),
              dict(ph="i", name="gloo:all_reduce", ts=40)]
    out = overlap_from_trace(events, comm=lambda n: "all_reduce" in n, compute=lambda n: n.endswith("Backward0"))
    # comm [0, 15] = 15 us, compute [12, 20] + [30, 35] = 13 us, overlap [12, 15] = 3 us
    assert out == pytest.approx(dict(comm_ms=0.015, compute_ms=0.013, overlap_ms=0.003, overlap_share=0.2))


def test_profile_step_writes_chrome_trace_and_ranks_ops(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(128, 64)
    prof = profile_step(lambda: model(x).square().mean().backward(), steps=2, trace_path=tmp_path / "trace.json")
    names = {e["name"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]}
    assert {"aten::addmm", "aten::mm"} <= names
    rows = top_ops(prof, n=5)
    assert len(rows) == 5 and rows[0]["self_ms"] >= rows[-1]["self_ms"]
    assert {r["name"] for r in rows} & {"aten::addmm", "aten::mm"}  # the matmuls dominate
    addmm = next(r for r in top_ops(prof, n=100) if r["name"] == "aten::addmm")
    assert addmm["calls"] == 2 * 2  # two Linear forwards per step, two recorded steps


def test_ddp_trace_shows_bucket_all_reduce_overlapping_backward(tmp_path):
    result = launch.run_function(profile_ddp_step, 2, str(tmp_path), launch=dict(timeout=120))
    for rank, runs in result.returns.items():
        assert runs["overlapped"]["comm_ms"] > 0 and runs["overlapped"]["overlap_ms"] > 0, (rank, runs)
        assert runs["serial"]["comm_ms"] > 0 and runs["serial"]["overlap_ms"] == 0, (rank, runs)  # after backward
    assert (tmp_path / "ddp_overlapped_rank1.json").exists()
