"""Pipeline layouts (Megatron's pipeline_model_parallel_layout): parsing, checks, offsets, and uneven stages in the
executor (gradients == unpipelined, on a threaded world), the simulator and the p2p model checker."""

import pytest
import torch
import torch.nn.functional as F

from megalab.core.pipeline_parallel import schedules as pp
from megalab.core.transformer.pipeline_parallel_layer_layout import LayerType, PipelineParallelLayerLayout
from megalab.extras import p2p_model
from megalab.extras.pipeline_sim import bubble_fraction_of_total, layout_report, layout_stage_cost, simulate
from megalab.lab.checks import Verdict, all_of, close, equal, require
from tests import threaded_world
from tests.ch03_checks import named_equal

LAYOUTS = [("Et*3|(tt|)*29,m|L", 16), ("Ettt|tt|tt|tL", 4), ("E|t*4|t*4|L", 4), ("Et|tt|ttt|t|t|t|t|L", 4),
           ("Ett|t|tt|t|tt|tL", 2), ("Et|t|t|tL", 1)]


def _virtual_order_offsets(layout):
    """(pp_rank, vp_stage) -> its first decoder layer's index, by walking the stages in model order."""
    pp_size, vpp = layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size
    offsets, seen = {}, 0
    for k in range(pp_size * vpp):
        offsets[(k % pp_size, k // pp_size)] = seen
        seen += layout.layout[k % pp_size][k // pp_size].count(LayerType.decoder)
    return offsets


def _wrong_offsets(layout, keys) -> dict:
    """What the usual slips compute for the stages `keys`, by name."""
    grid, pp_size = layout.layout, layout.pipeline_model_parallel_size
    count = lambda r, v, every=False: len(grid[r][v]) if every else grid[r][v].count(LayerType.decoder)  # noqa: E731
    order = [(k % pp_size, k // pp_size) for k in range(pp_size * layout.virtual_pipeline_model_parallel_size)]
    before = lambda key, every=False: sum(count(*s, every) for s in order[:order.index(key)])  # noqa: E731
    return {"counted rank by rank (all chunks of the earlier ranks), not in virtual-stage order":
            [sum(count(rr, vv) for rr in range(r) for vv in range(len(grid[rr]))) + sum(count(r, vv) for vv in range(v))
             for r, v in keys],
            "counted 'E', 'L' and 'm' as transformer layers": [before((r, v), True) for r, v in keys],
            "counted only this rank's earlier chunks": [sum(count(r, vv) for vv in range(v)) for r, v in keys],
            "included the stage's own layers": [before((r, v)) + count(r, v) for r, v in keys],
            "took the stage's place in model order as pp_rank * v + vp_stage (rank-major), not vp_stage * pp + pp_rank":
            [sum(count(*s) for s in order[:r * layout.virtual_pipeline_model_parallel_size + v]) for r, v in keys]}


def check_layout_offsets() -> Verdict:
    """get_layer_offset on every stage of LAYOUTS vs the walk in model order; names the usual slips."""
    verdicts = []
    for text, pp_size in LAYOUTS:
        layout = PipelineParallelLayerLayout(text, pp_size)
        keys = [(r, v) for r in range(pp_size) for v in range(layout.virtual_pipeline_model_parallel_size)]
        got = [layout.get_layer_offset(vp_stage=v, pp_rank=r) for r, v in keys]
        expected = _virtual_order_offsets(layout)
        verdicts.append(named_equal(got, [expected[k] for k in keys],
                                    f"get_layer_offset for the stages (pp_rank, vp_stage) {keys} of {text!r} (pp={pp_size})",
                                    mistakes=_wrong_offsets(layout, keys)))
    return all_of(*verdicts)


@pytest.mark.exercise("pp.layout_offset")
def test_layer_offsets_follow_the_virtual_stage_order():
    require(check_layout_offsets())
    layout = PipelineParallelLayerLayout("Et*3|(tt|)*29,m|L", 16)
    ids = [i for k in range(32) for i in layout.get_layer_id_list(vp_stage=k // 16, pp_rank=k % 16)]
    require(equal(ids, list(range(61)), "the layer ids of DeepSeek-V3's layout, stage by stage in model order"))


@pytest.mark.exercise("pp.layout_offset")
def test_layout_matches_megatron_core():
    mcore = pytest.importorskip("megalab.lab.mcore").import_mcore
    try:
        M = mcore("megatron.core.transformer.pipeline_parallel_layer_layout").PipelineParallelLayerLayout
        mps = mcore("megatron.core.parallel_state")
    except ImportError:
        pytest.skip("megatron-core is not installed")
    for text, pp_size in LAYOUTS:
        ours, theirs = PipelineParallelLayerLayout(text, pp_size), M(text, pp_size)
        vpp = ours.virtual_pipeline_model_parallel_size
        require(equal([[[t.name for t in s] for s in row] for row in ours.layout],
                      [[[t.name for t in s] for s in row] for row in theirs.layout], f"the parsed stages of {text!r}"))
        require(equal(ours.pretty_repr(), theirs.pretty_repr(), f"pretty_repr of {text!r}"))
        mps.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)  # mcore reads vp_stage only then
        try:
            for r in range(pp_size):
                for v in range(vpp):
                    require(equal(ours.get_layer_id_list(vp_stage=v, pp_rank=r),
                                  theirs.get_layer_id_list(vp_stage=v, pp_rank=r),
                                  f"the layer ids of stage (pp_rank={r}, vp_stage={v}) of {text!r}"))
        finally:
            mps.set_virtual_pipeline_model_parallel_world_size(None)


def test_bad_layouts_say_what_to_change():
    cases = [(lambda: PipelineParallelLayerLayout("Ettt|tt|tt", 4), "not a multiple of pipeline_model_parallel_size=4"),
             (lambda: PipelineParallelLayerLayout("Ett|tx|tL", 3), "character(s) ['x']"),
             (lambda: PipelineParallelLayerLayout("Ettt|tt|tt|ttL", 4).validate_layer_layout(8), "remove 1 't'"),
             (lambda: PipelineParallelLayerLayout("Ettt|tt|tt|tL", 4).validate_layer_layout(9), "add 1 't'"),
             (lambda: PipelineParallelLayerLayout("tEtt|tt|tt|tL", 4).validate_layer_layout(8), "start with the embedding"),
             (lambda: PipelineParallelLayerLayout("Ettt|tt|tt|Lt", 4).validate_layer_layout(8), "end with the loss"),
             (lambda: PipelineParallelLayerLayout("Ett|t|m|tL", 4).validate_layer_layout(4, 1), "after an MTP layer")]
    for make, says in cases:
        with pytest.raises(ValueError, match=None) as e:
            make()
        assert says in str(e.value), f"the error {e.value!r} should say {says!r}"
    assert PipelineParallelLayerLayout("Et*3|(tt|)*29,m|L", 16).validate_layer_layout(61, 1) is True  # mtp_standalone


def test_uneven_stages_in_the_simulator_and_report():
    even = PipelineParallelLayerLayout("Ett|tt|tt|tt", 4)  # loss and embedding weigh 0: the classic bubble
    rows = layout_report(even, 8, embedding=0.0, loss=0.0)
    require(close([r["idle"] for r in rows], [bubble_fraction_of_total(4, 8)] * 4, "each rank's idle share, even stages"))
    require(equal([r["activations"] for r in rows], [8.0, 6.0, 4.0, 2.0],
                  "peak activations (1F1B holds pp - rank micro-batches of 2 layers each)"))
    heavy = PipelineParallelLayerLayout("Ett|tt|tt|ttL", 4)
    cost = layout_stage_cost(heavy, loss=2.0)
    require(equal(cost, [2.0, 2.0, 2.0, 4.0], "stage costs with a loss worth 2 layers"))
    step = max(r.end for r in simulate(4, 8, 1, "1f1b", stage_cost=cost))
    require(close(step, 3 * 2 + 8 * (4 + 8) + 3 * 4, "the 1F1B step with a last stage twice as slow: the fill (3 "
                  "forwards of 2), its 8 micro-batches (4 + 8 each, never starved), the drain (3 backwards of 4)"))
    idle = [r["idle"] for r in layout_report(heavy, 8, loss=2.0)]
    require(equal(idle.index(min(idle)), 3, "the busiest rank (the loss's) idles least"))


LAYOUTS_RUN = {text: (text, v, kind) for text, v, kind in (
    ("E|tt|tt|L", 1, "1f1b"), ("Et|t|tt|L", 1, "1f1b"), ("E|t|t||t||t|L", 2, "interleaved"))}  # '||': an empty stage


@pytest.mark.exercise("pp.layout_offset")  # build_gpt_stages places the layers with get_layer_offset
def test_layout_in_the_executor_gives_the_unpipelined_gradients():
    from megalab.core.models.gpt.gpt_model import GPTModel, build_gpt_stages
    from megalab.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2, vocab_size=29, seq_length=4,
                               hidden_dropout=0.0, attention_dropout=0.0)
    m, b = 4, 2
    tokens = torch.randint(0, 29, (m * b, 5), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1].chunk(m), tokens[:, 1:].chunk(m)
    loss_func = lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))  # noqa: E731

    def gpt():
        torch.manual_seed(0)
        return GPTModel(config)

    reference = gpt()
    (sum(loss_func(reference(x), y) for x, y in zip(inputs, labels)) / m).backward()
    ref = {n: p.grad for n, p in reference.named_parameters()}

    def body(rank, group):
        out = {}
        for text, v, kind in LAYOUTS_RUN.values():
            model = gpt()
            layout = PipelineParallelLayerLayout(text, 4)
            chunks = build_gpt_stages(model, 4, rank, v, layout=layout)
            pp.forward_backward_pipelining(chunks, inputs, labels, loss_func, (config.seq_length, b, config.hidden_size),
                                           kind=kind, group=group)
            mine = {id(p) for c in chunks for p in c.parameters()}
            out[text] = {n: p.grad for n, p in model.named_parameters() if id(p) in mine and p.grad is not None}
        return out

    grads = threaded_world.run(4, body)
    for text in LAYOUTS_RUN:
        total = {}  # the tied word embedding lives on the first and the last stage: its two halves add up
        for rank in range(4):
            for n, g in grads[rank][text].items():
                total[n] = total[n] + g if n in total else g
        require(equal(sorted(total), sorted(ref), f"layout {text!r}: the parameters the ranks hold"))
        require(all_of(*(close(total[n], ref[n], f"layout {text!r}: the gradient of {n}") for n in ref)))


def test_p2p_model_on_uneven_layouts():
    for text, v, kind in (("E|t*4|t*4|L", 1, "1f1b"), ("Et|t|tt|t|t|t|t|L", 2, "interleaved")):
        layout = PipelineParallelLayerLayout(text, 4)
        streams = p2p_model.record_pipeline(4, 8, v, kind, layout=layout)
        p2p_model.replay(streams)
        require(equal(streams, p2p_model.record_pipeline(4, 8, v, kind),
                      f"the p2p streams of {text!r} vs the even layout's (they depend on pp, v, m only)"))
