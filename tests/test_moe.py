"""Mixture of experts against an independent reference written token by token below.

The reference loops over tokens and their top-k experts with plain tensor math (no permute, no
dispatcher, no batched experts). Single-process tests check the router, the losses, capacity and
the layer; one 4-rank launch checks expert parallelism (EP=1, 2, 4 and EP2 x TP2 with sequence
parallelism, both dispatchers, both expert implementations): outputs, aux/z-losses and every
gradient equal the reference's.
"""

import math
import traceback

import pytest
import torch
import torch.nn.functional as F

from megalab.core import parallel_state as ps
from megalab.core.distributed.finalize_model_grads import finalize_model_grads, update_expert_bias
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.transformer.moe import moe_layer as moe
from megalab.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megalab.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    get_aux_losses_tracker,
    permute,
    sort_chunks_by_idxs,
    switch_load_balancing_loss_func,
    topk_softmax_with_capacity,
    unpermute,
)
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.extras import calc
from megalab.lab import launch
from megalab.lab.checks import mistake
from tests.ch03_checks import check_alltoall_dispatch, check_capacity, named_equal
from tests.feedback import close, equal, max_error, require, require_no_error, require_within

TOL = 1e-5
H, FFN, E = 16, 24, 4
BASE = dict(num_layers=1, hidden_size=H, num_attention_heads=2, vocab_size=32, seq_length=8, ffn_hidden_size=FFN,
            hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=E, moe_router_topk=2)


# ------------------------------------------------------------------ the independent reference
def reference_params(num_experts=E, h=H, ffn=FFN, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(router=torch.randn(num_experts, h, generator=g) * 0.5,
                w1=torch.randn(num_experts, ffn, h, generator=g) * 0.2, b1=torch.randn(num_experts, ffn, generator=g) * 0.1,
                w2=torch.randn(num_experts, h, ffn, generator=g) * 0.2, b2=torch.randn(num_experts, h, generator=g) * 0.1)


def reference_moe(x, p, topk, score="softmax", expert_bias=None, capacity_factor=None):
    """x [T, h] -> out [T, h], balance term E sum f_i P_i, z = mean logsumexp^2, counts [E] (before
    dropping), kept set of (token, expert). Experts are served in token order; with a capacity
    an expert serves only its first `capacity` arrivals."""
    T, num_experts = x.shape[0], p["router"].shape[0]
    logits = x @ p["router"].T
    capacity = math.ceil(T * topk / num_experts * capacity_factor) if capacity_factor else T * topk
    arrivals, kept, rows = [0] * num_experts, set(), []
    for t in range(T):
        if score == "softmax":
            top_logits, experts = logits[t].topk(topk)
            weights = torch.exp(top_logits - top_logits.max()) / torch.exp(top_logits - top_logits.max()).sum()
        else:
            s = torch.sigmoid(logits[t])
            experts = (s + (expert_bias if expert_bias is not None else 0)).topk(topk).indices
            weights = s[experts] / s[experts].sum() if topk > 1 else s[experts]
        row = torch.zeros(x.shape[1])
        for w, e in zip(weights, experts.tolist()):
            arrivals[e] += 1
            if arrivals[e] > capacity:
                continue
            kept.add((t, e))
            hidden = F.gelu(p["w1"][e] @ x[t] + p["b1"][e])
            row = row + w * (p["w2"][e] @ hidden + p["b2"][e])
        rows.append(row)
    counts = torch.tensor(arrivals, dtype=torch.float)
    if score == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True)
    # the balance counts each token's top-k of the scores, without the expert bias (Megatron's rule)
    aux_counts = torch.zeros(num_experts).index_add_(0, scores.topk(topk, dim=-1).indices.flatten(), torch.ones(T * topk))
    f, P = aux_counts / (T * topk), scores.mean(0)
    balance = num_experts * (f * P).sum()
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    return torch.stack(rows), balance, z, counts, kept


def load_into(layer, p, local_experts):
    """Copy the reference weights of `local_experts` into a MoELayer (either expert implementation)."""
    with torch.no_grad():
        layer.router.weight.copy_(p["router"])
        experts = layer.experts
        for i, e in enumerate(local_experts):
            if isinstance(experts, GroupedMLP):
                experts.weight1[i].copy_(p["w1"][e].T)
                experts.weight2[i].copy_(p["w2"][e].T)
                experts.bias1[i].copy_(p["b1"][e])
                experts.bias2[i].copy_(p["b2"][e])
            else:
                mlp = experts.local_experts[i]
                for name, key in (("linear_fc1.weight", "w1"), ("linear_fc1.bias", "b1"),
                                  ("linear_fc2.weight", "w2"), ("linear_fc2.bias", "b2")):
                    mlp.get_parameter(name).copy_(p[key][e])


