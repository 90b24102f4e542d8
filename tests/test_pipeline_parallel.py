"""Pipeline schedules (pure), and the executor against the unpipelined model and torch.distributed.pipelining."""

from collections import Counter

import pytest
import torch

from megalab import launch
from megalab import pipeline_parallel as pp
from megalab.pipeline_parallel import Op

CASES = [(p, m, 1, kind) for kind in ("gpipe", "1f1b") for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]
CASES += [(p, m, v, "interleaved") for p in (2, 3, 4) for v in (2, 3) for m in (p, 2 * p, 3 * p)]


# ------------------------------------------------------------------ schedules, no processes
@pytest.mark.exercise("pp.num_warmup")
def test_warmup_matches_megatron():
    # 1F1B: min(pp - rank - 1, m)
    assert [pp.get_num_warmup_microbatches(4, r, 8) for r in range(4)] == [3, 2, 1, 0]
    assert [pp.get_num_warmup_microbatches(4, r, 2) for r in range(4)] == [2, 2, 1, 0]
    assert pp.get_num_warmup_microbatches(1, 0, 5) == 0
    # interleaved: (pp - rank - 1) * 2 + (v - 1) * pp, capped at v * m (get_pp_rank_microbatches)
    assert [pp.get_num_warmup_microbatches(4, r, 8, 2) for r in range(4)] == [10, 8, 6, 4]
    assert [pp.get_num_warmup_microbatches(2, r, 4, 3) for r in range(2)] == [6, 4]
    assert [pp.get_num_warmup_microbatches(4, r, 4, 2) for r in range(4)] == [8, 8, 6, 4]


@pytest.mark.exercise("pp.schedule_table")
def test_schedule_table_matches_megatron_docstring():
    # "the tunable schedule table for PP2 N3M5 with VP2" in Megatron's schedules.py
    mbs, chunks = zip(*pp.get_schedule_table(5, 2, 3))
    assert mbs == (0, 1, 2, 0, 1, 2, 3, 4, 3, 4)
    assert chunks == (0, 0, 0, 1, 1, 1, 0, 0, 1, 1)


@pytest.mark.exercise("pp.num_warmup")
@pytest.mark.exercise("pp.schedule_table")
@pytest.mark.exercise("pp.one_f_one_b")
def test_schedules_are_complete_ordered_and_deadlock_free():
    for p, m, v, kind in CASES:
        for rank in range(p):
            ops = pp.get_schedule(p, rank, m, v, kind)
            assert Counter(ops) == Counter(Op(k, mb, c) for k in "FB" for mb in range(m) for c in range(v)), ops
            assert all(ops.index(Op("F", mb, c)) < ops.index(Op("B", mb, c)) for mb in range(m) for c in range(v))
            forwards = [op for op in ops if op.kind == "F"]
            if kind == "interleaved":
                assert [(op.microbatch, op.chunk) for op in forwards] == pp.get_schedule_table(m, v, p)
            else:
                assert [op.microbatch for op in forwards] == list(range(m))
            if kind == "gpipe":
                assert ops[:m] == forwards
            else:  # warmup forwards, then strictly F B F B ..., then backwards
                warmup = pp.get_num_warmup_microbatches(p, rank, m, v)
                first_b = next(i for i, op in enumerate(ops) if op.kind == "B")
                assert first_b == warmup + (warmup < m * v)
                steady = ops[warmup:warmup + 2 * (m * v - warmup)]
                assert [op.kind for op in steady] == ["F", "B"] * (m * v - warmup)
        pp.simulate(p, m, v, kind)  # raises on deadlock


@pytest.mark.exercise("pp.num_warmup")
@pytest.mark.exercise("pp.schedule_table")
@pytest.mark.exercise("pp.one_f_one_b")
def test_p2p_streams_match_in_order():
    """Between two ranks, activations (and separately gradients) are received in the order they are sent."""
    for p, m, v, kind in CASES:
        if p == 1:
            continue
        streams = {}
        for rank in range(p):
            for op in pp.get_schedule(p, rank, m, v, kind):
                stage = pp.virtual_stage(p, rank, op.chunk)
                if op.kind == "F" and stage < p * v - 1:
                    streams.setdefault(("act", rank, (rank + 1) % p, "send"), []).append((op.microbatch, stage + 1))
                if op.kind == "F" and stage > 0:
                    streams.setdefault(("act", (rank - 1) % p, rank, "recv"), []).append((op.microbatch, stage))
                if op.kind == "B" and stage > 0:
                    streams.setdefault(("grad", rank, (rank - 1) % p, "send"), []).append((op.microbatch, stage - 1))
                if op.kind == "B" and stage < p * v - 1:
                    streams.setdefault(("grad", (rank + 1) % p, rank, "recv"), []).append((op.microbatch, stage))
        for (what, src, dst, direction), items in streams.items():
            if direction == "send":
                assert items == streams[(what, src, dst, "recv")], (p, m, v, kind, what, src, dst)


