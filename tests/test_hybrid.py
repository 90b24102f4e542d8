"""One GPT training step on 8 real ranks in several layouts equals the single-process step."""

import pytest
import torch

from megalab.lab import launch

BASE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, hidden_dropout=0.0,
            attention_dropout=0.0)  # GPT: LayerNorm, learned positions, GeLU, tied embeddings
LLAMA = dict(BASE, num_query_groups=2, normalization="RMSNorm", position_embedding_type="rope", activation_func="silu",
             gated_linear_unit=True, add_bias_linear=False, share_embeddings_and_output_weights=False)
MOE = dict(LLAMA, num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_token_dispatcher_type="alltoall",
           sequence_parallel=True)
LAYOUTS = {  # name: (initialize_model_parallel sizes, config, zero stage, micro-batches per dp rank)
    "tp2·pp2·dp2 gpt": (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), BASE, 0, 2),
    "tp2·pp2·dp2 llama sp": (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                             dict(LLAMA, sequence_parallel=True), 0, 2),
    "tp4·dp2 llama sp": (dict(tensor_model_parallel_size=4), dict(LLAMA, num_query_groups=4, sequence_parallel=True), 0, 2),
    "pp4·dp2 gpt": (dict(pipeline_model_parallel_size=4), BASE, 0, 4),
    "tp2·cp2·dp2 llama": (dict(tensor_model_parallel_size=2, context_parallel_size=2), LLAMA, 0, 2),
    "cp2·pp2·dp2 gpt": (dict(context_parallel_size=2, pipeline_model_parallel_size=2), BASE, 0, 2),
    "ep4 with tp2·dp4 moe": (dict(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1),
                             MOE, 0, 2),
    "dp8 zero1": (dict(), BASE, 1, 1),
    "dp8 zero3 llama": (dict(), LLAMA, 3, 1),
}


def _steps(layouts):
    import torch.distributed as dist

    from megalab.core import parallel_state as ps
    from megalab.core.transformer.transformer_config import TransformerConfig
    from megalab.extras import hybrid
    from megalab.lab import dist as mdist

    mdist.init()
    out = {}
    for name, (sizes, cfg, zero, m) in layouts.items():
        state = ps.initialize_model_parallel(**sizes)
        r = hybrid.train_step(TransformerConfig(**cfg), state, batch_size=8, num_microbatches=m, zero_stage=zero)
        worst = torch.tensor(r.worst_weight_diff, device=mdist.device())
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out[name] = (r.loss, r.reference_loss, worst.item())
        ps.destroy_model_parallel()
    try:
        hybrid.train_step(TransformerConfig(**{**BASE, "hidden_dropout": 0.1}), ps.initialize_model_parallel(), 8, 1)
    except ValueError as e:
        out["dropout error"] = str(e)
    return out


@pytest.fixture(scope="module")
def steps():
    return launch.run_function(_steps, 8, LAYOUTS, launch=dict(timeout=600)).returns


@pytest.mark.slow
@pytest.mark.exercise("hybrid.train_step")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_step_equals_single_process(steps, layout):
    _, _, zero, m = LAYOUTS[layout]
    where = f"8 ranks, {layout} (ZeRO-{zero}, {m} micro-batch(es) per dp rank)"
    for rank, out in steps.items():
        loss, reference, worst = out[layout]
        assert loss == pytest.approx(reference, abs=1e-6), (
            f"{where}, rank {rank}: the loss of the step is {loss:.8g}, the single-process step's {reference:.8g} "
            f"(off by {abs(loss - reference):.3g}, tolerance 1e-6)")
        assert worst < 1e-6, (f"{where}, rank {rank}: after the optimizer step the weights differ from the "
                              f"single-process step's by up to {worst:.3g} (tolerance 1e-6)")


@pytest.mark.slow
def test_dropout_is_refused_with_the_reason(steps):
    assert "hidden_dropout = attention_dropout = 0" in steps[0]["dropout error"]