def expert_grads(layer, local_experts):
    """The local experts' gradients in the reference's layout: {key: [L, ...]}."""
    experts = layer.experts
    if isinstance(experts, GroupedMLP):
        return dict(w1=experts.weight1.grad.transpose(1, 2), w2=experts.weight2.grad.transpose(1, 2),
                    b1=experts.bias1.grad, b2=experts.bias2.grad)
    mlps = experts.local_experts
    return dict(w1=torch.stack([m.linear_fc1.weight.grad for m in mlps]),
                b1=torch.stack([m.linear_fc1.bias.grad for m in mlps]),
                w2=torch.stack([m.linear_fc2.weight.grad for m in mlps]),
                b2=torch.stack([m.linear_fc2.bias.grad for m in mlps]))


def _diff(a, b):
    return float("inf") if a.shape != b.shape else (a.detach() - b.detach()).abs().max().item()


def _require_routes(routing_map, kept, where):
    routed = {(t, e) for t, e in routing_map.nonzero().tolist()}
    assert routed == kept, (f"{where}: the routing map has {len(routed)} (token, expert) pairs, expected {len(kept)}; "
                            f"wrongly routed {sorted(routed - kept)[:4]}, missing {sorted(kept - routed)[:4]}")


def _tokens(seed, T=12):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(100 + seed))


# ------------------------------------------------------------------ router, losses, capacity, permutation
@pytest.mark.exercise("moe.topk_routing")
@pytest.mark.parametrize("score, topk", [("softmax", 1), ("softmax", 2), ("sigmoid", 2), ("sigmoid", 1)])
def test_topk_routing_matches_reference(score, topk):
    x, p = _tokens(0, 16), reference_params()
    bias = torch.tensor([0.5, -0.5, 0.0, 0.2]) if score == "sigmoid" else None
    logits = x @ p["router"].T
    probs, routing_map, counts = topk_softmax_with_capacity(logits, topk, score_function=score, expert_bias=bias)
    _, _, _, ref_counts, kept = reference_moe(x, p, topk, score, bias)
    where = f"topk_softmax_with_capacity(16 tokens, {E} experts, top-{topk}, {score}{', expert bias' if bias is not None else ''})"
    routed = {(t, e) for t, e in routing_map.nonzero().tolist()}
    unbiased = {(t, e) for t, es in enumerate(torch.sigmoid(logits).topk(topk).indices.tolist()) for e in es}
    if bias is not None and routed != kept and routed == unbiased:
        require(mistake("chose the experts by the sigmoid scores alone: the expert bias must be added to choose them "
                        "(top-k of score + expert_bias; the weights stay the unbiased scores)",
                        f"{where}: the routing map is the top-{topk} of sigmoid(logits) without the bias"))
    _require_routes(routing_map, kept, where)
    require(equal(counts.tolist(), ref_counts.tolist(), f"{where}: the tokens per expert"))
    # the weights: softmax over the chosen logits, or the chosen sigmoid scores normalized
    chosen = logits.masked_fill(~routing_map, float("-inf"))
    expected = (torch.softmax(chosen, -1) if score == "softmax"
                else torch.sigmoid(logits) * routing_map / (torch.sigmoid(logits) * routing_map).sum(-1, keepdim=True))
    if score == "sigmoid" and topk == 1:
        expected = torch.sigmoid(logits) * routing_map
    rule = ("softmax over the chosen logits" if score == "softmax" else
            "the chosen sigmoid scores" + (" normalized to sum 1" if topk > 1 else ""))
    sig = torch.sigmoid(logits)
    biased = (sig + bias) * routing_map if bias is not None else None
    mistakes = {"softmax over all experts, then the top-k: the k weights not renormalised to sum 1":
                torch.softmax(logits, -1) * routing_map} if score == "softmax" else {
        "sigmoid scores not renormalised: the chosen scores should sum to 1 (k > 1)": sig * routing_map,
        "the expert bias added to the weights: it only chooses the experts": biased / biased.sum(-1, keepdim=True)
        if biased is not None and topk > 1 else biased}
    require(close(probs, expected, f"{where}: the routing weights ({rule}; 0 elsewhere)", rtol=0, atol=TOL,
                  mistakes=mistakes))