@pytest.mark.exercise("pp.one_f_one_b")
def test_no_pipelining_is_gradient_accumulation():
    expected = [Op(k, mb) for mb in range(3) for k in "FB"]
    assert pp.get_schedule(1, 0, 3, kind="none") == expected == pp.get_schedule(1, 0, 3, kind="1f1b")
    with pytest.raises(ValueError, match="pp_size == 1"):
        pp.get_schedule(2, 0, 3, kind="none")


def test_deallocated_output_still_backpropagates():
    torch.manual_seed(0)
    layer, x, grad = torch.nn.Linear(8, 8), torch.randn(3, 8, requires_grad=True), torch.randn(3, 8)
    torch.tanh(layer(x)).backward(grad)
    expected = x.grad.clone()
    x.grad = None
    out = torch.tanh(layer(x))
    pp.deallocate_output_tensor(out)
    assert out.numel() == 1
    pp.custom_backward(out, grad)
    assert torch.allclose(x.grad, expected)
    with pytest.raises(ValueError, match="view"):
        pp.deallocate_output_tensor(layer(x)[0])


def test_interleaved_needs_a_multiple_of_pp():
    with pytest.raises(ValueError, match="multiple of it"):
        pp.get_schedule(4, 0, 6, 2, "interleaved")
    with pytest.raises(ValueError, match="use kind='interleaved'"):
        pp.get_schedule(4, 0, 8, 2, "1f1b")
    with pytest.raises(ValueError, match="unknown schedule"):
        pp.get_schedule(4, 0, 8, 1, "zero-bubble")


@pytest.mark.exercise("pp.one_f_one_b")
def test_simulated_bubble_and_memory_match_theory():
    for p, m, v, kind in CASES:
        records = pp.simulate(p, m, v, kind, forward_time=1 / v, backward_time=2 / v)
        if kind != "gpipe" or v == 1:
            assert pp.measured_bubble(records) == pytest.approx(pp.bubble_fraction_of_total(p, m, v)), (p, m, v, kind)
        peaks = [pp.peak_in_flight(pp.get_schedule(p, r, m, v, kind)) for r in range(p)]
        if kind == "gpipe":
            assert peaks == [m] * p
        elif kind == "1f1b":
            assert peaks == [min(p - r, m) for r in range(p)]
    assert pp.bubble_fraction(4, 8) == pytest.approx(3 / 8) and pp.bubble_fraction(4, 8, 2) == pytest.approx(3 / 16)


