"""The training loop's random streams and MoE aux-loss scaling, as Megatron has them.

One 2-rank launch runs every case:
  - TP=2 with dropout: Megatron seeds seed + 100 * pp_rank (the same on both TP ranks), so the replicated
    activations draw the same masks and the replicated weights stay bit-identical; attention dropout on
    the TP-split heads draws from the RNG tracker's model-parallel stream, different per TP rank.
  - MoE, m = 1, 2, 4 micro-batches, cp = 1 (dp = 2) and cp = 2 (dp = 1): the router weight's gradient
    from the load-balancing and z losses equals Megatron's: megatron-core's own loss functions and
    MoEAuxLossAutoScaler with set_loss_scale(cp / m) (forward_step_calc_loss), token counts summed over
    TP x CP, averaged over DP x CP.
  - the global aux loss's window of token counts starts afresh every step (finalize_model_grads).
  - a TP=2 run with dropout resumed from a checkpoint is bit-exact: the tracker's streams are saved too.
"""

import tempfile
import warnings

import pytest
import torch

from megalab.lab import launch
from tests.test_training import SyntheticDataset, training_config

TP_DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
MOE = dict(num_layers=1, num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)
LAYOUTS = [(cp, m) for cp in (1, 2) for m in (1, 2, 4)]


def _gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def _tp_dropout_case(data) -> dict:
    """3 steps at TP=2 with dropout; then the masks of a replicated and a TP-split dropout on equal inputs."""
    import torch.nn.functional as F

    from megalab.core import parallel_state
    from megalab.training.training import setup_model_and_optimizer, train_step

    config = training_config(TP_DROPOUT, tensor_model_parallel_size=2, global_batch_size=4, train_iters=3)
    state = setup_model_and_optimizer(config)
    try:
        for _ in range(3):
            train_step(state, config, data)
        tp_group = state.ps.get_tensor_model_parallel_group()
        replicated = {n: p.detach() for n, p in state.model.named_parameters()
                      if "norm" in n or "position_embeddings" in n or n.endswith("linear_proj.bias") or n.endswith("linear_fc2.bias")}
        diffs = {n: (lambda g: (g[0] - g[1]).abs().max().item())(_gather(p, tp_group)) for n, p in replicated.items()}
        layer = state.model.decoder.layers[0]
        ones = torch.ones(8, 2, 2, 8)  # [s, b, heads on this rank, hn]: the same values on both ranks
        hidden = F.dropout(torch.ones(8, 2, 32), 0.5, training=True)  # as TransformerLayer's hidden dropout
        attention = layer.self_attention.core_attention.train()(ones, ones, ones)  # attention dropout on the heads
        same = lambda t: bool(torch.equal(*_gather(t, tp_group)))
        return {"diffs": diffs, "hidden_same": same(hidden), "attention_same": same(attention)}
    finally:
        parallel_state.destroy_model_parallel()


def _moe_step(cp: int, m: int, coeffs: bool, data) -> dict:
    """One train_step of a 1-layer MoE GPT: the router's inputs per micro-batch and its weight's gradient."""
    from megalab.core import parallel_state
    from megalab.core.transformer.moe.router import TopKRouter
    from megalab.training.training import setup_model_and_optimizer, train_step

    moe = MOE if coeffs else dict(MOE, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    dp = 2 // cp
    config = training_config(dict(moe, attention_dropout=0.0), context_parallel_size=cp, micro_batch_size=2,
                             global_batch_size=2 * m * dp, clip_grad=1e9, train_iters=2)
    state = setup_model_and_optimizer(config)
    try:
        router = next(mod for mod in state.model.modules() if isinstance(mod, TopKRouter))
        weight, inputs, out = router.weight.detach().clone(), [], {}
        router.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].detach().reshape(-1, weight.shape[1])))
        step = state.optimizer.step

        def record_then_step(*args, **kwargs):
            out["grad"] = router.weight.grad.detach().clone()
            return step(*args, **kwargs)

        state.optimizer.step = record_then_step
        train_step(state, config, data)
        return {"weight": weight, "inputs": inputs, "grad": out["grad"]}
    finally:
        parallel_state.destroy_model_parallel()


def _global_window_case(data) -> list[list[int]]:
    """The router's global aux-loss window (ga_steps) seen by each micro-batch of 2 steps, m = 2."""
    from megalab.core import parallel_state
    from megalab.core.transformer.moe.router import TopKRouter
    from megalab.training.training import setup_model_and_optimizer, train_step

    moe = dict(MOE, moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=None)
    config = training_config(moe, micro_batch_size=2, global_batch_size=8, train_iters=2)
    state = setup_model_and_optimizer(config)
    try:
        router = next(mod for mod in state.model.modules() if isinstance(mod, TopKRouter))
        seen, steps = [], []
        router.register_forward_hook(lambda *_: seen.append(int(router.ga_steps.item())))
        for _ in range(2):
            seen.clear()
            train_step(state, config, data)
            steps.append(list(seen))
        return steps
    finally:
        parallel_state.destroy_model_parallel()


def _resume_case(root: str, data) -> dict:
    """Losses of 4 uninterrupted steps at TP=2 with dropout, and of 2 steps + checkpoint + 2 resumed steps."""
    from megalab.training.training import pretrain

    def run(**kw):
        config = training_config(TP_DROPOUT, tensor_model_parallel_size=2, global_batch_size=4, **kw)
        return [r["loss"] for r in pretrain(config, data, None)]

    full = run()
    first = run(save=f"{root}/ckpt", save_interval=2, exit_interval=2)
    return {"full": full, "resumed": first + run(load=f"{root}/ckpt")}