@pytest.mark.exercise("moe.load_balancing_loss")
def test_load_balancing_loss_is_switch_formula():
    x, p = _tokens(1, 32), reference_params()
    logits = x @ p["router"].T
    _, _, _, counts, _ = reference_moe(x, p, 2)
    scores = torch.softmax(logits, -1)
    expected = 0.01 * E * sum((counts[i] / (32 * 2)) * scores[:, i].mean() for i in range(E))
    got = switch_load_balancing_loss_func(scores, counts, 32, 2, E, 0.01)
    require(close(got, expected, f"switch_load_balancing_loss_func(32 tokens, top-2, {E} experts, coeff 0.01) (coeff * "
                                 "E * sum_i tokens_i / (T k) * mean_t probs_ti)", rtol=1e-5, atol=1e-7, mistakes={
        "forgot the top-k in the denominator: fractions of T, not of T*k assignments (k times too large)": expected * 2,
        "forgot the factor E (num_experts): a uniform router should give exactly coeff": expected / E,
        "probs summed over the tokens, not averaged (divide by T twice: once for f_i, once for P_i)": expected * 32,
        "forgot moe_aux_loss_coeff": expected / 0.01}))
    # uniform load and uniform probabilities give exactly coeff; one expert taking everything gives coeff * E
    uniform = switch_load_balancing_loss_func(torch.full((8, E), 1 / E), torch.full((E,), 4.0), 8, 2, E, 0.5)
    collapsed = switch_load_balancing_loss_func(
        F.one_hot(torch.zeros(8, dtype=torch.long), E).float(), torch.tensor([8.0, 0, 0, 0]), 8, 1, E, 0.5)
    require(equal(round(uniform.item(), 6), 0.5, "the load-balancing loss of a uniform load and uniform probabilities "
                                                 "(exactly coeff = 0.5)"))
    require(equal(round(collapsed.item(), 6), 0.5 * E, f"the load-balancing loss when one expert takes every token "
                                                       f"(coeff * E = {0.5 * E})"))


@pytest.mark.exercise("moe.load_balancing_loss")
def test_load_balancing_loss_trains_the_router_and_counts_every_token():
    """Under sequence (or context) parallelism a rank holds only its share of the tokens' probs, while
    tokens_per_expert and total_num_tokens count the whole sequence (Megatron's case): the formula divides by
    total_num_tokens, never by probs' own row count. And the loss exists to train the router: its gradient must
    reach probs (coeff * E * tokens_i / (k T^2) for every token t)."""
    torch.manual_seed(0)
    total, local, k, coeff = 32, 16, 2, 0.01  # this rank holds 16 of the 32 tokens (SP = 2)
    probs = torch.softmax(torch.randn(local, E), -1).requires_grad_()
    counts = torch.tensor([20.0, 16.0, 12.0, 16.0])  # top-2 of all 32 tokens: 64 assignments
    got = switch_load_balancing_loss_func(probs, counts, total, k, E, coeff)
    expected = coeff * E * (probs.detach().sum(0) * counts).sum() / (k * total * total)
    where = f"switch_load_balancing_loss_func(probs of this rank's {local} tokens, counts of all {total}, top-{k})"
    require(close(got.detach(), expected, f"{where} (divide by total_num_tokens = {total})", rtol=1e-5, atol=1e-8,
                  mistakes={f"divided by probs' row count ({local}, e.g. probs.mean(0)), not by total_num_tokens "
                            f"({total}): under sequence parallelism probs holds only this rank's tokens":
                            expected * total / local}))
    if not got.requires_grad:
        raise AssertionError(f"likely mistake: probs detached (or the loss rebuilt from plain numbers) — {where} has no "
                             "gradient: the router would never learn to balance; keep the loss a function of probs")
    got.backward()
    want = (coeff * E * counts / (k * total * total)).expand(local, E)  # d loss / d probs_ti
    grad = torch.zeros_like(probs) if probs.grad is None else probs.grad
    require(close(grad, want, f"{where}: d loss / d probs (coeff * E * tokens_i / (k T^2) for every token)",
                  rtol=1e-5, atol=1e-10))