@pytest.mark.exercise("pp.stage_split")
def test_layer_ranges_tile_the_model():
    assert [pp.get_layer_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # interleaved: chunk k on rank r is virtual stage k * pp + r
    assert [pp.get_layer_range(8, 2, r, c, 2) for c in range(2) for r in range(2)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="multiple of 6"):
        pp.get_layer_range(8, 3, 0, 0, 2)


# ------------------------------------------------------------------ real pipelines on 4 ranks
CONFIGS = [(4, "gpipe", 1), (4, "1f1b", 1), (4, "interleaved", 2), (2, "gpipe", 1), (2, "1f1b", 1),
           (2, "interleaved", 2)]
TINY = dict(num_layers=8, hidden_size=32, num_attention_heads=4, vocab_size=53, seq_length=8,
            hidden_dropout=0.0, attention_dropout=0.0)


def _data(num_microbatches, micro_batch_size=2):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY["vocab_size"], (num_microbatches * micro_batch_size, TINY["seq_length"] + 1),
                           generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _gpt(**overrides):
    from megalab.config import TransformerConfig
    from megalab.model import GPTModel

    torch.manual_seed(0)
    return GPTModel(TransformerConfig(**{**TINY, **overrides}))


def _matches_unpipelined_worker(num_microbatches):
    from megalab import dist as mdist
    from megalab import parallel_state

    mdist.init()
    m = num_microbatches
    x, y = _data(m)
    inputs, targets = list(x.chunk(m)), list(y.chunk(m))
    out = {}
    for tied in (True, False):
        ref = _gpt(share_embeddings_and_output_weights=tied)
        ref_loss = sum(_loss(ref(a), b) for a, b in zip(inputs, targets)) / m
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        for size, kind, v in CONFIGS:
            state = parallel_state.initialize_model_parallel(pipeline_model_parallel_size=size)
            rank = state.get_pipeline_model_parallel_rank()
            model = _gpt(share_embeddings_and_output_weights=tied)
            chunks = pp.build_gpt_stages(model, size, rank, v)
            shape = (TINY["seq_length"], x.shape[0] // m, TINY["hidden_size"])
            res = pp.forward_backward_pipelining(chunks, inputs, targets, _loss, shape, kind=kind,
                                                 group=state.get_pipeline_model_parallel_group())
            if state.is_rank_in_embedding_group():
                pp.allreduce_word_embedding_grads(model, state.get_embedding_group())
            owned = {id(p) for c in chunks for p in c.parameters()}
            names = [n for n, p in model.named_parameters() if id(p) in owned]
            ok = all(torch.allclose(dict(model.named_parameters())[n].grad, ref_grads[n], atol=1e-5, rtol=1e-5)
                     for n in names)
            ok &= all(p.grad is None for p in model.parameters() if id(p) not in owned)
            if state.is_pipeline_last_stage():
                ok &= abs(sum(res.losses) / m - ref_loss.item()) < 1e-5
            ops = pp.get_schedule(size, rank, m, v, kind)
            ok &= [r.op for r in res.timeline] == ops
            ok &= res.peak_in_flight == pp.peak_in_flight(ops)
            out[(tied, size, kind, v)] = (ok, names, res.peak_in_flight)
            parallel_state.destroy_model_parallel()
    torch.distributed.barrier()
    return out


@pytest.mark.exercise("pp.communicate")
@pytest.mark.exercise("pp.stage_split")
@pytest.mark.exercise("pp.one_f_one_b")
@pytest.mark.exercise("pp.schedule_table")
@pytest.mark.exercise("pp.num_warmup")
def test_pipelined_gpt_matches_unpipelined():
    m = 4
    res = launch.run_function(_matches_unpipelined_worker, 4, m, launch=dict(timeout=240))
    all_names = {n for n, _ in _gpt().named_parameters()}
    for key in res.returns[0]:
        tied, size, kind, v = key
        assert all(res.returns[r][key][0] for r in range(4)), (key, {r: res.returns[r][key][0] for r in range(4)})
        covered = set().union(*(res.returns[r][key][1] for r in range(4)))  # each pipeline covers the model
        expected = all_names if tied else set(n for n, _ in _gpt(share_embeddings_and_output_weights=False)
                                              .named_parameters())
        assert covered == expected, key
        peaks = [res.returns[r][key][2] for r in range(4)]  # pp rank = rank // (4 // size) (order tp-cp-ep-dp-pp)
        if kind == "gpipe":
            assert peaks == [m] * 4
        elif kind == "1f1b":
            assert peaks == [min(size - r // (4 // size), m) for r in range(4)]


def _torch_pipelining_worker(num_microbatches):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from megalab import dist as mdist

    rank, world = mdist.init()
    m = num_microbatches
    x, y = _data(m)
    ref = _gpt()
    ref_loss = (sum(_loss(ref(a), b) for a, b in zip(x.chunk(m), y.chunk(m))) / m).item()
    out = {}
    for name, cls, v in (("gpipe", ScheduleGPipe, 1), ("1f1b", Schedule1F1B, 1),
                         ("interleaved", ScheduleInterleaved1F1B, 2)):
        model = _gpt()
        chunks = pp.build_gpt_stages(model, world, rank, v)
        stages = [PipelineStage(c, pp.virtual_stage(world, rank, k), world * v, torch.device("cpu"))
                  for k, c in enumerate(chunks)]
        schedule = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=_loss)
        losses = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        out[name] = abs(sum(losses) / m - ref_loss) < 1e-5 if rank == world - 1 else True
    torch.distributed.barrier()
    return out


@pytest.mark.exercise("pp.stage_split")
def test_torch_pipelining_gives_the_same_loss():
    res = launch.run_function(_torch_pipelining_worker, 4, 4, launch=dict(timeout=180))
    assert all(all(r.values()) for r in res.returns.values()), res.returns
