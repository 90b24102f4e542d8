"""Tensor and sequence parallelism against single-device math and PyTorch's DTensor TP.

One torchrun launch per world size (2 and 4 ranks) runs every case; each case returns, per
quantity it compared (the output, the input gradient, a weight's gradient, ...), the worst
difference, or its error; the tests below read them (so a missing exercise fails only the
checks that need it) and say which quantity of which case on which rank is off, and by how much.
"""

import re
import traceback

import pytest
import torch
import torch.nn.functional as F

from megalab.core import parallel_state as ps
from megalab.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from megalab.core.models.gpt.gpt_layer_specs import tensor_parallel_layer_spec
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.tensor_parallel import layers as tp
from megalab.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalab.core.tensor_parallel.layers import Linear
from megalab.core.tensor_parallel.mappings import (
    _gather_along_first_dim,
    _gather_along_last_dim,
    _reduce_scatter_along_first_dim,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megalab.core.tensor_parallel.utils import vocab_size_with_padding
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.transformer.transformer_layer import TransformerLayer
from megalab.core.utils import init_method_normal
from megalab.extras import calc
from megalab.lab import launch
from megalab.lab.checks import close, mistake
from tests.feedback import equal, max_error, require, require_no_error, require_within
from tests.quick_launch import quick_fixture
from tests.quick_launch import results as quick_results

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
def _dev():
    """The rank's device: its GPU under NCCL, else the CPU (every tensor and layer below lives there)."""
    from megalab.lab import dist as mdist

    return mdist.device()


def _rank_tensor(r, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + r)).to(_dev())


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

    def check(name, mapping, leaf, expected_y, forward, grad, expected_grad, backward):
        """One mapping forward and backward; an error (a missing exercise) is recorded, not raised."""
        leaf.grad = None
        try:
            y = mapping(leaf, group=group)
            errors = {f"its forward output (should be {forward})": max_error(y, expected_y)}
            y.backward(grad)
            errors[f"its backward output, the input gradient (should be {backward})"] = max_error(leaf.grad, expected_grad)
            out[name] = errors
        except Exception:
            out[name] = {"error": traceback.format_exc(limit=-2)}

    check("copy_to", copy_to_tensor_model_parallel_region, x, x, "the input, unchanged",
          g, sum(gs), "the sum of the ranks' output gradients")
    check("reduce_from", reduce_from_tensor_model_parallel_region, x, sum(xs), "the sum of the ranks' inputs",
          g, g, "the output gradient, unchanged")
    check("scatter_to", scatter_to_tensor_model_parallel_region, full, full[..., rank * 4:(rank + 1) * 4],
          "this rank's slice of the last dim", g, torch.cat(gs, -1), "the ranks' gradients concatenated on the last dim")
    check("gather_from", gather_from_tensor_model_parallel_region, x, torch.cat(xs, -1),
          "the ranks' inputs concatenated on the last dim", gfull[rank], gfull[rank][..., rank * 4:(rank + 1) * 4],
          "this rank's slice of the output gradient's last dim")
    check("sp scatter_to", scatter_to_sequence_parallel_region, full_seq, full_seq[rank * 8:(rank + 1) * 8],
          "this rank's slice of the sequence (dim 0)", g, torch.cat(gs, 0), "the ranks' gradients concatenated on dim 0")
    gseq = [_rank_tensor(70 + r, 8 * t, 2, 4) for r in range(t)]
    check("sp gather_from", gather_from_sequence_parallel_region, x, torch.cat(xs, 0),
          "the ranks' inputs concatenated on dim 0", gseq[rank], sum(gseq)[rank * 8:(rank + 1) * 8],
          "this rank's dim-0 slice of the sum of the ranks' output gradients")
    xl = _rank_tensor(rank, 8 * t, 2, 4).requires_grad_()
    xls = [_rank_tensor(r, 8 * t, 2, 4) for r in range(t)]
    check("sp reduce_scatter", reduce_scatter_to_sequence_parallel_region, xl, sum(xls)[rank * 8:(rank + 1) * 8],
          "this rank's dim-0 slice of the sum of the ranks' inputs", g, torch.cat(gs, 0),
          "the ranks' output gradients concatenated on dim 0")
    return out


def _nonzero_biases(pairs, rank, seed=90):
    """Add the same random values to each single-device bias and (its shard) to the parallel one:
    biases start at zero, and a zero bias hides a bias added before the all-reduce (t times)."""
    with torch.no_grad():
        for i, (mine, ref) in enumerate(pairs):
            noise = _rank_tensor(seed + i, *ref.bias.shape)  # the same on every rank
            ref.bias.add_(noise)
            mine.bias.add_(tp.full_shard_of(noise, mine.bias, rank))