@pytest.mark.exercise("moe.capacity")
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.5])
def test_dropped_tokens_are_exactly_those_past_capacity(capacity_factor):
    x, p = _tokens(2, 20), reference_params()
    p["router"][0] += 1.0  # skew the routing so that some experts overflow
    logits = x @ p["router"].T
    require(check_capacity(logits, 2, capacity_factor))  # names the likely mistake (off by one, dim, policy, weights)
    probs, routing_map, counts = topk_softmax_with_capacity(logits, 2, capacity_factor)
    _, _, _, ref_counts, kept = reference_moe(x, p, 2, capacity_factor=capacity_factor)
    capacity = math.ceil(20 * 2 / E * capacity_factor)
    where = f"topk_softmax_with_capacity(20 tokens, top-2, capacity_factor={capacity_factor}: {capacity} per expert)"
    _require_routes(routing_map, kept, where + " (each expert keeps its first tokens, in token order)")
    require(equal(counts.tolist(), ref_counts.tolist(), f"{where}: the tokens per expert, counted BEFORE dropping"))
    assert bool((probs[~routing_map] == 0).all()), f"{where}: dropped (token, expert) pairs should have weight 0"
    padded_probs, padded_map, _ = topk_softmax_with_capacity(logits, 2, capacity_factor, pad_to_capacity=True)
    where += " with pad_to_capacity"
    rows, kept_rows = padded_map.sum(0).tolist(), routing_map.sum(0).tolist()
    if rows != [min(capacity, 20)] * E and rows == [min(k + capacity, 20) for k in kept_rows]:
        require(mistake("padding added up to `capacity` fillers on top of the kept tokens: fill only the free slots "
                        "(capacity minus the kept ones)", f"{where}: the rows each expert gets are {rows} (kept "
                        f"{kept_rows} + up to {capacity} fillers), expected {[min(capacity, 20)] * E}"))
    require(equal(rows, [min(capacity, 20)] * E, f"{where}: the rows each expert gets (exactly the capacity)"))
    require(close(padded_probs, probs, f"{where}: the weights vs without padding (fillers carry weight 0)", rtol=0, atol=0))
    assert bool((padded_map | ~routing_map).all()) and bool((padded_map & routing_map == routing_map).all()), (
        f"{where}: the padded routing map should contain every routed (token, expert) pair")


@pytest.mark.exercise("moe.permute")
def test_permute_groups_by_expert_and_unpermute_inverts():
    x, p = _tokens(3, 10), reference_params()
    top_logits, chosen = (x @ p["router"].T).topk(2)
    routing_map = torch.zeros(10, E, dtype=torch.bool).scatter(1, chosen, True)
    probs = torch.zeros(10, E).scatter(1, chosen, torch.softmax(top_logits, -1))
    expected = [(e, t) for e in range(E) for t in range(10) if routing_map[t, e]]  # expert-major, token order
    where = f"permute(10 tokens, top-2 of {E} experts)"
    token_major = [(e, t) for t in range(10) for e in range(E) if routing_map[t, e]]
    _, _, sorted_indices = permute(x, routing_map)  # without probs first: the order alone
    require(named_equal(sorted_indices.tolist(), [t for _, t in expected],
                        f"{where}: the token index of each permuted row (expert by expert, tokens in order within one)", {
        "token-major order: routing_map not transposed, so the rows are token by token, not expert by expert":
            [t for _, t in token_major],
        "sorted_indices hold the expert of each row, not its token": [e for e, _ in expected]}))
    permuted, permuted_probs, sorted_indices = permute(x, routing_map, probs)
    require(close(permuted, x[[t for _, t in expected]], f"{where}: the permuted rows vs the tokens they should be",
                  rtol=0, atol=0))
    require(close(permuted_probs, torch.stack([probs[t, e] for e, t in expected]),
                  f"{where}: the permuted weights (probs[token, expert] of each row)", rtol=0, atol=0, mistakes={
        "the probs selected token-major (probs not transposed like routing_map): weights of other rows":
            torch.stack([probs[t, e] for e, t in token_major])}))
    restored = unpermute(permuted, sorted_indices, 10, permuted_probs)
    require(close(restored, x * probs.sum(-1, keepdim=True),  # the k weights of each token sum to 1
                  "unpermute(permute(x)) with the weights vs x times the sum of its weights (each row added back to "
                  "its token)", rtol=0, atol=TOL))


@pytest.mark.exercise("moe.alltoall_dispatch")
def test_alltoall_dispatch_on_a_threaded_world():
    """First, in one process (ep = 2 as threads, uneven routing): the rows each rank receives, grouped by local
    expert; a wrong dispatch is named (splits swapped, chunks not sorted by expert)."""
    require(check_alltoall_dispatch())


def test_sort_chunks_by_idxs():
    x = torch.arange(6.0).unsqueeze(1)
    out = sort_chunks_by_idxs(x, torch.tensor([1, 2, 3]), [2, 0, 1])
    assert out.squeeze(1).tolist() == [3.0, 4.0, 5.0, 0.0, 1.0, 2.0]


# ------------------------------------------------------------------ the layer in one process
LAYER_CASES = {
    "softmax top2": dict(),
    "top1 grouped": dict(moe_router_topk=1, moe_grouped_gemm=True),
    "capacity 1.0": dict(moe_expert_capacity_factor=1.0),
    "capacity padded grouped": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
                                    moe_grouped_gemm=True),
    "sigmoid + bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    "alltoall": dict(moe_token_dispatcher_type="alltoall"),
}


