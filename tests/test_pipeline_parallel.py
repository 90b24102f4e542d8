"""Pipeline schedules (pure), and the executor against the unpipelined model and torch.distributed.pipelining."""

from collections import Counter

import pytest
import torch

from megalab.core.distributed.finalize_model_grads import allreduce_word_embedding_grads
from megalab.core.models.gpt.gpt_model import build_gpt_stages
from megalab.core.pipeline_parallel import schedules as pp
from megalab.core.pipeline_parallel.schedules import Op
from megalab.core.transformer.transformer_block import get_layer_range
from megalab.extras.pipeline_sim import (
    bubble_fraction,
    bubble_fraction_of_total,
    measured_bubble,
    peak_in_flight,
    simulate,
)
from megalab.lab import launch
from tests.ch03_checks import check_num_warmup, check_schedule_table, named_equal, require_schedule_pieces
from tests.feedback import equal, max_error, require, require_within

CASES = [(p, m, 1, kind) for kind in ("gpipe", "1f1b") for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]
CASES += [(p, m, v, "interleaved") for p in (2, 3, 4) for v in (2, 3) for m in (p, 2 * p, 3 * p)]


# ------------------------------------------------------------------ schedules, no processes
def _require_warmups(p, m, v, expected, rule):
    got = [pp.get_num_warmup_microbatches(p, r, m, v) for r in range(p)]
    require(equal(got, expected, f"get_num_warmup_microbatches(pp={p}, rank, m={m}{f', v={v}' if v > 1 else ''}) "
                                 f"for ranks 0..{p - 1} ({rule})"))


@pytest.mark.exercise("pp.num_warmup")
def test_warmup_matches_megatron():
    require(check_num_warmup())  # names the likely mistake (off by one, no cap, interleaved terms)
    one_f_one_b = "1F1B: min(pp - rank - 1, m)"
    _require_warmups(4, 8, 1, [3, 2, 1, 0], one_f_one_b)
    _require_warmups(4, 2, 1, [2, 2, 1, 0], one_f_one_b)
    _require_warmups(1, 5, 1, [0], one_f_one_b)
    interleaved = "interleaved: (pp - rank - 1) * 2 + (v - 1) * pp, capped at v * m"  # get_pp_rank_microbatches
    _require_warmups(4, 8, 2, [10, 8, 6, 4], interleaved)
    _require_warmups(2, 4, 3, [6, 4], interleaved)
    _require_warmups(4, 4, 2, [8, 8, 6, 4], interleaved)


@pytest.mark.exercise("pp.schedule_table")
def test_schedule_table_matches_megatron_docstring():
    require(check_schedule_table())  # names the likely mistake (loops swapped, groups ignored, last group)
    # "the tunable schedule table for PP2 N3M5 with VP2" in Megatron's schedules.py
    table = pp.get_schedule_table(5, 2, 3)
    require(equal([tuple(pair) for pair in table], [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0),
                                                    (3, 1), (4, 1)],
                  "get_schedule_table(m=5, v=2, group_size=3) as (microbatch, chunk) pairs (groups of 3 micro-batches; "
                  "inside a group every chunk in turn)"))


def _case(p, rank, m, v, kind):
    return f"the {kind} schedule of rank {rank} (pp={p}, m={m}{f', v={v}' if v > 1 else ''})"


@pytest.mark.exercise("pp.num_warmup")
@pytest.mark.exercise("pp.schedule_table")
@pytest.mark.exercise("pp.one_f_one_b")
def test_schedules_are_complete_ordered_and_deadlock_free():
    require_schedule_pieces()  # a wrong piece is named before the schedules it builds are checked
    for p, m, v, kind in CASES:
        for rank in range(p):
            ops = pp.get_schedule(p, rank, m, v, kind)
            where = _case(p, rank, m, v, kind)
            expected = Counter(Op(k, mb, c) for k in "FB" for mb in range(m) for c in range(v))
            missing, extra = sorted(expected - Counter(ops)), sorted(Counter(ops) - expected)
            assert not missing and not extra, (
                f"{where} is {ops}: it should run one forward and one backward of every (micro-batch, chunk); "
                f"missing {missing}, extra {extra}")
            early = [(mb, c) for mb in range(m) for c in range(v) if ops.index(Op("B", mb, c)) < ops.index(Op("F", mb, c))]
            assert not early, f"{where} is {ops}: the backward of (micro-batch, chunk) {early[0]} runs before its forward"
            forwards = [op for op in ops if op.kind == "F"]
            if kind == "interleaved":
                require(equal([(op.microbatch, op.chunk) for op in forwards], pp.get_schedule_table(m, v, p),
                              f"{where}: the order of its forwards as (micro-batch, chunk) pairs vs "
                              f"get_schedule_table(m={m}, v={v}, group_size={p})"))
            else:
                require(equal([op.microbatch for op in forwards], list(range(m)),
                              f"{where}: the micro-batches of its forwards, in order"))
            if kind == "gpipe":
                require(equal(ops[:m], forwards, f"{where}: its first {m} ops (GPipe: all forwards, then all backwards)"))
            else:  # warmup forwards, then strictly F B F B ..., then backwards
                warmup = pp.get_num_warmup_microbatches(p, rank, m, v)
                first_b = next(i for i, op in enumerate(ops) if op.kind == "B")
                require(equal(first_b, warmup + (warmup < m * v),
                              f"{where} is {ops}: the position of its first backward (after the {warmup} warmup "
                              f"forwards{' and one steady-state forward' if warmup < m * v else ''})"))
                steady = ops[warmup:warmup + 2 * (m * v - warmup)]
                require(equal("".join(op.kind for op in steady), "FB" * (m * v - warmup),
                              f"{where} is {ops}: the kinds of its {2 * (m * v - warmup)} ops after the {warmup} "
                              "warmup forwards (steady state: one forward, then one backward)"))
        try:
            simulate(p, m, v, kind)  # raises on deadlock
        except Exception as e:
            raise AssertionError(f"the {kind} schedules (pp={p}, m={m}, v={v}) deadlock or fail when run together: "
                                 f"{type(e).__name__}: {e}") from e


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
                received = streams.get((what, src, dst, "recv"), [])
                words = "activations" if what == "act" else "gradients"
                assert items == received, (
                    f"the {kind} schedules (pp={p}, m={m}, v={v}): rank {src} sends {words} to rank {dst} for "
                    f"(micro-batch, stage) {items}, but rank {dst} receives them in the order {received}")


