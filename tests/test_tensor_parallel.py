"""Tensor and sequence parallelism against single-device math and PyTorch's DTensor TP.

One torchrun launch per world size (2 and 4 ranks) runs every case; each case returns its
worst difference or its error, and the tests below read them (so a missing exercise fails
only the checks that need it).
"""

import traceback

import pytest
import torch
import torch.nn.functional as F

from megalab import calc, launch
from megalab import parallel_state as ps
from megalab import tensor_parallel as tp
from megalab.config import TransformerConfig
from megalab.model import GPTModel, Linear, TransformerLayer, init_method_normal

TOL = 1e-5
SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=8, vocab_size=64, seq_length=8,
             hidden_dropout=0.0, attention_dropout=0.0)
GPT_VARIANTS = {
    "gpt": dict(),
    "gpt-untied-unfused": dict(share_embeddings_and_output_weights=False, attention_backend="unfused"),
    "llama-gqa": dict(normalization="RMSNorm", activation_func="silu", gated_linear_unit=True, add_bias_linear=False,
                      position_embedding_type="rope", num_query_groups=4, share_embeddings_and_output_weights=False),
}


# ------------------------------------------------------------------ helpers run inside the ranks
def _rank_tensor(r, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + r))


def _diff(a, b):
    if a.shape != b.shape:
        return float("inf")
    return (a.detach().float() - b.detach().float()).abs().max().item() if a.numel() else 0.0


def _mappings(t, rank, group):
    x = _rank_tensor(rank, 8, 2, 4).requires_grad_()
    xs = [_rank_tensor(r, 8, 2, 4) for r in range(t)]
    g = _rank_tensor(50 + rank, 8, 2, 4)
    gs = [_rank_tensor(50 + r, 8, 2, 4) for r in range(t)]
    full = _rank_tensor(7, 8, 2, 4 * t).requires_grad_()  # the same on every rank
    gfull = [_rank_tensor(60 + r, 8, 2, 4 * t) for r in range(t)]
    full_seq = _rank_tensor(8, 8 * t, 2, 4).requires_grad_()
    out = {}

    def check(name, mapping, leaf, expected_y, grad, expected_grad):
        """One mapping forward and backward; an error (a missing exercise) is recorded, not raised."""
        leaf.grad = None
        try:
            y = mapping(leaf, group=group)
            y.backward(grad)
            out[name] = max(_diff(y, expected_y), _diff(leaf.grad, expected_grad))
        except Exception:
            out[name] = traceback.format_exc(limit=-2)

    check("copy_to", tp.copy_to_tensor_model_parallel_region, x, x, g, sum(gs))
    check("reduce_from", tp.reduce_from_tensor_model_parallel_region, x, sum(xs), g, g)
    check("scatter_to", tp.scatter_to_tensor_model_parallel_region, full, full[..., rank * 4:(rank + 1) * 4],
          g, torch.cat(gs, -1))
    check("gather_from", tp.gather_from_tensor_model_parallel_region, x, torch.cat(xs, -1),
          gfull[rank], gfull[rank][..., rank * 4:(rank + 1) * 4])
    check("sp scatter_to", tp.scatter_to_sequence_parallel_region, full_seq, full_seq[rank * 8:(rank + 1) * 8],
          g, torch.cat(gs, 0))
    gseq = [_rank_tensor(70 + r, 8 * t, 2, 4) for r in range(t)]
    check("sp gather_from", tp.gather_from_sequence_parallel_region, x, torch.cat(xs, 0),
          gseq[rank], sum(gseq)[rank * 8:(rank + 1) * 8])
    xl = _rank_tensor(rank, 8 * t, 2, 4).requires_grad_()
    xls = [_rank_tensor(r, 8 * t, 2, 4) for r in range(t)]
    check("sp reduce_scatter", tp.reduce_scatter_to_sequence_parallel_region, xl,
          sum(xls)[rank * 8:(rank + 1) * 8], g, torch.cat(gs, 0))
    return out