@pytest.mark.parametrize("case", LAYER_CASES)
def test_moe_layer_matches_reference(case):
    """Output, aux and z-loss values, and every gradient (aux/z-losses included through backward)."""
    change = LAYER_CASES[case]
    config = TransformerConfig(**{**BASE, **change}, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    p = reference_params()
    torch.manual_seed(0)
    layer = moe.MoELayer(config)
    load_into(layer, p, range(E))
    bias = None
    if config.moe_router_enable_expert_bias:
        bias = torch.tensor([0.3, -0.3, 0.1, 0.0])
        layer.router.expert_bias.copy_(bias)
    x = _tokens(4, 12).view(6, 2, H)
    g = _tokens(5, 12).view(6, 2, H)
    out = layer(x)
    (out * g).sum().backward()
    ref = {k: v.clone().requires_grad_() for k, v in p.items()}
    ref_out, balance, z, counts, _ = reference_moe(x.view(12, H), ref, config.moe_router_topk,
                                                   config.moe_router_score_function, bias,
                                                   config.moe_expert_capacity_factor)
    ((ref_out * g.view(12, H)).sum() + 0.1 * balance + 0.01 * z).backward()
    tracker = get_aux_losses_tracker(layer)
    assert _diff(out.view(12, H), ref_out) < TOL
    assert abs(tracker["load_balancing_loss"][1] - balance) < TOL and abs(tracker["z_loss"][1] - 0.01 * z) < TOL
    assert torch.equal(layer.router.tokens_per_expert.float(), counts)  # routing counts == independent count
    assert _diff(layer.router.weight.grad, ref["router"].grad) < TOL
    for key, grad in expert_grads(layer, range(E)).items():
        assert _diff(grad, ref[key].grad) < TOL, key


def test_grouped_mlp_equals_the_loop_of_mlps_gated():
    """SwiGLU experts without biases: one batched matmul == a loop of MLPs, forward and backward."""
    config = TransformerConfig(**BASE, gated_linear_unit=True, activation_func="silu", add_bias_linear=False)
    loop, grouped = SequentialMLP(config, [0, 1, 2]), GroupedMLP(config, [0, 1, 2])
    with torch.no_grad():
        for i, mlp in enumerate(loop.local_experts):
            grouped.weight1[i].copy_(mlp.linear_fc1.weight.T)
            grouped.weight2[i].copy_(mlp.linear_fc2.weight.T)
    tokens, counts = _tokens(7, 9), torch.tensor([4, 0, 5])  # an expert with no tokens too
    out_loop, out_grouped = loop(tokens, counts), grouped(tokens, counts)
    out_loop.sum().backward()
    out_grouped.sum().backward()
    assert _diff(out_grouped, out_loop) < TOL
    assert _diff(grouped.weight1.grad, torch.stack([m.linear_fc1.weight.grad.T for m in loop.local_experts])) < TOL


@pytest.mark.gpu
def test_moe_layer_on_gpu_matches_cpu():
    config = TransformerConfig(**BASE, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
                               moe_aux_loss_coeff=0.01, moe_expert_capacity_factor=1.0)
    layer = moe.MoELayer(config)
    x = _tokens(8, 12).view(6, 2, H)
    expected = layer(x)
    assert _diff(layer.cuda()(x.cuda()).cpu(), expected) < 1e-4


def test_shared_experts_see_every_token():
    config = TransformerConfig(**BASE, moe_shared_expert_intermediate_size=8)
    layer = moe.MoELayer(config)
    x = _tokens(6, 8).view(4, 2, H)
    routed = layer(x) - layer.shared_experts(x)
    # expert weights are marked for the expert-data-parallel reduction, the dense ones are not
    assert all(p.allreduce is False for p in layer.experts.parameters())
    assert all(getattr(p, "allreduce", True) for m in (layer.router, layer.shared_experts) for p in m.parameters())
    layer.shared_experts = None
    assert _diff(routed, layer(x)) < TOL


def test_expert_bias_moves_toward_balance():
    config = TransformerConfig(**BASE, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                               moe_router_bias_update_rate=0.1)
    layer = moe.MoELayer(config)
    layer.router.local_tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 4.0, 0.0]))  # mean 4
    update_expert_bias(layer)
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.1])
    assert layer.router.local_tokens_per_expert.sum() == 0