@pytest.mark.exercise("pp.one_f_one_b")
def test_no_pipelining_is_gradient_accumulation():
    expected = [Op(k, mb) for mb in range(3) for k in "FB"]
    require(equal(pp.get_schedule(1, 0, 3, kind="none"), expected, "get_schedule(pp=1, m=3, kind='none')"))
    require(equal(pp.get_schedule(1, 0, 3, kind="1f1b"), expected,
                  "get_schedule(pp=1, m=3, kind='1f1b') (one stage: no warmup, F B F B F B)"))
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
        records = simulate(p, m, v, kind, forward_time=1 / v, backward_time=2 / v)
        if kind != "gpipe" or v == 1:
            bubble, theory = measured_bubble(records), bubble_fraction_of_total(p, m, v)
            assert bubble == pytest.approx(theory), (
                f"the {kind} schedules (pp={p}, m={m}, v={v}) simulated: the bubble is {bubble:.4g} of the step, "
                f"theory (p-1)/(v m + p-1) says {theory:.4g}")
        peaks = [peak_in_flight(pp.get_schedule(p, r, m, v, kind)) for r in range(p)]
        if kind == "gpipe":
            require(equal(peaks, [m] * p, f"the most micro-batches in flight per rank, GPipe (pp={p}, m={m}; all m)"))
        elif kind == "1f1b":
            require(equal(peaks, [min(p - r, m) for r in range(p)],
                          f"the most micro-batches in flight per rank, 1F1B (pp={p}, m={m}; min(pp - rank, m))"))
    assert bubble_fraction(4, 8) == pytest.approx(3 / 8) and bubble_fraction(4, 8, 2) == pytest.approx(3 / 16)


