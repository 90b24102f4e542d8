"""Context parallelism against full-sequence attention (SDPA) and the single-process GPT.

Single-process tests check the pieces (zigzag split, block mask, LSE merge, block backward);
one 4-rank torchrun launch runs every multi-rank case for cp=2 (tp=1, dp=2), cp=4 and
cp x tp = 2 x 2, and the tests below read its results.
"""

import traceback

import pytest
import torch
import torch.nn.functional as F

from megalab import calc, launch
from megalab import context_parallel as cpm
from megalab import parallel_state as ps
from megalab.config import TransformerConfig
from megalab.model import GPTModel, TransformerLayer
from megalab.model.recompute import SavedTensorsMeter
from megalab.tensor_parallel import full_shard_of, tensor_parallel_layer_spec
from tests.test_tensor_parallel import _diff

TOL = 1e-5  # fp32, every output and gradient
SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
             hidden_dropout=0.0, attention_dropout=0.0)
GPT_VARIANTS = {
    "gpt": dict(),
    "llama-gqa": dict(normalization="RMSNorm", activation_func="silu", gated_linear_unit=True, add_bias_linear=False,
                      position_embedding_type="rope", num_query_groups=2, share_embeddings_and_output_weights=False),
}
B, NP, NG, HN = 2, 4, 2, 8  # attention tests: GQA, 2 query heads per key/value group


def _sdpa(q, k, v):
    """Reference causal attention on the full sequence: q [b, np, s, hn], k/v [b, ng, s, hn]."""
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)


def _qkv(s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, NP, s, HN, generator=g), torch.randn(B, NG, s, HN, generator=g),
            torch.randn(B, NG, s, HN, generator=g), torch.randn(B, NP, s, HN, generator=g))


# ------------------------------------------------------------------ single process
@pytest.mark.exercise("cp.zigzag_split")
def test_zigzag_split_balances_causal_work():
    assert cpm.cp_rank_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cpm.cp_rank_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cpm.cp_rank_positions(8, 2, 1, zigzag=False).tolist() == [4, 5, 6, 7]
    for cp in (1, 2, 3, 4):
        s = 4 * cp
        for zigzag in (True, False):
            positions = [cpm.cp_rank_positions(s, cp, r, zigzag) for r in range(cp)]
            assert sorted(torch.cat(positions).tolist()) == list(range(s))  # a partition of the sequence
            # causal work of a rank = number of (query, key) pairs with key <= query, counted densely
            work = [int((p + 1).sum()) for p in positions]
            if zigzag:
                assert len(set(work)) == 1, (cp, work)
            elif cp > 1:
                assert work == sorted(work) and work[0] < work[-1]


def test_bad_sequence_length_names_the_rule():
    with pytest.raises(ValueError, match=r"not divisible by 2 \* context_parallel_size = 8"):
        cpm.check_seq_length(12, 4)
    with pytest.raises(ValueError, match="2\\*cp equal chunks"):
        cpm.get_batch_on_this_cp_rank({"tokens": torch.zeros(1, 10, dtype=torch.long)}, 2, 0)