def test_aux_loss_gradient_follows_the_loss_scale():
    config = TransformerConfig(**BASE, moe_aux_loss_coeff=1.0)
    layer = moe.MoELayer(config)
    x = _tokens(9, 8).view(4, 2, H)
    grads = []
    for scale in (1.0, 0.25):
        layer.zero_grad()
        with MoEAuxLossAutoScaler.loss_scale(scale):
            out = layer(x)
        (out * 0).sum().backward()  # only the aux loss reaches the router, with the scale of its forward
        grads.append(layer.router.weight.grad.clone())
    assert MoEAuxLossAutoScaler.main_loss_backward_scale == 1.0  # the setting ended with the block
    assert grads[0].abs().sum() > 0 and _diff(grads[1], 0.25 * grads[0]) < 1e-7


def test_gpt_with_moe_layers_trains_its_router_through_the_aux_loss():
    """MoEAuxLossAutoScaler: the router's gradient with the aux loss on = without + d(coeff * balance)/dW."""
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    grads = {}
    for coeff in (0.0, 0.5):
        torch.manual_seed(0)
        model = GPTModel(TransformerConfig(**BASE, moe_aux_loss_coeff=coeff))
        assert isinstance(model.decoder.layers[0].mlp, moe.MoELayer)
        model(ids, labels=ids).mean().backward()
        grads[coeff] = model.decoder.layers[0].mlp.router.weight.grad.clone()
        balance = get_aux_losses_tracker(model)["load_balancing_loss"][1]
    # the balance term alone, recomputed from the same router input
    torch.manual_seed(0)
    model = GPTModel(TransformerConfig(**BASE))
    layer = model.decoder.layers[0]
    hidden = layer.pre_mlp_layernorm(layer.self_attention(layer.input_layernorm(model.embedding(ids))) +
                                     model.embedding(ids)).reshape(16, H).detach()
    router = layer.mlp.router
    logits = hidden @ router.weight.T
    counts = torch.bincount(logits.topk(2).indices.flatten(), minlength=E).float()
    aux = 0.5 * E * ((counts / 32) * torch.softmax(logits, -1).mean(0)).sum()
    assert abs(aux.item() - 0.5 * balance.item()) < TOL
    aux.backward()
    assert _diff(grads[0.5] - grads[0.0], router.weight.grad) < 1e-6


@pytest.mark.parametrize("change, match", [
    (dict(moe_router_topk=5), "moe_router_topk 5 must be in 1..num_moe_experts=4"),
    (dict(moe_router_score_function="relu"), "moe_router_score_function must be one of"),
    (dict(moe_token_dispatcher_type="deepep"), "moe_token_dispatcher_type must be one of"),
    (dict(moe_router_enable_expert_bias=True), "needs moe_router_score_function"),
    (dict(moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor must be > 0"),
    (dict(moe_pad_expert_input_to_capacity=True), "needs moe_expert_capacity_factor"),
    (dict(num_moe_experts=0), "num_moe_experts must be a positive integer"),
])
def test_bad_moe_config_says_what_to_do(change, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**{**BASE, **change})


# ------------------------------------------------------------------ expert parallelism on 4 ranks
EP_CASES = {  # name: (tp, ep, config changes)
    "ep1 alltoall": (1, 1, dict(moe_token_dispatcher_type="alltoall")),
    "ep2 alltoall": (1, 2, dict(moe_token_dispatcher_type="alltoall")),
    "ep2 allgather": (1, 2, dict(moe_token_dispatcher_type="allgather")),
    "ep4 alltoall grouped": (1, 4, dict(moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True)),
    "ep4 allgather top1": (1, 4, dict(moe_token_dispatcher_type="allgather", moe_router_topk=1)),
    "ep4 alltoall capacity": (1, 4, dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0)),
    "ep4 alltoall padded": (1, 4, dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0,
                                       moe_pad_expert_input_to_capacity=True)),
    "ep2xtp2 alltoall sp": (2, 2, dict(moe_token_dispatcher_type="alltoall", sequence_parallel=True)),
    "ep2xtp2 allgather sp": (2, 2, dict(moe_token_dispatcher_type="allgather", sequence_parallel=True)),
}