def _worker(root: str):
    from megalab.lab import dist as mdist

    mdist.init()
    data = SyntheticDataset(64, 16, 128)
    out = {"tp_dropout": _tp_dropout_case(data), "resume": _resume_case(root, data)}
    for cp, m in LAYOUTS:
        out[cp, m] = {"with": _moe_step(cp, m, True, data), "without": _moe_step(cp, m, False, data)}
    out["window"] = _global_window_case(data)
    torch.distributed.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as root:
        return launch.run_function(_worker, 2, root, launch=dict(timeout=600)).returns


def test_replicated_weights_stay_identical_across_tp_ranks_with_dropout(runs):
    """Before the fix every global rank had its own seed: after these 3 steps the replicated weights differed
    by up to 7.6e-3 between the TP ranks (the position embeddings; a LayerNorm weight by 2.9e-3)."""
    for rank in (0, 1):
        diffs = runs[rank]["tp_dropout"]["diffs"]
        assert diffs and all(d == 0.0 for d in diffs.values()), {n: d for n, d in diffs.items() if d}


def test_dropout_masks_same_on_replicated_and_different_on_tp_split_activations(runs):
    case = runs[0]["tp_dropout"]
    assert case["hidden_same"], "hidden dropout (activations replicated over TP) drew different masks on the TP ranks"
    assert not case["attention_same"], "attention dropout on TP-split heads drew the same mask on both TP ranks"


def _megatron_aux_gradient(cp: int, m: int, runs) -> torch.Tensor:
    """Megatron's router-weight gradient from the aux and z losses, with megatron-core's own functions."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import moe_utils as mcore

    k, E, dp = MOE["moe_router_topk"], MOE["num_moe_experts"], 2 // cp
    weight = runs[0][cp, m]["with"]["weight"].requires_grad_()
    for dp_rank in range(dp):
        cp_ranks = [dp_rank * cp + r for r in range(cp)]  # the CP group of this DP rank (cp innermost)
        for j in range(m):
            hidden = [runs[r][cp, m]["with"]["inputs"][j] for r in cp_ranks]  # [T_local, h] per CP rank
            logits = [h @ weight.t() for h in hidden]
            counts = sum(mcore.compute_routing_scores_for_aux_loss(lg, k, "softmax")[0].sum(dim=0) for lg in logits)
            for lg in logits:  # each rank's share, its gradient scaled as forward_step_calc_loss sets it
                _, scores = mcore.compute_routing_scores_for_aux_loss(lg, k, "softmax")
                aux = mcore.switch_load_balancing_loss_func(scores, counts, lg.shape[0] * cp, k, E,
                                                            MOE["moe_aux_loss_coeff"])
                z = mcore.z_loss_func(lg, MOE["moe_z_loss_coeff"] / cp)
                mcore.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(cp / m))
                anchor = torch.zeros(1, requires_grad=True)
                out = mcore.MoEAuxLossAutoScaler.apply(mcore.MoEAuxLossAutoScaler.apply(anchor, aux), z)
                out.sum().backward()
    mcore.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    return weight.grad / (dp * cp)  # DDP's average over DP x CP


@pytest.mark.parametrize("cp,m", LAYOUTS)
def test_aux_loss_router_gradient_is_megatrons(runs, cp, m):
    """The aux/z-loss part of the router gradient (with minus without them) equals Megatron's for every m, cp.
    Before the fix it was m times too large at cp = 1 (the aux-loss scale stayed 1)."""
    expected = _megatron_aux_gradient(cp, m, runs)
    for rank in (0, 1):
        run = runs[rank][cp, m]
        ours = run["with"]["grad"] - run["without"]["grad"]
        ratio = (ours * expected).sum() / (expected * expected).sum()
        assert torch.allclose(ours, expected, rtol=1e-4, atol=1e-6 * expected.abs().max().item()), (
            f"cp={cp} m={m} rank {rank}: the aux-loss router gradient is {ratio.item():.4f} x Megatron's")


def test_global_aux_loss_window_is_reset_every_step(runs):
    for rank in (0, 1):
        assert runs[rank]["window"] == [[1, 2], [1, 2]], runs[rank]["window"]


def test_resume_with_dropout_is_bit_exact(runs):
    """The default stream and the tracker's TP stream both come back from the checkpoint."""
    assert runs[0]["resume"]["resumed"] == runs[0]["resume"]["full"]


def test_tracker_fork_and_recompute_replay():
    """fork draws from the named stream and leaves the default one as it was; a checkpointed region replays
    the tracker's stream in backward (the mask behind the gradient is the forward's)."""
    import torch.nn.functional as F

    from megalab.core.tensor_parallel.random import checkpoint, get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    tracker = get_cuda_rng_tracker()
    saved, default = tracker.get_states(), torch.get_rng_state()
    try:
        model_parallel_cuda_manual_seed(5, tp_rank=1)
        torch.manual_seed(5)
        before = torch.get_rng_state()
        with tracker.fork():
            drawn = torch.rand(4)
        assert torch.equal(torch.get_rng_state(), before)  # the default stream did not move
        assert torch.equal(drawn, torch.rand(4, generator=torch.Generator().manual_seed(5 + 2718 + 1)))  # Megatron's seed
        assert not torch.equal(drawn, torch.rand(4))  # another stream than the default one

        def region(x):
            with tracker.fork():
                return F.dropout(x, 0.5, training=True)

        x = torch.ones(256, requires_grad=True)
        y = checkpoint(region, x)
        y.sum().backward()
        assert torch.equal(x.grad, (y != 0).float() * 2)  # the replay drew the forward's mask
    finally:
        tracker.reset()
        tracker.set_states(saved)
        torch.set_rng_state(default)