@pytest.mark.exercise("cp.zigzag_split")
def test_get_batch_on_this_cp_rank_slices_every_tensor():
    ids = torch.arange(16).view(2, 8)
    batch = cpm.get_batch_on_this_cp_rank({"tokens": ids, "labels": ids + 100}, 2, 0)
    assert batch["tokens"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert batch["labels"].tolist() == [[100, 101, 106, 107], [108, 109, 114, 115]]
    assert batch["position_ids"].tolist() == [[0, 1, 6, 7]] * 2


@pytest.mark.exercise("cp.causal_block_mask")
def test_causal_block_mask_matches_dense_causal_mask():
    c, chunks = 3, 6
    dense = torch.ones(c * chunks, c * chunks, dtype=torch.bool).triu(1)  # True: key after query
    for i in range(chunks):
        for j in range(chunks):
            block = dense[i * c:(i + 1) * c, j * c:(j + 1) * c]
            expected = "skip" if block.all() else "full" if not block.any() else "causal"
            assert cpm.causal_block_mask(i, j) == expected, (i, j)
            if expected == "causal":
                assert torch.equal(block, torch.ones(c, c, dtype=torch.bool).triu(1))


@pytest.mark.exercise("cp.lse_merge")
def test_lse_merge_equals_attention_over_all_keys():
    q, k, v, _ = _qkv(12)
    visible = torch.ones(12, 12, dtype=torch.bool).tril()[8:]  # queries 8..11 vs keys 0..11
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    full = F.scaled_dot_product_attention(q[:, :, 8:], kk, vv, attn_mask=visible)
    ref_lse = torch.logsumexp((q[:, :, 8:] @ kk.transpose(-1, -2) / HN**0.5).masked_fill(~visible, float("-inf")), -1)
    parts = [(k[:, :, :5], v[:, :, :5], None), (k[:, :, 5:8], v[:, :, 5:8], None),
             (k[:, :, 8:], v[:, :, 8:], torch.ones(4, 4, dtype=torch.bool).triu(1))]
    out, lse = torch.zeros(B, NP, 4, HN), torch.full((B, NP, 4), float("-inf"))  # nothing seen yet
    for part in parts:
        out, lse = cpm.merge_attention(out, lse, *cpm.block_attention(q[:, :, 8:], *part))
    assert _diff(out, full) < TOL
    assert _diff(lse, ref_lse) < TOL


def test_block_backward_equals_autograd():
    q, k, v, dout = _qkv(6, seed=1)
    mask = torch.ones(6, 6, dtype=torch.bool).triu(1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = cpm.block_attention(*leaves, mask)
    out.backward(dout)
    grads = cpm.block_attention_backward(q, k, v, out.detach(), lse.detach(), dout, mask)
    assert max(_diff(g, leaf.grad) for g, leaf in zip(grads, leaves)) < TOL


def test_formulas():
    # ring: cp-1 K/V blocks forward; cp-1 K/V + cp dK/dV backward; all-gather: cp-1 each way
    block = 2 * 2 * (64 // 4) * 2 * 8 * 4
    assert calc.context_parallel_communication_per_layer(64, 2, 2, 8, 4) == dict(
        forward=3 * block, backward=7 * block, total=10 * block)
    assert calc.context_parallel_communication_per_layer(64, 2, 2, 8, 4, "all_gather")["total"] == 6 * block
    assert calc.context_parallel_communication_per_layer(64, 2, 2, 8, 1)["total"] == 0
    # ring: q, out [b, np, s/cp, hn], k, v [b, ng, s/cp, hn], lse [b, np, s/cp] fp32; all-gather: k, v of all s, mask
    assert calc.context_parallel_attention_memory(64, 2, 4, 2, 8, 4) == 4 * (2 * 2 * 16 * 4 * 8 + 2 * 2 * 16 * 2 * 8 + 2 * 4 * 16)
    assert calc.context_parallel_attention_memory(64, 2, 4, 2, 8, 4, "all_gather") == (
        4 * (2 * 2 * 16 * 4 * 8 + 2 * 2 * 64 * 2 * 8 + 2 * 4 * 16) + 16 * 64)
    with pytest.raises(ValueError, match="variant"):
        calc.context_parallel_attention_memory(8, 1, 2, 2, 4, 2, "ring")


# ------------------------------------------------------------------ multi-rank, run inside the ranks
def _ring(state):
    group = state.get_context_parallel_group()
    mine = torch.full((3,), float(state.get_context_parallel_rank()))
    buffer, requests = cpm.ring_step(mine, group)
    for r in requests:
        r.wait()
    cp = state.get_context_parallel_world_size()
    return {"received": buffer.tolist(), "expected": [float((state.get_context_parallel_rank() - 1) % cp)] * 3}


def _attention(state):
    """Ring and all-gather attention (plain and zigzag split) vs SDPA on the full sequence; work, bytes, memory."""
    from megalab.comm_tracer import CollectiveTracer

    group, cp, rank = state.get_context_parallel_group(), state.get_context_parallel_world_size(), \
        state.get_context_parallel_rank()
    s = 8 * cp
    q, k, v, dout = _qkv(s, seed=7)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _sdpa(*leaves)
    ref.backward(dout)
    out = {}
    for variant in ("p2p", "all_gather"):
        for zigzag in (True, False):
            pos = cpm.cp_rank_positions(s, cp, rank, zigzag)
            local = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
            work = cpm.AttentionWork()
            with CollectiveTracer() as trace, SavedTensorsMeter() as meter:
                y = cpm.context_parallel_attention(*local, group, zigzag, variant, work)
            r = out[(variant, zigzag)] = dict(
                forward_diff=_diff(y, ref[:, :, pos]), blocks=work.blocks, flops=work.flops,
                bytes_forward=trace.wire_bytes,
                formula=calc.context_parallel_communication_per_layer(s, B, NG, HN, cp, variant),
                saved=meter.bytes, saved_formula=calc.context_parallel_attention_memory(s, B, NP, NG, HN, cp, variant))
            try:  # backward separately: the forward's numbers stand without it
                with CollectiveTracer() as trace_bwd:
                    y.backward(dout[:, :, pos])
                r["grad_diff"] = max(_diff(t.grad, leaf.grad[:, :, pos]) for t, leaf in zip(local, leaves))
                r["bytes_backward"] = trace_bwd.wire_bytes
            except NotImplementedError:
                r["backward_error"] = traceback.format_exc(limit=-2)
    return out


def _layer_memory(state):
    """Bytes one CP transformer layer keeps per rank (fp32), sequence 32."""
    config = TransformerConfig(**{**SMALL, "num_layers": 1, "seq_length": 32})
    cp = state.get_context_parallel_world_size()
    layer = TransformerLayer(config, tensor_parallel_layer_spec(state.get_tensor_model_parallel_group(),
                                                                    cpm.ContextParallelAttention))
    x = torch.randn(32 // cp, 2, config.hidden_size, requires_grad=True)
    with SavedTensorsMeter(exclude=layer.parameters()) as meter:
        layer(x)
    return meter.bytes


def _gpt(state):
    """ContextParallelGPTModel (zigzag, both variants) vs GPTModel: per-token loss and every gradient."""
    cp, rank = state.get_context_parallel_world_size(), state.get_context_parallel_rank()
    tp_group, tp_rank = state.get_tensor_model_parallel_group(), state.get_tensor_model_parallel_rank()
    out = {}
    for name, change in GPT_VARIANTS.items():
        for variant in ("p2p", "all_gather"):
            config = TransformerConfig(**{**SMALL, **change})
            torch.manual_seed(0)
            ref = GPTModel(config)
            torch.manual_seed(0)
            model = cpm.ContextParallelGPTModel(config, tp_group, state.get_context_parallel_group(), variant=variant)
            ids = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(3))
            labels = torch.roll(ids, -1, 1)
            ref_loss = ref(ids, labels=labels)
            ref_loss.mean().backward()
            batch = cpm.get_batch_on_this_cp_rank(dict(tokens=ids, labels=labels), cp, rank)
            loss = model(batch["tokens"], batch["position_ids"], batch["labels"])  # [b, s/cp]
            (loss.sum() / ids.numel()).backward()  # local sum over the tokens of the whole batch
            cpm.finalize_context_parallel_grads(model, state)
            pos = batch["position_ids"][0]
            worst = _diff(loss, ref_loss[:, pos])
            ref_params, names = dict(ref.named_parameters()), set()
            for pname, p in model.named_parameters():
                q, stride = ref_params[pname], 2 if config.gated_linear_unit and "linear_fc1" in pname else 1
                names.add(pname)
                worst = max(worst, _diff(p.grad, full_shard_of(q.grad, p, tp_rank, stride)))
            out[f"{name} {variant}"] = worst if names == set(ref_params) else float("inf")
    return out


CASES = {"ring": _ring, "attention": _attention, "layer_memory": _layer_memory, "gpt": _gpt}


def _worker(layouts):
    from megalab import dist as mdist

    mdist.init()
    results = {}
    for cp, tp in layouts:
        state = ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        for name, case in CASES.items():
            try:
                results[((cp, tp), name)] = case(state)
            except Exception:
                results[((cp, tp), name)] = {"error": traceback.format_exc(limit=-3)}
        ps.destroy_model_parallel()
    torch.distributed.barrier()
    return results


LAYOUTS = [(2, 1), (4, 1), (2, 2)]


@pytest.fixture(scope="module")
def runs():
    """{(cp, tp): {case: {rank: result}}} from one 4-rank launch."""
    res = launch.run_function(_worker, 4, LAYOUTS, launch=dict(timeout=300))
    out = {}
    for rank, results in res.returns.items():
        for (layout, name), value in results.items():
            out.setdefault(layout, {}).setdefault(name, {})[rank] = value
    return out


def _results(runs, case):
    for layout in LAYOUTS:
        for rank, result in runs[layout][case].items():
            assert not (isinstance(result, dict) and "error" in result), result["error"]
            yield layout, rank, result


@pytest.mark.exercise("cp.ring_step")
def test_ring_step_receives_from_the_previous_rank(runs):
    for layout, rank, result in _results(runs, "ring"):
        assert result["received"] == result["expected"], (layout, rank)


@pytest.mark.exercise("cp.zigzag_split")
@pytest.mark.exercise("cp.lse_merge")
@pytest.mark.exercise("cp.causal_block_mask")
@pytest.mark.exercise("cp.ring_step")
@pytest.mark.exercise("cp.backward_ring")
def test_ring_and_all_gather_attention_equal_sdpa_forward_and_backward(runs):
    for layout, rank, result in _results(runs, "attention"):
        for key, r in result.items():
            assert "backward_error" not in r, r["backward_error"]
            assert max(r["forward_diff"], r["grad_diff"]) < TOL, (layout, rank, key, r)


@pytest.mark.exercise("cp.zigzag_split")
@pytest.mark.exercise("cp.causal_block_mask")
@pytest.mark.exercise("cp.lse_merge")
@pytest.mark.exercise("cp.ring_step")
def test_zigzag_balances_counted_work_plain_split_does_not(runs):
    list(_results(runs, "attention"))  # no rank failed
    for cp in (2, 4):
        by_rank = runs[(cp, 1)]["attention"]
        zigzag = [by_rank[r][("p2p", True)]["flops"] for r in sorted(by_rank)]
        plain = [by_rank[r][("p2p", False)]["flops"] for r in sorted(by_rank)]
        assert max(zigzag) == min(zigzag)  # exactly even: cp + 1/2 ... every rank the same block pairs
        assert max(plain) / min(plain) >= 3  # the last rank of a plain split does 3x (cp=2) .. 5x (cp=4) more
        assert sum(zigzag) == sum(plain)  # the same total work


@pytest.mark.exercise("cp.ring_step")
@pytest.mark.exercise("cp.backward_ring")
def test_bytes_moved_equal_the_formula(runs):
    for layout, _, result in _results(runs, "attention"):
        for (variant, _), r in result.items():
            assert r["bytes_forward"] == r["formula"]["forward"], (layout, variant, r)
            assert "backward_error" not in r, r["backward_error"]
            assert r["bytes_backward"] == r["formula"]["backward"], (layout, variant, r)


@pytest.mark.exercise("cp.ring_step")
def test_saved_activation_bytes_equal_the_formula(runs):
    for layout, _, result in _results(runs, "attention"):
        for key, r in result.items():
            assert r["saved"] == r["saved_formula"], (layout, key, r)
    # a whole layer keeps per-token activations only: 1/cp of the sequence's, per rank
    assert runs[(2, 1)]["layer_memory"][0] == 2 * runs[(4, 1)]["layer_memory"][0]


@pytest.mark.exercise("cp.backward_ring")
def test_context_parallel_gpt_equals_single_process(runs):
    for layout, rank, result in _results(runs, "gpt"):
        assert len(result) == 2 * len(GPT_VARIANTS)
        for key, worst in result.items():
            assert worst < TOL, (layout, rank, key, worst)


def test_attention_without_dropout_only():
    with pytest.raises(ValueError, match="set attention_dropout=0.0"):
        cpm.ContextParallelAttention(TransformerConfig(**{**SMALL, "attention_dropout": 0.1}))