def _mlp(t, rank, group):
    """Column -> GeLU -> Row, with and without SP; gather_output and not input_is_parallel alone."""
    out = {}
    s, b, h, ffn = 8, 2, 16, 32
    for sp in (False, True):
        config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2, vocab_size=8, seq_length=s,
                                   sequence_parallel=sp)
        init = init_method_normal(0.2)
        torch.manual_seed(0)
        fc1 = Linear(h, ffn, config=config, init_method=init)
        fc2 = Linear(ffn, h, config=config, init_method=init)
        torch.manual_seed(0)
        col = tp.ColumnParallelLinear(h, ffn, config=config, init_method=init, tp_group=group)
        row = tp.RowParallelLinear(ffn, h, config=config, init_method=init, tp_group=group)
        x_full = _rank_tensor(1, s, b, h).requires_grad_()
        dy = _rank_tensor(2, s, b, h)
        y_ref = fc2(F.gelu(fc1(x_full)))
        y_ref.backward(dy)
        x = (x_full.detach()[rank * s // t:(rank + 1) * s // t] if sp else x_full.detach().clone()).requires_grad_()
        y = row(F.gelu(col(x)))
        y.backward(dy[rank * s // t:(rank + 1) * s // t] if sp else dy)
        tp.allreduce_sequence_parallel_grads(row, group)
        worst = max(_diff(y, tp.full_shard_of(y_ref, y, rank)), _diff(x.grad, tp.full_shard_of(x_full.grad, x.grad, rank)))
        for mine, ref in [(col, fc1), (row, fc2)]:
            for name in ("weight", "bias"):
                p, q = getattr(mine, name), getattr(ref, name)
                worst = max(worst, _diff(p, tp.full_shard_of(q, p, rank)), _diff(p.grad, tp.full_shard_of(q.grad, p, rank)))
        out[f"mlp sp={sp}"] = worst
    # the other two modes, alone
    config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2, vocab_size=8, seq_length=s)
    torch.manual_seed(0)
    fc1 = Linear(h, ffn, config=config, init_method=init)
    torch.manual_seed(0)
    col = tp.ColumnParallelLinear(h, ffn, config=config, init_method=init, gather_output=True, tp_group=group)
    out["column gather_output"] = _diff(col(x_full), fc1(x_full))
    torch.manual_seed(0)
    fc2 = Linear(ffn, h, config=config, init_method=init)
    torch.manual_seed(0)
    row = tp.RowParallelLinear(ffn, h, config=config, init_method=init, input_is_parallel=False, tp_group=group)
    z = _rank_tensor(3, s, b, ffn).requires_grad_()
    y = row(z)
    y.sum().backward()
    g_ref = torch.autograd.grad(fc2(z).sum(), z)[0]
    out["row not input_is_parallel"] = max(_diff(y, fc2(z)), _diff(z.grad, g_ref))
    return out


def _embedding(t, rank, group):
    V, h = 24, 8
    init = init_method_normal(1.0)
    torch.manual_seed(0)
    master = torch.empty(V, h)
    init(master)
    master.requires_grad_()
    torch.manual_seed(0)
    emb = tp.VocabParallelEmbedding(V, h, init_method=init, tp_group=group)
    ids = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(5))
    dy = _rank_tensor(4, 3, 10, h)
    y = emb(ids)
    y.backward(dy)
    F.embedding(ids, master).backward(dy)
    return {"embedding": max(_diff(y, F.embedding(ids, master)),
                             _diff(emb.weight.grad, tp.full_shard_of(master.grad, emb.weight, rank)))}


def _cross_entropy(t, rank, group):
    out, V = {}, 24
    logits = _rank_tensor(6, 3, 10, V) * 3
    target = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(9))
    dl = _rank_tensor(10, 3, 10)
    for smoothing in (0.0, 0.1):
        full = logits.clone().requires_grad_()
        ref = F.cross_entropy(full.view(-1, V), target.view(-1), reduction="none", label_smoothing=smoothing)
        ref.backward(dl.view(-1))
        local = tp.full_shard_of(logits, torch.empty(3, 10, V // t), rank).clone().requires_grad_()
        loss = tp.vocab_parallel_cross_entropy(local, target, label_smoothing=smoothing, group=group)
        loss.backward(dl)
        out[f"cross_entropy smoothing={smoothing}"] = max(_diff(loss, ref.view(3, 10)),
                                                          _diff(local.grad, tp.full_shard_of(full.grad, local, rank)))
    return out


def _gpt(t, rank, group):
    out = {}
    for variant, change in GPT_VARIANTS.items():
        for sp in (False, True):
            config = TransformerConfig(**{**SMALL, **change})
            torch.manual_seed(0)
            ref = GPTModel(config)
            torch.manual_seed(0)
            model = tp.TensorParallelGPTModel(TransformerConfig(**{**SMALL, **change, "sequence_parallel": sp}), group)
            ids = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(3))
            labels = torch.roll(ids, -1, 1)
            ref_loss = ref(ids, labels=labels)
            ref_loss.mean().backward()
            loss = model(ids, labels=labels)
            loss.mean().backward()
            tp.allreduce_sequence_parallel_grads(model, group)
            ref_params = dict(ref.named_parameters())
            worst = max(_diff(loss, ref_loss), _diff(model(ids), ref(ids)))
            names = set()
            for name, p in model.named_parameters():
                q, stride = ref_params[name], 2 if config.gated_linear_unit and "linear_fc1" in name else 1
                names.add(name)
                worst = max(worst, _diff(p, tp.full_shard_of(q, p, rank, stride)), _diff(p.grad, tp.full_shard_of(q.grad, p, rank, stride)))
            if names != set(ref_params):
                worst = float("inf")
            out[f"gpt {variant} sp={sp}"] = worst
    return out


def _dtensor(t, rank, group):
    """The same MLP under PyTorch's DTensor ColwiseParallel / RowwiseParallel (TP group = the world)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class MLP(torch.nn.Module):
        def __init__(self, fc1, fc2):
            super().__init__()
            self.fc1, self.fc2 = fc1, fc2

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    h, ffn = 16, 32
    config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2, vocab_size=8, seq_length=8)
    init = init_method_normal(0.2)
    torch.manual_seed(0)
    fc1, fc2 = Linear(h, ffn, config=config, init_method=init), Linear(ffn, h, config=config, init_method=init)
    torch.manual_seed(0)
    col = tp.ColumnParallelLinear(h, ffn, config=config, init_method=init, tp_group=group)
    row = tp.RowParallelLinear(ffn, h, config=config, init_method=init, tp_group=group)
    mesh = init_device_mesh("cpu", (t,))
    ref = parallelize_module(MLP(torch.nn.Linear(h, ffn), torch.nn.Linear(ffn, h)), mesh,
                             {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    with torch.no_grad():  # load the same full weights into the DTensor shards
        for mod, src in [(ref.fc1, fc1), (ref.fc2, fc2)]:
            for name in ("weight", "bias"):
                local = getattr(mod, name).to_local()
                local.copy_(tp.full_shard_of(getattr(src, name), local, rank))
    x = _rank_tensor(1, 8, 2, h)
    y_ref = ref(x)
    y_ref.sum().backward()
    y = row(F.gelu(col(x)))
    y.sum().backward()
    worst = _diff(y, y_ref)
    for mine, theirs in [(col, ref.fc1), (row, ref.fc2)]:
        for name in ("weight", "bias"):
            worst = max(worst, _diff(getattr(mine, name).grad, getattr(theirs, name).grad.to_local()))
    return {"dtensor mlp": worst}


def _comm(t, rank, group):
    """Bytes of one layer's forward + backward vs Narayanan's 8 b s h (t-1)/t (fp32: 4 bytes)."""
    from megalab.comm_tracer import CollectiveTracer

    out = {}
    s, b, h = 8, 2, 32
    for sp in (False, True):
        config = TransformerConfig(**{**SMALL, "num_layers": 1, "seq_length": s, "sequence_parallel": sp})
        layer = TransformerLayer(config, tp.tensor_parallel_layer_spec(group))
        x = _rank_tensor(1, s // t if sp else s, b, h).requires_grad_()
        with CollectiveTracer() as trace:
            layer(x).sum().backward()
        out[f"sp={sp}"] = dict(wire=trace.wire_bytes, counts=dict(trace.counts()),
                               formula=calc.tensor_parallel_communication_per_layer(s, b, h, t, 4))
    return out


CASES = {"mappings": _mappings, "mlp": _mlp, "embedding": _embedding, "cross_entropy": _cross_entropy, "gpt": _gpt,
         "comm": _comm}


def _worker(tp_sizes):
    from megalab import dist as mdist

    rank, world = mdist.init()
    results = {}
    for t in tp_sizes:
        ps.initialize_model_parallel(tensor_model_parallel_size=t)
        group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
        cases = dict(CASES, dtensor=_dtensor) if t == world else CASES
        for name, case in cases.items():
            try:
                results[(t, name)] = case(t, tp_rank, group)
            except Exception:
                results[(t, name)] = {"error": traceback.format_exc(limit=-3)}
        try:
            tp.ColumnParallelLinear(8, 7 * t + 1, config=TransformerConfig(**SMALL), init_method=init_method_normal(1.0))
            results[(t, "errors")] = "no error"
        except ValueError as e:
            results[(t, "errors")] = str(e)
        ps.destroy_model_parallel()
    torch.distributed.barrier()
    return results


@pytest.fixture(scope="module")
def runs():
    """{tp size: rank 0's results} from one 2-rank launch (tp 1, 2) and one 4-rank launch (tp 4)."""
    by_tp = {}
    for world, sizes in [(2, [1, 2]), (4, [4])]:
        res = launch.run_function(_worker, world, sizes, launch=dict(timeout=300))
        for rank, results in res.returns.items():
            for (t, name), value in results.items():
                by_tp.setdefault(t, {}).setdefault(name, {})[rank] = value
    return by_tp


def _assert_close(runs, case, keys=None):
    for t, cases in runs.items():
        if case not in cases:
            continue
        for rank, result in cases[case].items():
            assert "error" not in result, result.get("error")
            for key, worst in result.items():
                if keys is None or key.startswith(keys):
                    assert isinstance(worst, float) and worst < TOL, (t, rank, key, worst)


# ------------------------------------------------------------------ single process
def test_vocab_size_with_padding():
    assert tp.vocab_size_with_padding(50257, 128, 1) == 50304  # GPT-2's vocabulary, as Megatron pads it
    assert tp.vocab_size_with_padding(50257, 128, 8) == 51200
    assert tp.vocab_size_with_padding(64, 16, 4) == 64


def test_tp_communication_formula():
    # 4 all-reduces of b s h elements, 2 (t-1)/t each, 2 bytes per element
    assert calc.tensor_parallel_communication_per_layer(1024, 2, 512, 4, 2) == 4 * 2 * (3 / 4) * 1024 * 2 * 512 * 2
    assert calc.tensor_parallel_communication_per_layer(1024, 2, 512, 1) == 0


# ------------------------------------------------------------------ multi-rank
@pytest.mark.exercise("tp.copy_to_region")
@pytest.mark.exercise("tp.reduce_from_region")
@pytest.mark.exercise("tp.gather_last_dim")
def test_tensor_parallel_mappings(runs):
    _assert_close(runs, "mappings", ("copy_to", "reduce_from", "scatter_to", "gather_from"))


@pytest.mark.exercise("tp.sp_gather")
@pytest.mark.exercise("tp.sp_reduce_scatter")
def test_sequence_parallel_mappings(runs):
    _assert_close(runs, "mappings", ("sp ",))


@pytest.mark.exercise("tp.copy_to_region")
@pytest.mark.exercise("tp.reduce_from_region")
@pytest.mark.exercise("tp.sp_gather")
@pytest.mark.exercise("tp.sp_reduce_scatter")
@pytest.mark.exercise("tp.column_forward")
@pytest.mark.exercise("tp.row_forward")
@pytest.mark.exercise("tp.gather_last_dim")
def test_parallel_mlp_equals_single_device(runs):
    _assert_close(runs, "mlp")
    assert set(runs) == {1, 2, 4}


@pytest.mark.exercise("tp.reduce_from_region")
@pytest.mark.exercise("tp.vocab_embedding")
def test_vocab_parallel_embedding(runs):
    _assert_close(runs, "embedding")


@pytest.mark.exercise("tp.vocab_cross_entropy")
@pytest.mark.exercise("tp.vocab_cross_entropy_backward")
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(runs):
    _assert_close(runs, "cross_entropy")


@pytest.mark.exercise("tp.copy_to_region")
@pytest.mark.exercise("tp.reduce_from_region")
@pytest.mark.exercise("tp.sp_gather")
@pytest.mark.exercise("tp.sp_reduce_scatter")
@pytest.mark.exercise("tp.column_forward")
@pytest.mark.exercise("tp.row_forward")
@pytest.mark.exercise("tp.gather_last_dim")
@pytest.mark.exercise("tp.vocab_embedding")
@pytest.mark.exercise("tp.vocab_cross_entropy")
@pytest.mark.exercise("tp.vocab_cross_entropy_backward")
def test_tensor_parallel_gpt_equals_single_device(runs):
    _assert_close(runs, "gpt")
    assert len(runs[4]["gpt"][0]) == 2 * len(GPT_VARIANTS)


@pytest.mark.exercise("tp.copy_to_region")
@pytest.mark.exercise("tp.reduce_from_region")
@pytest.mark.exercise("tp.column_forward")
@pytest.mark.exercise("tp.row_forward")
def test_same_mlp_as_dtensor_colwise_rowwise(runs):
    _assert_close(runs, "dtensor")
    assert "dtensor" in runs[2] and "dtensor" in runs[4]


@pytest.mark.exercise("tp.copy_to_region")
@pytest.mark.exercise("tp.reduce_from_region")
@pytest.mark.exercise("tp.sp_gather")
@pytest.mark.exercise("tp.sp_reduce_scatter")
@pytest.mark.exercise("tp.column_forward")
@pytest.mark.exercise("tp.row_forward")
def test_collective_bytes_per_layer_equal_narayanan(runs):
    for t, cases in runs.items():
        for result in cases["comm"].values():
            assert "error" not in result, result.get("error")
            plain, sp = result["sp=False"], result["sp=True"]
            assert plain["wire"] == plain["formula"], (t, plain)
            if t == 1:
                assert plain["counts"] == sp["counts"] == {} and sp["wire"] == 0
                continue
            assert plain["counts"] == {"all_reduce": 4}
            # SP: 2 all-gathers + 2 reduce-scatters forward, the same backward: the paper's equal volume;
            # plus 2 all-gathers that re-gather the column-parallel inputs kept sharded for backward
            assert sp["counts"] == {"all_gather_single": 6, "reduce_scatter_single": 4}
            one_gather = plain["formula"] / 8
            assert sp["wire"] == plain["formula"] + 2 * one_gather, (t, sp)


def test_clear_error_when_sizes_do_not_divide(runs):
    for t in (2, 4):
        assert "not divisible by the tensor-parallel size" in runs[t]["errors"][0]