def _mlp(t, rank, group):
    """Column -> GeLU -> Row, with and without SP; gather_output and not input_is_parallel alone."""
    out = {}
    s, b, h, ffn = 8, 2, 16, 32
    for sp in (False, True):
        config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2, vocab_size=8, seq_length=s,
                                   sequence_parallel=sp)
        init = init_method_normal(0.2)
        torch.manual_seed(0)
        fc1 = Linear(h, ffn, config=config, init_method=init).to(_dev())
        fc2 = Linear(ffn, h, config=config, init_method=init).to(_dev())
        torch.manual_seed(0)
        col = tp.ColumnParallelLinear(h, ffn, config=config, init_method=init, tp_group=group).to(_dev())
        row = tp.RowParallelLinear(ffn, h, config=config, init_method=init, tp_group=group).to(_dev())
        errors = {}
        for mine, ref, who in [(col, fc1, "ColumnParallelLinear"), (row, fc2, "RowParallelLinear")]:
            errors[f"{who}'s initial weight shard"] = max_error(mine.weight, tp.full_shard_of(ref.weight, mine.weight, rank))
        _nonzero_biases([(col, fc1), (row, fc2)], rank)
        x_full = _rank_tensor(1, s, b, h).requires_grad_()
        dy = _rank_tensor(2, s, b, h)
        y_ref = fc2(F.gelu(fc1(x_full)))
        y_ref.backward(dy)
        x = (x_full.detach()[rank * s // t:(rank + 1) * s // t] if sp else x_full.detach().clone()).requires_grad_()
        y = row(F.gelu(col(x)))
        errors["the output"] = max_error(y, tp.full_shard_of(y_ref, y, rank))
        y.backward(dy[rank * s // t:(rank + 1) * s // t] if sp else dy)
        allreduce_sequence_parallel_grads(row, group)
        errors["the input gradient"] = max_error(x.grad, tp.full_shard_of(x_full.grad, x.grad, rank))
        for mine, ref, who in [(col, fc1, "ColumnParallelLinear"), (row, fc2, "RowParallelLinear")]:
            for name in ("weight", "bias"):
                p, q = getattr(mine, name), getattr(ref, name)
                errors[f"{who}'s {name} gradient"] = max_error(p.grad, tp.full_shard_of(q.grad, p, rank))
        out[f"mlp sp={sp}"] = errors
    # the other two modes, alone
    config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2, vocab_size=8, seq_length=s)
    torch.manual_seed(0)
    fc1 = Linear(h, ffn, config=config, init_method=init).to(_dev())
    torch.manual_seed(0)
    col = tp.ColumnParallelLinear(h, ffn, config=config, init_method=init, gather_output=True, tp_group=group).to(_dev())
    _nonzero_biases([(col, fc1)], rank)
    x_full = _rank_tensor(1, s, b, h).requires_grad_()
    y = col(x_full)
    errors = {"the output": max_error(y, fc1(x_full))}
    dy = _rank_tensor(5, s, b, ffn)
    y.backward(dy)
    errors["the input gradient"] = max_error(x_full.grad, torch.autograd.grad(fc1(x_full), x_full, dy)[0])
    out["column gather_output"] = errors
    torch.manual_seed(0)
    fc2 = Linear(ffn, h, config=config, init_method=init).to(_dev())
    torch.manual_seed(0)
    row = tp.RowParallelLinear(ffn, h, config=config, init_method=init, input_is_parallel=False,
                               tp_group=group).to(_dev())
    _nonzero_biases([(row, fc2)], rank)
    z = _rank_tensor(3, s, b, ffn).requires_grad_()
    y = row(z)
    y.sum().backward()
    g_ref = torch.autograd.grad(fc2(z).sum(), z)[0]
    out["row not input_is_parallel"] = {"the output": max_error(y, fc2(z)), "the input gradient": max_error(z.grad, g_ref)}
    return out


def _embedding(t, rank, group):
    V, h = 24, 8
    init = init_method_normal(1.0)
    torch.manual_seed(0)
    master = torch.empty(V, h)
    init(master)
    master = master.to(_dev()).requires_grad_()
    torch.manual_seed(0)
    emb = tp.VocabParallelEmbedding(V, h, init_method=init, tp_group=group).to(_dev())
    ids = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(5)).to(_dev())
    dy = _rank_tensor(4, 3, 10, h)
    y = emb(ids)
    y.backward(dy)
    F.embedding(ids, master).backward(dy)
    return {"embedding": {"the output": max_error(y, F.embedding(ids, master)),
                          "the weight gradient (this rank's rows)":
                              max_error(emb.weight.grad, tp.full_shard_of(master.grad, emb.weight, rank))}}


def _cross_entropy(t, rank, group):
    from megalab.extras.comm_tracer import CollectiveTracer

    out, V = {}, 24
    logits = _rank_tensor(6, 3, 10, V) * 3
    target = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(9)).to(_dev())
    dl = _rank_tensor(10, 3, 10)
    for smoothing in (0.0, 0.1):
        full = logits.clone().requires_grad_()
        ref = F.cross_entropy(full.view(-1, V), target.view(-1), reduction="none", label_smoothing=smoothing)
        ref.backward(dl.view(-1))
        local = tp.full_shard_of(logits, torch.empty(3, 10, V // t), rank).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, label_smoothing=smoothing, group=group)
        errors = {"the per-token loss": max_error(loss, ref.view(3, 10))}
        with CollectiveTracer() as trace:
            loss.backward(dl)
        errors["the logits gradient (this rank's vocabulary slice)"] = max_error(
            local.grad, tp.full_shard_of(full.grad, local, rank))
        out[f"cross_entropy smoothing={smoothing}"] = errors
        out[f"cross_entropy smoothing={smoothing} backward collectives"] = dict(trace.counts())
    return out


def _gpt(t, rank, group):
    out = {}
    for variant, change in GPT_VARIANTS.items():
        for sp in (False, True):
            config = TransformerConfig(**{**SMALL, **change})
            torch.manual_seed(0)
            ref = GPTModel(config).to(_dev())
            torch.manual_seed(0)
            model = GPTModel(TransformerConfig(**{**SMALL, **change, "sequence_parallel": sp}),
                             tensor_parallel_layer_spec(group)).to(_dev())
            ref_params = dict(ref.named_parameters())
            names = {name for name, _ in model.named_parameters()}
            if names != set(ref_params):
                out[f"gpt {variant} sp={sp}"] = {"the parameter names": (
                    f"differ from GPTModel's: missing {sorted(set(ref_params) - names)}, extra {sorted(names - set(ref_params))}")}
                continue
            stride = {name: 2 if config.gated_linear_unit and "linear_fc1" in name else 1 for name in names}
            errors = {}
            for name, p in model.named_parameters():
                errors[f"the initial value of {name}"] = max_error(p, tp.full_shard_of(ref_params[name], p, rank, stride[name]))
            with torch.no_grad():  # non-zero biases and norm weights != 1 (the same values in both models)
                for i, (name, p) in enumerate(model.named_parameters()):
                    if "bias" in name or "norm" in name:
                        noise = _rank_tensor(200 + i, *ref_params[name].shape) * 0.1
                        ref_params[name].add_(noise)
                        p.add_(tp.full_shard_of(noise, p, rank, stride[name]))
            ids = torch.randint(0, config.vocab_size, (2, config.seq_length),
                                generator=torch.Generator().manual_seed(3)).to(_dev())
            labels = torch.roll(ids, -1, 1)
            ref_loss = ref(ids, labels=labels)
            ref_loss.mean().backward()
            loss = model(ids, labels=labels)
            errors["the per-token loss"] = max_error(loss, ref_loss)
            # the logits stay vocab-parallel [b, s, V/t] (Megatron's GPTModel too); gathered to compare
            errors["the logits tensor"] = max_error(gather_from_tensor_model_parallel_region(model(ids), group), ref(ids))
            loss.mean().backward()
            allreduce_sequence_parallel_grads(model, group)
            for name, p in model.named_parameters():
                errors[f"the gradient of {name}"] = max_error(
                    p.grad, tp.full_shard_of(ref_params[name].grad, p, rank, stride[name]))
            out[f"gpt {variant} sp={sp}"] = errors
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
    fc1 = Linear(h, ffn, config=config, init_method=init).to(_dev())
    fc2 = Linear(ffn, h, config=config, init_method=init).to(_dev())
    torch.manual_seed(0)
    col = tp.ColumnParallelLinear(h, ffn, config=config, init_method=init, tp_group=group).to(_dev())
    row = tp.RowParallelLinear(ffn, h, config=config, init_method=init, tp_group=group).to(_dev())
    _nonzero_biases([(col, fc1), (row, fc2)], rank)
    mesh = init_device_mesh(_dev().type, (t,))
    ref = parallelize_module(MLP(torch.nn.Linear(h, ffn), torch.nn.Linear(ffn, h)).to(_dev()), mesh,
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
    errors = {"the output": max_error(y, y_ref)}
    for mine, theirs, who in [(col, ref.fc1, "ColumnParallelLinear"), (row, ref.fc2, "RowParallelLinear")]:
        for name in ("weight", "bias"):
            errors[f"{who}'s {name} gradient"] = max_error(getattr(mine, name).grad, getattr(theirs, name).grad.to_local())
    return {"dtensor mlp": errors}


def _comm(t, rank, group):
    """Bytes of one layer's forward + backward vs Narayanan's 8 b s h (t-1)/t (fp32: 4 bytes)."""
    from megalab.extras.comm_tracer import CollectiveTracer

    out = {}
    s, b, h = 8, 2, 32
    for sp in (False, True):
        config = TransformerConfig(**{**SMALL, "num_layers": 1, "seq_length": s, "sequence_parallel": sp})
        layer = TransformerLayer(config, tensor_parallel_layer_spec(group)).to(_dev())
        x = _rank_tensor(1, s // t if sp else s, b, h).requires_grad_()
        with CollectiveTracer() as trace:
            layer(x).sum().backward()
        out[f"sp={sp}"] = dict(wire=trace.wire_bytes, counts=dict(trace.counts()),
                               formula=calc.tensor_parallel_communication_per_layer(s, b, h, t, 4))
    return out


CASES = {"mappings": _mappings, "mlp": _mlp, "embedding": _embedding, "cross_entropy": _cross_entropy, "gpt": _gpt,
         "comm": _comm}


def _worker(tp_sizes):
    from megalab.lab import dist as mdist

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


# what each case compared, in words, and against what
WORDS = {
    "copy_to": "copy_to_tensor_model_parallel_region (f)",
    "reduce_from": "reduce_from_tensor_model_parallel_region (g)",
    "scatter_to": "scatter_to_tensor_model_parallel_region",
    "gather_from": "gather_from_tensor_model_parallel_region",
    "sp scatter_to": "scatter_to_sequence_parallel_region",
    "sp gather_from": "gather_from_sequence_parallel_region",
    "sp reduce_scatter": "reduce_scatter_to_sequence_parallel_region",
    "mlp sp=False": "the Column -> GeLU -> Row MLP",
    "mlp sp=True": "the Column -> GeLU -> Row MLP with sequence parallelism",
    "column gather_output": "ColumnParallelLinear(gather_output=True)",
    "row not input_is_parallel": "RowParallelLinear(input_is_parallel=False)",
    "embedding": "VocabParallelEmbedding",
    "cross_entropy smoothing=0.0": "vocab_parallel_cross_entropy",
    "cross_entropy smoothing=0.1": "vocab_parallel_cross_entropy with label_smoothing=0.1",
    "dtensor mlp": "the Column -> GeLU -> Row MLP",
}
AGAINST = {
    "mappings": None,  # each quantity says what it should be
    "mlp sp=False": "the single-device MLP's (Linear -> GeLU -> Linear)",
    "mlp sp=True": "the single-device MLP's (Linear -> GeLU -> Linear)",
    "mlp": "the single-device Linear's",
    "embedding": "F.embedding's on the full table",
    "cross_entropy": "F.cross_entropy's on the full logits",
    "gpt": "the single-device GPTModel's",
    "dtensor": "PyTorch DTensor ColwiseParallel/RowwiseParallel's",
}


def _words(key):
    if key.startswith("gpt "):
        _, variant, sp = key.split()
        return f"GPTModel with tensor_parallel_layer_spec ({variant}{', sequence parallel' if sp == 'sp=True' else ''})"
    return WORDS.get(key, key)


def _assert_close(runs, case, keys=None):
    """Every quantity of every (tp, rank, key) of `case` within TOL, else which one, where, by how much."""
    for t, cases in runs.items():
        if case not in cases:
            continue
        for rank, result in cases[case].items():
            require_no_error(f"tp={t}, rank {rank}, the {case} case", result.get("error"))
            for key, errors in result.items():
                if (keys is None or key.startswith(keys)) and not key.endswith("collectives"):
                    where = f"tp={t}, rank {rank}, {_words(key)}"
                    if isinstance(errors, dict) and "error" in errors:
                        require_no_error(where, errors["error"])
                    require_within(errors, TOL, where=where, against=AGAINST.get(key, AGAINST[case]))


# ------------------------------------------------------------------ single process
def test_vocab_size_with_padding():
    assert vocab_size_with_padding(50257, 128, 1) == 50304  # GPT-2's vocabulary, as Megatron pads it
    assert vocab_size_with_padding(50257, 128, 8) == 51200
    assert vocab_size_with_padding(64, 16, 4) == 64


def test_tp_communication_formula():
    # 4 all-reduces of b s h elements, 2 (t-1)/t each, 2 bytes per element
    assert calc.tensor_parallel_communication_per_layer(1024, 2, 512, 4, 2) == 4 * 2 * (3 / 4) * 1024 * 2 * 512 * 2
    assert calc.tensor_parallel_communication_per_layer(1024, 2, 512, 1) == 0


# ------------------------------------------------------------------ quick checks (issue 27)
# 2 ranks as threads (tests/quick_launch.py), tiny tensors: the first test of each exercise, naming the typical
# mistakes. The cases run in the ranks and return tensors (on the CPU); the tests compare them with the right answer
# and with what each typical mistake computes. The real processes: the launches of the tests further down.


def _cpu(x):
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def _alone(rank, world):
    """A group of this rank alone (new_group is called by every rank for every group)."""
    return [torch.distributed.new_group([r]) for r in range(world)][rank]


def _quick_copy_to(rank, world, group):
    out = {}
    for name, g in (("tp", group), ("alone", _alone(rank, world))):
        x = _rank_tensor(0, 4, 3).requires_grad_()
        dy = _rank_tensor(10 + rank, 4, 3)
        copy_to_tensor_model_parallel_region(x, group=g).backward(dy)
        out[name] = {"dy": _cpu(dy), "dx": _cpu(x.grad)}
    return out


def _quick_reduce_from(rank, world, group):
    out = {}
    for name, g in (("tp", group), ("alone", _alone(rank, world))):
        x = _rank_tensor(20 + rank, 4, 3)
        before = _cpu(x.clone())
        out[name] = {"x": before, "y": _cpu(reduce_from_tensor_model_parallel_region(x, group=g)).clone(),
                     "x after": _cpu(x)}
    return out


def _quick_gather_last_dim(rank, world, group):
    x = _rank_tensor(30 + rank, 4, 3)
    return {"x": _cpu(x), "y": _cpu(_gather_along_last_dim(x, group))}


def _quick_sp_gather(rank, world, group):
    x = _rank_tensor(40 + rank, 2, 3, 4)  # [s/t, b, h]
    return {"x": _cpu(x), "y": _cpu(_gather_along_first_dim(x, group))}


def _quick_sp_reduce_scatter(rank, world, group):
    x = _rank_tensor(50 + rank, 4, 3, 4)  # [s, b, h], a partial sum on each rank
    return {"x": _cpu(x), "y": _cpu(_reduce_scatter_along_first_dim(x, group))}


def _tiny_linears(cls, rank, group, **kwargs):
    """(the parallel layer, the single-device Linear it splits), same init, the same nonzero bias."""
    s, h, n = 4, 6, 8
    config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2, vocab_size=8, seq_length=s,
                               sequence_parallel=kwargs.pop("sp", False))
    init = init_method_normal(0.3)
    args = (h, n) if cls is tp.ColumnParallelLinear else (n, h)
    torch.manual_seed(0)
    ref = Linear(*args, config=config, init_method=init).to(_dev())
    torch.manual_seed(0)
    mine = cls(*args, config=config, init_method=init, tp_group=group, **kwargs).to(_dev())
    _nonzero_biases([(mine, ref)], rank)
    return mine, ref


def _quick_column(rank, world, group):
    out = {}
    col, ref = _tiny_linears(tp.ColumnParallelLinear, rank, group)
    x = _rank_tensor(1, 4, 2, 6).requires_grad_()
    y = col(x)
    if tuple(y.shape) != (4, 2, 4):  # not this rank's slice: the test names the shape (the backward below can't run)
        return {"plain": {"y": _cpu(y), "wrong shape": True}}
    dy_full = _rank_tensor(2, 4, 2, 8)  # the same on every rank; this rank's part of it drives its backward
    y.backward(tp.full_shard_of(dy_full, y, rank))
    ref_w = ref.weight.detach()
    out["plain"] = {"y": _cpu(y), "expected y": _cpu(tp.full_shard_of(ref(x).detach(), y, rank)),
                    "dx": _cpu(x.grad), "expected dx": _cpu(dy_full @ ref_w),
                    "this rank's dx only": _cpu(tp.full_shard_of(dy_full, y, rank) @ col.weight.detach())}
    gcol, ref = _tiny_linears(tp.ColumnParallelLinear, rank, group, gather_output=True)
    out["gather_output"] = {"y": _cpu(gcol(x)), "expected y": _cpu(ref(x))}
    scol, _ = _tiny_linears(tp.ColumnParallelLinear, rank, group, sp=True)
    out["sp"] = {"y": _cpu(scol(x.detach()[rank * 2:(rank + 1) * 2]))}
    return out


def _quick_row(rank, world, group):
    out = {}
    row, ref = _tiny_linears(tp.RowParallelLinear, rank, group)
    z = _rank_tensor(3, 4, 2, 8)
    z_mine = z[..., rank * 4:(rank + 1) * 4]  # this rank's slice of the last dim
    try:
        row(z_mine)
    except RuntimeError as e:  # the evidence (the matmul's shapes) goes to the test, which names it
        if "cannot be multiplied" not in str(e):
            raise
        return {"plain": {"shape error": str(e).splitlines()[0]}}
    out["plain"] = {"y": _cpu(row(z_mine)), "expected y": _cpu(ref(z)), "bias": _cpu(ref.bias),
                    "this rank's partial": _cpu(z_mine @ row.weight.detach().t())}
    srow, ref = _tiny_linears(tp.RowParallelLinear, rank, group, sp=True)
    out["sp"] = {"y": _cpu(srow(z_mine)), "expected y": _cpu(ref(z)[rank * 2:(rank + 1) * 2])}
    return out


def _quick_embedding(rank, world, group):
    V, h = 8, 3
    init = init_method_normal(1.0)
    torch.manual_seed(0)
    master = torch.empty(V, h)
    init(master)
    torch.manual_seed(0)
    emb = tp.VocabParallelEmbedding(V, h, init_method=init, tp_group=group).to(_dev())
    ids = torch.tensor([[0, 3, 4, 7], [5, 1, 6, 2]]).to(_dev())
    return {"y": _cpu(emb(ids)), "master": master, "ids": _cpu(ids), "start": emb.vocab_start_index,
            "end": emb.vocab_end_index}


def _ce_logits():
    return _rank_tensor(60, 5, 8) * 3, torch.tensor([0, 3, 4, 7, 5]).to(_dev())  # [N, V], targets on both halves


def _quick_cross_entropy(rank, world, group):
    logits, target = _ce_logits()
    out = {"logits": _cpu(logits), "target": _cpu(target)}
    for name, shift in (("plain", 0.0), ("large logits", 1000.0)):
        shard = tp.full_shard_of(logits, logits[:, :4], rank) + shift
        out[name] = _cpu(vocab_parallel_cross_entropy(shard, target, group=group))
    shard = tp.full_shard_of(logits, logits[:, :4], rank)
    out["smoothed"] = _cpu(vocab_parallel_cross_entropy(shard, target, label_smoothing=0.1, group=group))
    return out


def _quick_cross_entropy_backward(rank, world, group):
    logits, target = _ce_logits()
    shard = tp.full_shard_of(logits, logits[:, :4], rank).clone().requires_grad_()
    weights = torch.arange(1.0, 6.0).to(_dev())  # d loss_i: the backward must scale by grad_output
    (vocab_parallel_cross_entropy(shard, target, group=group) * weights).sum().backward()
    smoothed = tp.full_shard_of(logits, logits[:, :4], rank).clone().requires_grad_()
    (vocab_parallel_cross_entropy(smoothed, target, label_smoothing=0.1, group=group) * weights).sum().backward()
    return {"logits": _cpu(logits), "target": _cpu(target), "weights": _cpu(weights), "grad": _cpu(shard.grad),
            "smoothed grad": _cpu(smoothed.grad)}


QUICK = {"tp.copy_to_region": _quick_copy_to, "tp.reduce_from_region": _quick_reduce_from,
         "tp.gather_last_dim": _quick_gather_last_dim, "tp.sp_gather": _quick_sp_gather,
         "tp.sp_reduce_scatter": _quick_sp_reduce_scatter, "tp.column_forward": _quick_column,
         "tp.row_forward": _quick_row, "tp.vocab_embedding": _quick_embedding,
         "tp.vocab_cross_entropy": _quick_cross_entropy, "tp.vocab_cross_entropy_backward": _quick_cross_entropy_backward}
quick = quick_fixture(QUICK)


def _shape_named(got, expected_shape, shapes: dict, what: str):
    """A wrong shape named by the mistake that gives it ({mistake: the shape it gives})."""
    if tuple(got.shape) != tuple(expected_shape):
        for name, shape in shapes.items():
            if tuple(got.shape) == tuple(shape):
                require(mistake(name, f"{what} has shape {tuple(got.shape)}, expected {tuple(expected_shape)}"))
        require(equal(tuple(got.shape), tuple(expected_shape), f"the shape of {what}"))


WORLD_GROUP = "all-reduced over every rank, not the given group (pass group=)"


@pytest.mark.exercise("tp.copy_to_region")
def test_quick_copy_to_region_backward_sums_over_the_group(quick):
    res = quick_results(quick, "tp.copy_to_region")
    dys = [res[r]["tp"]["dy"] for r in sorted(res)]
    for rank, r in res.items():
        require(close(r["tp"]["dx"], sum(dys), f"tp=2, rank {rank}: the input gradient of f (the sum of the ranks' "
                                               "output gradients)", mistakes={
            "f's backward returned the gradient unchanged (it must all-reduce it)": r["tp"]["dy"],
            "averaged the gradient over the TP group instead of summing it": sum(dys) / len(dys)}))
        require(close(r["alone"]["dx"], r["alone"]["dy"], f"rank {rank}, a TP group of this rank alone: the input "
                                                          "gradient of f", mistakes={WORLD_GROUP: sum(dys)}))


@pytest.mark.exercise("tp.reduce_from_region")
def test_quick_reduce_from_region_forward_sums_over_the_group(quick):
    res = quick_results(quick, "tp.reduce_from_region")
    xs = [res[r]["tp"]["x"] for r in sorted(res)]
    for rank, r in res.items():
        require(close(r["tp"]["y"], sum(xs), f"tp=2, rank {rank}: the output of g (the sum of the ranks' inputs)",
                      mistakes={"g's forward returned the input unchanged (it must all-reduce it)": r["tp"]["x"],
                                "averaged over the TP group instead of summing": sum(xs) / len(xs)}))
        xa = [res[q]["alone"]["x"] for q in sorted(res)]
        require(close(r["alone"]["y"], r["alone"]["x"], f"rank {rank}, a TP group of this rank alone: the output of g",
                      mistakes={WORLD_GROUP: sum(xa)}))
        if "x after" in r["tp"] and not torch.equal(r["tp"]["x after"], r["tp"]["x"]):
            require(mistake("all-reduced g's input in place: the caller's tensor now holds the sum (autograd may still "
                            "need it: _reduce clones first)", f"tp=2, rank {rank}: g's input changed from "
                            f"{r['tp']['x'].flatten()[:3].tolist()}... to {r['tp']['x after'].flatten()[:3].tolist()}..."))


@pytest.mark.exercise("tp.gather_last_dim")
def test_quick_gather_last_dim_concatenates_in_rank_order(quick):
    res = quick_results(quick, "tp.gather_last_dim")
    xs = [res[r]["x"] for r in sorted(res)]
    expected = torch.cat(xs, -1)
    for rank, r in res.items():
        what = f"tp=2, rank {rank}: the all-gather of [4, 3] along the last dim"
        _shape_named(r["y"], expected.shape, {"concatenated along dim 0 instead of the last dim": (8, 3),
                                              "stacked the pieces (a new dim) instead of concatenating them": (2, 4, 3),
                                              "stacked the pieces along a new last dim instead of concatenating them":
                                                  (4, 3, 2)}, what)
        pieces = r["y"].chunk(len(xs), -1)
        if all(torch.equal(p, pieces[0]) for p in pieces) and not torch.equal(xs[0], xs[1]):
            require(mistake("every receive buffer is the same tensor ([t] * world repeats ONE tensor: make one "
                            "torch.empty_like per rank)", f"{what}: all pieces equal"))
        require(close(r["y"], expected, what, mistakes={"concatenated the pieces in reverse rank order":
                                                        torch.cat(xs[::-1], -1)}))


@pytest.mark.exercise("tp.sp_gather")
def test_quick_sp_gather_concatenates_the_sequence(quick):
    res = quick_results(quick, "tp.sp_gather", known={
        "invalid tensor size": "the output buffer is not [t * s/t, b, h] as one tensor: all_gather_single fills its "
                               "first dim with the ranks' inputs one after the other (allocate that shape)"})
    xs = [res[r]["x"] for r in sorted(res)]
    expected = torch.cat(xs, 0)
    for rank, r in res.items():
        what = f"tp=2, rank {rank}: the sequence all-gather of [s/t=2, b=3, h=4]"
        _shape_named(r["y"], expected.shape, {"gathered along the hidden (last) dim instead of the sequence (dim 0)":
                                              (2, 3, 8), "gathered along the batch (dim 1) instead of the sequence "
                                              "(dim 0)": (2, 6, 4)}, what)
        require(close(r["y"], expected, what, mistakes={"put the sequence shards in reverse rank order":
                                                        torch.cat(xs[::-1], 0)}))


@pytest.mark.exercise("tp.sp_reduce_scatter")
def test_quick_sp_reduce_scatter_keeps_this_ranks_sequence_slice(quick):
    res = quick_results(quick, "tp.sp_reduce_scatter")
    xs = [res[r]["x"] for r in sorted(res)]
    for rank, r in res.items():
        expected = sum(xs)[rank * 2:(rank + 1) * 2]
        what = f"tp=2, rank {rank}: the reduce-scatter of [s=4, b=3, h=4] along the sequence"
        _shape_named(r["y"], expected.shape, {
            "reduce-scattered along the hidden (last) dim instead of the sequence (dim 0)": (4, 3, 2),
            "all-reduced without scattering (kept the whole sequence)": (4, 3, 4)}, what)
        require(close(r["y"], expected, what, mistakes={
            "split the sequence without summing over the ranks (no reduction)": xs[rank][rank * 2:(rank + 1) * 2],
            "averaged over the ranks instead of summing (a row-parallel output is the SUM of the partial products)":
                sum(xs)[rank * 2:(rank + 1) * 2] / len(xs),
            "kept another rank's sequence slice": sum(xs)[(1 - rank) * 2:(2 - rank) * 2]}))


@pytest.mark.exercise("tp.column_forward")
def test_quick_column_parallel_forward_and_input_gradient(quick):
    res = quick_results(quick, "tp.column_forward")
    for rank, r in res.items():
        p = r["plain"]
        if p.get("wrong shape"):
            _shape_named(p["y"], (4, 2, 4), {"all-gathered the output although gather_output=False (gather only if "
                                             "self.gather_output)": (4, 2, 8)},
                         f"tp=2, rank {rank}: ColumnParallelLinear(gather_output=False)'s output")
        require(close(p["y"], p["expected y"], f"tp=2, rank {rank}: ColumnParallelLinear's output slice [4, 2, 8/t]"))
        require(close(p["dx"], p["expected dx"], f"tp=2, rank {rank}: ColumnParallelLinear's input gradient", mistakes={
            "skipped copy_to_tensor_model_parallel_region (f) before the matmul: dX is not summed over the TP ranks":
                p["this rank's dx only"]}))
        g = r["gather_output"]
        _shape_named(g["y"], g["expected y"].shape, {"gather_output=True but the output was not all-gathered "
                                                     "(gather_from_tensor_model_parallel_region)": (4, 2, 4)},
                     f"tp=2, rank {rank}: ColumnParallelLinear(gather_output=True)'s output")
        require(close(g["y"], g["expected y"], f"tp=2, rank {rank}: ColumnParallelLinear(gather_output=True)'s output"))
        _shape_named(r["sp"]["y"], (4, 2, 4), {"sequence_parallel ignored: the [s/t, b, h] input was not all-gathered "
                                               "(use column_parallel_linear)": (2, 2, 4)},
                     f"tp=2, rank {rank}: ColumnParallelLinear's output with sequence_parallel")


@pytest.mark.exercise("tp.row_forward")
def test_quick_row_parallel_forward_sums_once(quick):
    res = quick_results(quick, "tp.row_forward")
    for rank, r in res.items():
        p = r["plain"]
        if "shape error" in p:  # x [.., k] times the weight's [in/t = 4] columns: k = 2 means X was split again
            m = re.search(r"\((\d+)x(\d+) and (\d+)x(\d+)\)", p["shape error"])
            if m and int(m[2]) * 2 == int(m[3]):
                require(mistake("split X although input_is_parallel=True (scatter only when input_is_parallel is "
                                "False)", f"tp=2, rank {rank}: the input reached F.linear with {m[2]} features, the "
                                          f"weight has {m[3]} (in/t): {p['shape error']}"))
            raise AssertionError(f"tp=2, rank {rank}: RowParallelLinear raised {p['shape error']}")
        require(close(p["y"], p["expected y"], f"tp=2, rank {rank}: RowParallelLinear's output", mistakes={
            "bias added on every rank before the all-reduce (counted t times)": p["expected y"] + p["bias"],
            "forgot the all-reduce (only this rank's partial sum)": p["this rank's partial"] + p["bias"]}))
        s = r["sp"]
        _shape_named(s["y"], s["expected y"].shape, {"all-reduced under sequence_parallel instead of reduce-scattering "
                                                     "along the sequence": (4, 2, 6)},
                     f"tp=2, rank {rank}: RowParallelLinear's output with sequence_parallel")
        require(close(s["y"], s["expected y"], f"tp=2, rank {rank}: RowParallelLinear's output with sequence_parallel"))


@pytest.mark.exercise("tp.vocab_embedding")
def test_quick_vocab_parallel_embedding_zeros_other_rows(quick):
    res = quick_results(quick, "tp.vocab_embedding", known={
        "index out of range": "looked up ids of other ranks' rows (shift by vocab_start_index and send the outside "
                              "ids to a valid local row before F.embedding)"})
    ranges = [(res[r]["start"], res[r]["end"]) for r in sorted(res)]
    for rank, r in res.items():
        ids, master = r["ids"], r["master"]
        expected = F.embedding(ids, master)
        inside = [((ids >= a) & (ids < b)).unsqueeze(-1) for a, b in ranges]
        not_zeroed = sum(torch.where(m, expected, master[a]) for m, (a, _) in zip(inside, ranges))
        mine = torch.where(inside[rank], expected, 0.0)
        require(close(r["y"], expected, f"tp=2, rank {rank}: VocabParallelEmbedding's output for ids {ids.tolist()}",
                      mistakes={"did not zero the rows of ids outside this rank's vocabulary range": not_zeroed,
                                "forgot the all-reduce (each rank has only the rows it owns)": mine}))


def _ce_variants(logits, target, t=2, rank=0):
    """What F.cross_entropy gives, and what the typical mistakes of the vocab-parallel forward give (on `rank`)."""
    n = logits.shape[-1] // t
    shards = logits.split(n, -1)
    z_y = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    m = logits.max(-1).values
    local_m = [s.max(-1).values for s in shards]
    owner = target // n
    m_owner = torch.stack(local_m).gather(0, owner.unsqueeze(0)).squeeze(0)
    sum_local = sum((s - lm.unsqueeze(-1)).exp().sum(-1) for s, lm in zip(shards, local_m))
    others = sum(torch.where(owner != r, shards[r][:, 0] - m, 0.0) for r in range(t))
    return {"right": F.cross_entropy(logits, target, reduction="none"),
            "local max": sum_local.log() - (z_y - m_owner),
            "unmasked": torch.logsumexp(logits, -1) - z_y - others,
            "local sum": torch.logsumexp(shards[rank], -1) - z_y,
            "smoothed": F.cross_entropy(logits, target, reduction="none", label_smoothing=0.1),
            # the smoothing term sum_z / V with V/t for V: a (lse - m - t (mean z - m)) in place of a (lse - mean z)
            "smoothed over V/t": 0.9 * (torch.logsumexp(logits, -1) - z_y) + 0.1 * (
                torch.logsumexp(logits, -1) - m - t * (logits.mean(-1) - m))}


@pytest.mark.exercise("tp.vocab_cross_entropy")
def test_quick_vocab_parallel_cross_entropy_forward(quick):
    res = quick_results(quick, "tp.vocab_cross_entropy")
    for rank, r in res.items():
        v = _ce_variants(r["logits"], r["target"], rank=rank)
        require(close(r["plain"], v["right"], f"tp=2, rank {rank}: the per-token loss of logits [5, 8] split in 2",
                      rtol=1e-4, atol=1e-5, mistakes={
            "subtracted each rank's own max, not the max over the TP group (all-reduce MAX)": v["local max"],
            "target logit not masked to 0 on the ranks that do not own the target (each rank added one)":
                v["unmasked"],
            "the sum of exp not all-reduced: log S of this rank's vocabulary slice only": v["local sum"]}))
        require(close(r["smoothed"], v["smoothed"], f"tp=2, rank {rank}: the per-token loss with label_smoothing=0.1 "
                      "vs F.cross_entropy's", rtol=1e-4, atol=1e-5, mistakes={
            "the smoothing term divides by this rank's V/t, not the whole vocabulary V (ctx.vocab_size = t * V/t)":
                v["smoothed over V/t"]}))
        if not torch.isfinite(r["large logits"]).all():
            require(mistake("skipped the max subtraction: exp overflows for large logits",
                            f"rank {rank}: the loss of logits + 1000 is {r['large logits'].tolist()}"))
        require(close(r["large logits"], v["right"], f"tp=2, rank {rank}: the loss of logits + 1000 (the same loss)",
                      rtol=1e-4, atol=1e-4))


@pytest.mark.exercise("tp.vocab_cross_entropy_backward")
def test_quick_vocab_parallel_cross_entropy_backward(quick):
    res = quick_results(quick, "tp.vocab_cross_entropy_backward")
    for rank, r in res.items():
        logits, target, w = r["logits"], r["target"], r["weights"]
        n = logits.shape[-1] // 2
        onehot = F.one_hot(target, logits.shape[-1]).float()
        full = (logits.softmax(-1) - onehot) * w.unsqueeze(-1)
        mine = full[:, rank * n:(rank + 1) * n]
        foreign = (target // n != rank).float()
        at0 = torch.zeros_like(mine)
        at0[:, 0] = foreign * w
        unscaled = (logits.softmax(-1) - onehot)[:, rank * n:(rank + 1) * n]
        require(close(r["grad"], mine, f"tp=2, rank {rank}: d(sum_i w_i loss_i)/d logits on this rank's vocab slice",
                      mistakes={"one-hot not masked where the target lives on another rank (subtracted 1 at local "
                                "index 0)": mine - at0,
                                "forgot to multiply by grad_output": unscaled,
                                "sign flipped: onehot - softmax instead of softmax - onehot": -mine}))
        a, V = 0.1, logits.shape[-1]
        smoothed = ((logits.softmax(-1) - (1 - a) * onehot - a / V) * w.unsqueeze(-1))[:, rank * n:(rank + 1) * n]
        require(close(r["smoothed grad"], smoothed, f"tp=2, rank {rank}: the same gradient with label_smoothing=0.1 "
                      "(softmax - 0.9 onehot - 0.1/V)", mistakes={
                          "a / (V/t): the smoothing spreads over the whole vocabulary V, not this rank's slice":
                              smoothed - a / V * w.unsqueeze(-1)}))  # 2a/V in place of a/V


# ------------------------------------------------------------------ multi-rank
@pytest.mark.integration
@pytest.mark.exercise("tp.copy_to_region")
@pytest.mark.exercise("tp.reduce_from_region")
@pytest.mark.exercise("tp.gather_last_dim")
def test_tensor_parallel_mappings(runs):
    _assert_close(runs, "mappings", ("copy_to", "reduce_from", "scatter_to", "gather_from"))


@pytest.mark.integration
@pytest.mark.exercise("tp.sp_gather")
@pytest.mark.exercise("tp.sp_reduce_scatter")
def test_sequence_parallel_mappings(runs):
    _assert_close(runs, "mappings", ("sp ",))


@pytest.mark.integration
@pytest.mark.exercise("tp.copy_to_region")
@pytest.mark.exercise("tp.reduce_from_region")
@pytest.mark.exercise("tp.sp_gather")
@pytest.mark.exercise("tp.sp_reduce_scatter")
@pytest.mark.exercise("tp.column_forward")
@pytest.mark.exercise("tp.row_forward")
@pytest.mark.exercise("tp.gather_last_dim")
def test_parallel_mlp_equals_single_device(runs):
    _assert_close(runs, "mlp")
    require(equal(sorted(runs), [1, 2, 4], "the tensor-parallel sizes that ran"))


@pytest.mark.integration
@pytest.mark.exercise("tp.reduce_from_region")
@pytest.mark.exercise("tp.vocab_embedding")
def test_vocab_parallel_embedding(runs):
    _assert_close(runs, "embedding")


@pytest.mark.integration
@pytest.mark.exercise("tp.vocab_cross_entropy")
@pytest.mark.exercise("tp.vocab_cross_entropy_backward")
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(runs):
    _assert_close(runs, "cross_entropy")


@pytest.mark.integration
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
    require(equal(len(runs[4]["gpt"][0]), 2 * len(GPT_VARIANTS), "the number of GPT cases run at tp=4 (variants x sp)"))


@pytest.mark.integration
@pytest.mark.exercise("tp.vocab_cross_entropy_backward")
def test_vocab_parallel_cross_entropy_backward_communicates_nothing(runs):
    for t, cases in runs.items():
        for rank, result in cases["cross_entropy"].items():
            require_no_error(f"tp={t}, rank {rank}, the cross_entropy case", result.get("error"))
            for smoothing in (0.0, 0.1):
                counts = result[f"cross_entropy smoothing={smoothing} backward collectives"]
                require(equal(counts, {}, f"tp={t}, rank {rank}, label_smoothing={smoothing}: the collectives the "
                                          "backward of vocab_parallel_cross_entropy issues (softmax - onehot is "
                                          "local: it needs none)"))


@pytest.mark.integration
@pytest.mark.exercise("tp.copy_to_region")
@pytest.mark.exercise("tp.reduce_from_region")
@pytest.mark.exercise("tp.column_forward")
@pytest.mark.exercise("tp.row_forward")
def test_same_mlp_as_dtensor_colwise_rowwise(runs):
    _assert_close(runs, "dtensor")
    assert "dtensor" in runs[2] and "dtensor" in runs[4], "the DTensor comparison did not run at tp=2 and tp=4"


# one kind of collective, whichever of PyTorch's names issued it (all_gather_single is Megatron's
# all_gather_into_tensor; a list all_gather moves the same bytes)
KINDS = {"all_reduce": "all-reduce", "all_gather": "all-gather", "all_gather_single": "all-gather",
         "all_gather_into_tensor": "all-gather", "reduce_scatter_single": "reduce-scatter",
         "reduce_scatter_tensor": "reduce-scatter", "isend": "isend"}


def _kinds(counts):
    out = {}
    for name, n in counts.items():
        out[KINDS.get(name, name)] = out.get(KINDS.get(name, name), 0) + n
    return out


@pytest.mark.integration
@pytest.mark.exercise("tp.copy_to_region")
@pytest.mark.exercise("tp.reduce_from_region")
@pytest.mark.exercise("tp.sp_gather")
@pytest.mark.exercise("tp.sp_reduce_scatter")
@pytest.mark.exercise("tp.column_forward")
@pytest.mark.exercise("tp.row_forward")
def test_collective_bytes_per_layer_equal_narayanan(runs):
    for t, cases in runs.items():
        for rank, result in cases["comm"].items():
            require_no_error(f"tp={t}, rank {rank}, one transformer layer's collectives", result.get("error"))
            plain, sp = result["sp=False"], result["sp=True"]
            where = f"tp={t}, rank {rank}, one transformer layer's forward + backward"
            require(equal(plain["wire"], plain["formula"], f"{where}: the bytes sent by the collectives (fp32, ring "
                                                            "algorithm; Narayanan: 8 b s h (t-1)/t)"))
            if t == 1:
                require(equal(_kinds(plain["counts"]), {}, f"{where}: the collectives issued at tp=1"))
                require(equal(_kinds(sp["counts"]), {}, f"{where}: the collectives issued at tp=1 with sequence "
                                                        "parallelism"))
                require(equal(sp["wire"], 0, f"{where}: the bytes sent at tp=1 with sequence parallelism"))
                continue
            require(equal(_kinds(plain["counts"]), {"all-reduce": 4}, f"{where}: the collectives issued (2 "
                          "all-reduces forward, after the attention and the MLP; 2 backward, before them)"))
            # SP: 2 all-gathers + 2 reduce-scatters forward, the same backward: the paper's equal volume;
            # plus 2 all-gathers that re-gather the column-parallel inputs kept sharded for backward
            require(equal(_kinds(sp["counts"]), {"all-gather": 6, "reduce-scatter": 4},
                          f"{where} with sequence parallelism: the collectives issued (forward 2 all-gathers + 2 "
                          "reduce-scatters; backward the same, plus 2 all-gathers of the column-parallel inputs)"))
            one_gather = plain["formula"] / 8
            require(equal(sp["wire"], plain["formula"] + 2 * one_gather,
                          f"{where} with sequence parallelism: the bytes sent by the collectives (the plain "
                          "layer's, plus 2 all-gathers of the input)"))


def test_clear_error_when_sizes_do_not_divide(runs):
    for t in (2, 4):
        message = runs[t]["errors"][0]
        assert "not divisible by the tensor-parallel size" in message, (
            f"tp={t}: ColumnParallelLinear(8, {7 * t + 1}) should raise a ValueError saying the size is "
            f"'not divisible by the tensor-parallel size'; it said: {message}")