@pytest.mark.exercise("pp.stage_split")
def test_layer_ranges_tile_the_model():
    def ranges(num_layers, p, v, start, per, inclusive=False):  # [(start, stop)] for (chunk, rank), chunk-major
        return [(start(r, c) * per, (start(r, c) + 1) * per - inclusive) for c in range(v) for r in range(p)]

    def mistakes(num_layers, p, v):
        per = num_layers // (p * v)
        return {"off by one: the stop is inclusive (start + per_stage - 1), the ranges should be half-open":
                ranges(num_layers, p, v, lambda r, c: c * p + r, per, inclusive=True),
                "virtual stage pp_rank * v + chunk (a rank's chunks adjacent) instead of chunk * pp_size + pp_rank":
                ranges(num_layers, p, v, lambda r, c: r * v + c, per),
                "layers per stage num_layers // pp_size: the model chunks (v) left out of the split":
                [(x * num_layers // p, x * num_layers // p + num_layers // p) for x in
                 (c * p + r for c in range(v) for r in range(p))]}

    require(named_equal([get_layer_range(8, 4, r) for r in range(4)], [(0, 2), (2, 4), (4, 6), (6, 8)],
                        "get_layer_range(8 layers, pp=4, rank) for ranks 0..3", mistakes(8, 4, 1)))
    # interleaved: chunk k on rank r is virtual stage k * pp + r
    require(named_equal([get_layer_range(8, 2, r, c, 2) for c in range(2) for r in range(2)],
                        [(0, 2), (2, 4), (4, 6), (6, 8)],
                        "get_layer_range(8 layers, pp=2, rank, chunk, v=2) for (chunk, rank) = (0, 0), (0, 1), (1, 0), "
                        "(1, 1) (chunk k on rank r is virtual stage k * pp + r)", mistakes(8, 2, 2)))
    with pytest.raises(ValueError, match="multiple of 6"):
        get_layer_range(8, 3, 0, 0, 2)


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
    from megalab.core.models.gpt.gpt_model import GPTModel
    from megalab.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    return GPTModel(TransformerConfig(**{**TINY, **overrides}))


def _matches_unpipelined_worker(num_microbatches):
    from megalab.core import parallel_state
    from megalab.lab import dist as mdist

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
            chunks = build_gpt_stages(model, size, rank, v)
            shape = (TINY["seq_length"], x.shape[0] // m, TINY["hidden_size"])
            res = pp.forward_backward_pipelining(chunks, inputs, targets, _loss, shape, kind=kind,
                                                 group=state.get_pipeline_model_parallel_group())
            if state.is_rank_in_embedding_group():
                allreduce_word_embedding_grads(model, state.get_embedding_group())
            owned = {id(p) for c in chunks for p in c.parameters()}
            params = dict(model.named_parameters())
            names = [n for n, p in params.items() if id(p) in owned]
            errors = {}  # quantity -> max abs difference from the unpipelined model (or why not comparable)
            if state.is_pipeline_last_stage():
                errors["the mean loss"] = abs(sum(res.losses) / m - ref_loss.item()) if res.losses else "is missing"
            for n in names:  # allclose(atol=rtol=1e-5); when it fails, the largest difference (> 1e-5 then)
                err = max_error(params[n].grad, ref_grads[n])
                if not isinstance(err, str) and torch.allclose(params[n].grad, ref_grads[n], atol=1e-5, rtol=1e-5):
                    err = 0.0
                errors[f"the gradient of {n}"] = err
            stray = [n for n, p in params.items() if id(p) not in owned and p.grad is not None]
            ops = pp.get_schedule(size, rank, m, v, kind)
            out[(tied, size, kind, v)] = dict(errors=errors, names=names, stray=stray, ran=[r.op for r in res.timeline],
                                              ops=ops, peak=res.peak_in_flight, expected_peak=peak_in_flight(ops))
            parallel_state.destroy_model_parallel()
    torch.distributed.barrier()
    return out


@pytest.mark.integration
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
        stages = 4 // size  # pp rank = rank // (4 // size) (order tp-cp-ep-dp-pp)
        for r in range(4):
            got = res.returns[r][key]
            where = (f"pp={size} {kind}{f' (v={v})' if v > 1 else ''}, {'tied' if tied else 'untied'} embeddings, "
                     f"rank {r} (stage {r // stages})")
            require(equal(got["ran"], got["ops"], f"{where}: the ops the executor ran, in order, vs get_schedule's"))
            require_within(got["errors"], 1e-5, where=where, against="the unpipelined model's")
            assert not got["stray"], (f"{where}: parameters of other stages got gradients: {got['stray'][:3]}"
                                      f"{' ...' if len(got['stray']) > 3 else ''}")
            require(equal(got["peak"], got["expected_peak"], f"{where}: the most micro-batches in flight "
                                                             "(forward run, backward not yet) vs its schedule's"))
        covered = set().union(*(res.returns[r][key]["names"] for r in range(4)))  # each pipeline covers the model
        expected = all_names if tied else set(n for n, _ in _gpt(share_embeddings_and_output_weights=False)
                                              .named_parameters())
        assert covered == expected, (
            f"pp={size} {kind}, {'tied' if tied else 'untied'} embeddings: the stages together hold "
            f"{len(covered)} of the model's {len(expected)} parameters; missing {sorted(expected - covered)[:3]}, "
            f"foreign {sorted(covered - expected)[:3]}")
        peaks = [res.returns[r][key]["peak"] for r in range(4)]
        if kind == "gpipe":
            require(equal(peaks, [m] * 4, f"pp={size} gpipe: the most micro-batches in flight per rank (all m={m})"))
        elif kind == "1f1b":
            require(equal(peaks, [min(size - r // stages, m) for r in range(4)],
                          f"pp={size} 1f1b: the most micro-batches in flight per rank 0..3 (min(pp - stage, m={m}))"))


def _torch_pipelining_worker(num_microbatches):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from megalab.lab import dist as mdist

    rank, world = mdist.init()
    m = num_microbatches
    x, y = _data(m)
    ref = _gpt()
    ref_loss = (sum(_loss(ref(a), b) for a, b in zip(x.chunk(m), y.chunk(m))) / m).item()
    out = {}
    for name, cls, v in (("gpipe", ScheduleGPipe, 1), ("1f1b", Schedule1F1B, 1),
                         ("interleaved", ScheduleInterleaved1F1B, 2)):
        model = _gpt()
        chunks = build_gpt_stages(model, world, rank, v)
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
        out[name] = abs(sum(float(loss) for loss in losses) / m - ref_loss) if rank == world - 1 else 0.0
    torch.distributed.barrier()
    return out


@pytest.mark.integration
@pytest.mark.exercise("pp.stage_split")
def test_torch_pipelining_gives_the_same_loss():
    res = launch.run_function(_torch_pipelining_worker, 4, 4, launch=dict(timeout=180))
    for rank, errors in res.returns.items():
        for name, err in errors.items():
            require_within({"the mean loss": err}, 1e-5, where=f"torch.distributed.pipelining {name} on our "
                           f"build_gpt_stages (4 stages), rank {rank}", against="the unpipelined model's")