def _ep_case(rank, world, tp, ep, change):
    num_experts = 8
    state = ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                         expert_tensor_parallel_size=1)
    try:
        config = TransformerConfig(**{**BASE, "num_moe_experts": num_experts, **change},
                                   moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
        p = reference_params(num_experts)
        layer = moe.MoELayer(config)
        load_into(layer, p, layer.local_expert_indices)
        x, g = _tokens(rank).view(6, 2, H), _tokens(50 + rank).view(6, 2, H)
        out = layer(x)
        (out * g).sum().backward()
        finalize_model_grads([layer], state)
        # the reference: a data-parallel replica routes the tokens of its TP ranks (the sequence under
        # SP) together; the loss is averaged over the replicas
        ref = {k: v.clone().requires_grad_() for k, v in p.items()}
        dp = state.get_data_parallel_world_size()
        total = 0
        for replica in [list(range(i, i + tp)) for i in range(0, world, tp)]:  # the TP groups: tp-first order
            tokens = torch.cat([_tokens(r) for r in replica])
            ref_out, balance, z, _, _ = reference_moe(tokens, ref, config.moe_router_topk,
                                                      capacity_factor=config.moe_expert_capacity_factor)
            total = total + (ref_out * torch.cat([_tokens(50 + r) for r in replica])).sum() + 0.1 * balance + 0.01 * z
            if rank in replica:
                mine = (ref_out.chunk(tp)[replica.index(rank)], balance)
        (total / dp).backward()
        local = layer.local_expert_indices
        diffs = {"the output": max_error(out.view(12, H), mine[0]),
                 "the load-balancing loss": abs(get_aux_losses_tracker(layer)["load_balancing_loss"][1] - mine[1]).item(),
                 "the router's weight gradient": max_error(layer.router.weight.grad, ref["router"].grad)}
        diffs.update({f"the local experts' {k} gradient": max_error(v, ref[k].grad[local])
                      for k, v in expert_grads(layer, local).items()})
        return _worst(diffs), diffs, getattr(layer.token_dispatcher, "a2a_bytes", None)
    finally:
        ps.destroy_model_parallel()


def _gpt_case(rank):
    """A MoE GPT under TP2 x EP2 with sequence parallelism: the same seed builds the same model as on
    one device (experts drawn as there, the local ones kept), so the losses and the router's gradient match."""
    from megalab.core.models.gpt.gpt_layer_specs import tensor_parallel_layer_spec
    from megalab.core.models.gpt.gpt_model import GPTModel

    config = TransformerConfig(**{**BASE, "num_layers": 2, "vocab_size": 64, "num_moe_experts": 4},
                               moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01)
    from megalab.lab import dist as mdist

    dev = mdist.device()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0)).to(dev)
    torch.manual_seed(0)
    single = GPTModel(config).to(dev)
    with MoEAuxLossAutoScaler.loss_scale(0.5):  # the aux losses are averaged too (Megatron's schedules
        ref_losses = [single(ids[2 * d:2 * d + 2], labels=ids[2 * d:2 * d + 2]).mean() for d in range(2)]
    ref_loss = sum(ref_losses) / 2  # the mean over the two data-parallel replicas (each its own aux loss)
    ref_loss.backward()  # scale them by 1 / micro-batches the same way)
    state = ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                         expert_tensor_parallel_size=1)
    try:
        torch.manual_seed(0)
        model = GPTModel(TransformerConfig(**{**config.__dict__, "sequence_parallel": True}),
                         tensor_parallel_layer_spec()).to(dev)
        dp_rank = state.get_data_parallel_rank()
        loss = model(ids[2 * dp_rank:2 * dp_rank + 2], labels=ids[2 * dp_rank:2 * dp_rank + 2]).mean()
        loss.backward()
        finalize_model_grads([model], state)
        losses = [torch.zeros((), device=dev) for _ in range(2)]
        torch.distributed.all_gather(losses, loss.detach(), group=state.get_data_parallel_group())
        diffs = {"the mean loss": abs(sum(losses) / 2 - ref_loss).item()}
        for name in ("router.weight", "experts.local_experts.0.linear_fc1.weight"):
            mine = model.decoder.layers[1].mlp.get_parameter(name).grad
            e = model.decoder.layers[1].mlp.local_expert_indices[0] if "experts" in name else None
            ref_name = name.replace("local_experts.0", f"local_experts.{e}") if e is not None else name
            diffs[f"the gradient of layer 1's mlp.{name}"] = max_error(
                mine, single.decoder.layers[1].mlp.get_parameter(ref_name).grad)
        return _worst(diffs), diffs, None
    finally:
        ps.destroy_model_parallel()


def _expert_bias_case(rank):
    """finalize_model_grads moves the expert bias (Megatron: before the optimizer step), by the counts of
    every rank of TP x DP x CP (tp2 x dp2 here): (bias after, the summed counts it saw)."""
    state = ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                         expert_tensor_parallel_size=1)
    try:
        config = TransformerConfig(**{**BASE, "num_moe_experts": 4}, moe_router_score_function="sigmoid",
                                   moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.1,
                                   sequence_parallel=True)
        layer = moe.MoELayer(config)
        mine = torch.zeros(4)
        mine[rank] = 4.0 + rank  # rank r counted 4 + r tokens for expert r: the sum is [4, 5, 6, 7], mean 5.5
        layer.router.local_tokens_per_expert.copy_(mine)
        for p in layer.parameters():
            p.grad = torch.zeros_like(p)
        finalize_model_grads([layer], state)
        return layer.router.expert_bias.tolist(), layer.router.local_tokens_per_expert.tolist()
    finally:
        ps.destroy_model_parallel()


def run_ep_cases():
    from megalab.lab import dist as mdist

    rank, world = mdist.init()
    results = {}
    for name, (tp, ep, change) in EP_CASES.items():
        try:
            results[name] = _ep_case(rank, world, tp, ep, change)
        except Exception:
            results[name] = (float("inf"), traceback.format_exc(limit=-3), None)
    try:
        results["gpt ep2xtp2"] = _gpt_case(rank)
    except Exception:
        results["gpt ep2xtp2"] = (float("inf"), traceback.format_exc(limit=-3), None)
    try:
        results["expert bias"] = _expert_bias_case(rank)
    except Exception:
        results["expert bias"] = traceback.format_exc(limit=-3)
    # experts not divisible by EP: a clear error
    ps.initialize_model_parallel(expert_model_parallel_size=4)
    try:
        moe.MoELayer(TransformerConfig(**{**BASE, "num_moe_experts": 6}))
        results["bad ep"] = "no error"
    except ValueError as e:
        results["bad ep"] = str(e)
    ps.destroy_model_parallel()
    torch.distributed.barrier()
    return results


def _worst(diffs):
    return max(float("inf") if isinstance(d, str) else d for d in diffs.values())


def _assert_matches(ep_results, case):
    tp, ep, change = EP_CASES.get(case, (2, 2, dict(sequence_parallel=True)))
    where = f"4 ranks, {case} (tp={tp}, ep={ep}{', sequence parallel' if change.get('sequence_parallel') else ''})"
    for rank in range(4):
        worst, detail, _ = ep_results[rank][case]
        if isinstance(detail, str):  # the case raised: show its traceback in full
            require_no_error(f"{where}, rank {rank}", detail)
        require_within(detail, TOL, where=f"{where}, rank {rank}", against="the single-process reference's")


@pytest.fixture(scope="module")
def ep_results():
    return launch.run_function(run_ep_cases, 4, launch=dict(backend="gloo", timeout=240)).returns


@pytest.mark.integration
@pytest.mark.exercise("moe.alltoall_dispatch")
@pytest.mark.parametrize("case", [c for c in EP_CASES if "alltoall" in c])
def test_expert_parallel_alltoall_matches_single_process(ep_results, case):
    _assert_matches(ep_results, case)


@pytest.mark.integration
@pytest.mark.exercise("moe.alltoall_dispatch")
def test_alltoall_bytes_match_formula_when_padded_to_capacity(ep_results):
    """Padded to capacity, every rank sends exactly capacity rows to each remote expert: 2 T k h (ep-1)/ep."""
    expected = calc.moe_all_to_all_bytes(12, 2, H, 4, bytes_per_element=4)
    for r in range(4):
        require_no_error(f"4 ranks, ep4 alltoall padded, rank {r}", ep_results[r]["ep4 alltoall padded"][1]
                         if isinstance(ep_results[r]["ep4 alltoall padded"][1], str) else None)
        require(equal(ep_results[r]["ep4 alltoall padded"][2], expected,
                      f"4 ranks, ep=4, padded to capacity, rank {r}: the bytes the all-to-alls sent (2 T k h (ep-1)/ep, "
                      "calc.moe_all_to_all_bytes)"))


@pytest.mark.parametrize("case", [c for c in EP_CASES if "allgather" in c])
def test_expert_parallel_allgather_matches_single_process(ep_results, case):
    _assert_matches(ep_results, case)


def test_moe_gpt_under_tp2_ep2_sp_equals_one_device(ep_results):
    _assert_matches(ep_results, "gpt ep2xtp2")


def test_experts_not_divisible_by_ep_is_a_clear_error(ep_results):
    assert "num_moe_experts 6 is not divisible by the expert-parallel size 4" in ep_results[0]["bad ep"]


def test_finalize_model_grads_updates_the_expert_bias_over_tp_dp_cp(ep_results):
    """Summed over all 4 ranks (tp2 x dp2), the counts are [4, 5, 6, 7]: experts 0, 1 under the mean rise."""
    for rank in range(4):
        result = ep_results[rank]["expert bias"]
        assert not isinstance(result, str), result
        bias, counts = result
        assert bias == pytest.approx([0.1, 0.1, -0.1, -0.1]) and counts == [0.0] * 4, (rank, result)
