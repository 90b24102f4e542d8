"""megalab vs Megatron-Core's own code (megatron-core, pinned in the dev extra) on the same inputs.

Every test takes the `mcore` fixture: without the pinned megatron-core it FAILS with the line that
installs it (tests/megatron_oracle.py). Megatron classes that allocate CUDA buffers in __init__ (e.g.
TopKRouter) are composed here from their own functions, in their forward's order.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from tests.megatron_oracle import MEGATRON_CORE_VERSION, import_mcore, public_version


# ------------------------------------------------------------------ the oracle itself
def test_missing_or_wrong_megatron_core_fails_with_the_install_line(tmp_path):
    """A run whose megatron-core is missing (or another version) fails the parity tests, saying how to install it."""
    fake = tmp_path / "megatron" / "core"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("__version__ = '0.0.1'\n")
    test = tmp_path / "test_uses_oracle.py"
    test.write_text("from tests.megatron_oracle import mcore\n\ndef test_x(mcore):\n    pass\n")
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for label, path in (("wrong version", f"{tmp_path}{os.pathsep}{root}"), ("missing", f"{root}")):
        code = ("import sys; sys.modules['megatron'] = None\n" if label == "missing" else "") + (
            f"import pytest; sys.exit(pytest.main([{str(test)!r}, '-q', '-p', 'no:cacheprovider', '-o', 'addopts=', "
            f"'-p', 'no:nbval', '-p', 'no:xdist', '--rootdir', {str(tmp_path)!r}]))")
        code = "import sys\n" + code
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": path}, cwd=tmp_path)
        text = out.stdout + out.stderr
        assert out.returncode == 1, (label, text)  # failed, not skipped (a skip exits 0)
        assert ("1 failed" in text or "1 error" in text) and "make setup" in text, text
        assert "pip install -e .[dev]" in text and f"pip install megatron-core=={MEGATRON_CORE_VERSION}" in text, text


def test_a_local_build_suffix_is_the_same_release_another_release_is_not(tmp_path, monkeypatch):
    """'0.19.2+f1b6066' (a local build of the pinned release) passes the check; 0.19.1, 0.19.3 and a 0.19.2
    pre-release fail it with the install line."""
    from tests.megatron_oracle import MegatronCoreUnavailable, check_megatron_core
    monkeypatch.syspath_prepend(str(tmp_path))
    for i, (version, ok) in enumerate([(f"{MEGATRON_CORE_VERSION}+f1b6066", True), (MEGATRON_CORE_VERSION, True),
                                       ("0.19.1", False), ("0.19.3", False), (f"{MEGATRON_CORE_VERSION}rc1", False)]):
        (tmp_path / f"fake_mcore_{i}.py").write_text(f"__version__ = {version!r}\n")
        if ok:
            assert check_megatron_core(f"fake_mcore_{i}").__version__ == version
        else:
            with pytest.raises(MegatronCoreUnavailable, match=f"megatron-core {version} is installed, not "
                                                              f"{MEGATRON_CORE_VERSION}.*pip install -e"):
                check_megatron_core(f"fake_mcore_{i}")


def test_notebooks_import_megatron_core_without_cpu_notices(mcore, tmp_path):
    """megalab.lab.mcore.import_mcore: no "No CUDA runtime is found" (torch finds a CUDA toolkit, here CUDA_HOME,
    and no GPU) and no TE/apex warning in a notebook's output; a plain import prints them (the check can fail)."""
    import os
    env = {**os.environ, "CUDA_HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    plain = "import megatron.core.parallel_state"
    quiet = "from megalab.lab.mcore import import_mcore; import_mcore('megatron.core.parallel_state')"
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
            for code in (plain, quiet)]
    assert outs[0].returncode == 0 and "No CUDA runtime is found" in outs[0].stderr, outs[0].stderr
    assert outs[1].returncode == 0 and outs[1].stderr == "" and outs[1].stdout == "", outs[1].stderr


def test_notebooks_say_how_to_install_a_missing_megatron_core(monkeypatch):
    from megalab.lab.mcore import NOT_INSTALLED, import_mcore
    for name in ("megatron", "megatron.core", "megatron.core.parallel_state"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(ImportError, match="`make setup` installs it"):
        import_mcore("megatron.core.parallel_state")
    assert "megatron-core is not installed" in NOT_INSTALLED


def test_the_pinned_megatron_core_is_installed(mcore):
    assert public_version(mcore.__version__) == MEGATRON_CORE_VERSION


# ------------------------------------------------------------------ MoE router (megatron/core/transformer/moe)
def _mcore_route(logits, topk, score, bias, capacity_factor, pad, drop_policy="position"):
    """Megatron's TopKRouter.routing, composed from its moe_utils functions in its order (the class itself
    allocates CUDA buffers): probs, routing_map, balance (coefficient 1), z (coefficient 1), bias counts."""
    mu = import_mcore("megatron.core.transformer.moe.moe_utils")
    T, E = logits.shape
    z = mu.z_loss_func(logits, 1.0)
    probs, routing_map = mu.topk_routing_with_score_function(logits, topk, score_function=score, expert_bias=bias)
    if capacity_factor is not None:
        probs, routing_map = mu.apply_router_token_dropping(probs, routing_map, topk, capacity_factor,
                                                            drop_policy=drop_policy, pad_to_capacity=pad)
    aux_map, aux_scores = mu.compute_routing_scores_for_aux_loss(logits, topk, score)
    balance = mu.switch_load_balancing_loss_func(aux_scores, aux_map.sum(0), T, topk, E, 1.0)
    return probs, routing_map, balance, z, routing_map.sum(0)  # _apply_expert_bias counts the kept map


def _megalab_router(T, E, topk, score, bias, capacity_factor=None, pad=False, seed=0):
    from megalab.core.transformer.moe.router import TopKRouter
    from megalab.core.transformer.transformer_config import TransformerConfig
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=32, seq_length=T,
                               ffn_hidden_size=16, num_moe_experts=E, moe_router_topk=topk, moe_router_score_function=score,
                               moe_router_enable_expert_bias=bias is not None, moe_aux_loss_coeff=1.0, moe_z_loss_coeff=1.0,
                               moe_expert_capacity_factor=capacity_factor, moe_pad_expert_input_to_capacity=pad)
    router = TopKRouter(config)
    if bias is not None:
        router.expert_bias.copy_(bias)
    return router


ROUTER_CASES = [  # T, E, topk, score, bias?, capacity factor, pad
    (16, 4, 2, "softmax", False, None, False), (24, 8, 1, "softmax", False, None, False),
    (16, 4, 2, "sigmoid", False, None, False), (12, 6, 1, "sigmoid", False, None, False),
    (16, 4, 2, "sigmoid", True, None, False), (20, 8, 3, "sigmoid", True, None, False),
    (16, 4, 2, "softmax", False, 1.0, False), (32, 8, 2, "softmax", False, 0.5, False),
    (16, 4, 2, "softmax", False, 1.0, True), (16, 4, 2, "sigmoid", True, 0.75, True),
    (16, 4, 1, "sigmoid", True, 1.5, False),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("T, E, topk, score, has_bias, cf, pad", ROUTER_CASES)
def test_router_matches_megatron(mcore, T, E, topk, score, has_bias, cf, pad, seed):
    """Probs, routing map (drop/pad by position), load-balancing loss, z-loss, the router weight's gradient
    through both losses, and the expert-bias token counts, as Megatron's TopKRouter computes them."""
    bias = torch.randn(E, generator=torch.Generator().manual_seed(100 + seed)) * 0.3 if has_bias else None
    router = _megalab_router(T, E, topk, score, bias, cf, pad, seed)
    router.train()
    hidden = torch.randn(T, 8, generator=torch.Generator().manual_seed(seed))
    probs, routing_map = router(hidden)
    (probs * torch.linspace(0.5, 1.5, E)).sum().backward()
    weight = router.weight.detach().clone().requires_grad_()
    logits = hidden @ weight.t()
    m_probs, m_map, m_balance, m_z, m_counts = _mcore_route(logits, topk, score, bias, cf, pad)
    # Megatron attaches both losses through MoEAuxLossAutoScaler (gradient 1 each by default)
    ((m_probs * torch.linspace(0.5, 1.5, E)).sum() + m_balance + m_z).backward()
    torch.testing.assert_close(router.aux_losses["load_balancing_loss"], m_balance.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(router.aux_losses["z_loss"], m_z.detach(), rtol=0, atol=1e-6)
    # Megatron's "position" policy takes torch.topk(routing_map.int(), capacity, dim=0, sorted=False): WHICH of the
    # tied arrivals it keeps is up to topk's implementation (on CPU not the first ones); how many it keeps is not
    assert torch.equal(routing_map.sum(0), m_map.sum(0))
    if has_bias:
        assert torch.equal(router.local_tokens_per_expert, m_counts.float())
    if cf is None or torch.equal(routing_map, m_map):
        assert torch.equal(routing_map, m_map)
        torch.testing.assert_close(probs, m_probs, rtol=0, atol=1e-6)
        torch.testing.assert_close(router.weight.grad, weight.grad, rtol=0, atol=1e-5)
    else:  # the same weights on the assignments both kept
        both = routing_map & m_map
        torch.testing.assert_close(probs * both, m_probs.detach() * both, rtol=0, atol=1e-6)


def test_aux_loss_with_sigmoid_and_expert_bias_counts_without_the_bias(mcore):
    """The issue's example: T=2, E=2, top-1, identity router weight, hidden [[1,0],[1,0]], bias [0, 0.5]:
    Megatron's balance loss 1.1877 (the bias steers the routing, not the count the loss sees)."""
    router = _megalab_router(2, 2, 1, "sigmoid", torch.tensor([0.0, 0.5]))
    router.config.hidden_size = 2
    router.weight = torch.nn.Parameter(torch.eye(2))
    router.train()
    router(torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    *_, m_balance, _, _ = _mcore_route(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), 1, "sigmoid", torch.tensor([0.0, 0.5]), None, False)
    assert round(m_balance.item(), 4) == 1.1877
    assert round(router.aux_losses["load_balancing_loss"].item(), 4) == 1.1877


def test_capacity_drops_by_position_not_megatrons_default_probs(mcore):
    """Deliberate difference (03·09 says so): megalab drops by arrival position (Megatron's
    --moe-token-drop-policy position); Megatron's default "probs" keeps each expert's highest weights."""
    mu = import_mcore("megatron.core.transformer.moe.moe_utils")
    from megalab.core.transformer.moe.moe_utils import topk_softmax_with_capacity
    logits = torch.tensor([[0.0, 1.0], [0.0, 2.0], [0.0, 3.0], [3.0, 0.0]])  # 3 tokens want expert 1, capacity 2
    probs, routing_map, _ = topk_softmax_with_capacity(logits, 1, 1.0)
    m_probs, m_map = mu.topk_routing_with_score_function(logits, 1)
    by_position = mu.apply_router_token_dropping(m_probs, m_map, 1, 1.0, drop_policy="position")[1]
    by_probs = mu.apply_router_token_dropping(m_probs, m_map, 1, 1.0, drop_policy="probs")[1]
    first_two = torch.tensor([[False, True], [False, True], [False, False], [True, False]])
    assert torch.equal(routing_map, first_two)  # the first two arrivals at expert 1
    assert torch.equal(by_position.sum(0), first_two.sum(0))  # Megatron's "position": as many (which: topk's ties)
    assert torch.equal(by_probs, torch.tensor([[False, False], [False, True], [False, True], [True, False]]))


@pytest.mark.parametrize("seed", [0, 1])
def test_expert_bias_update_matches_megatron(mcore, monkeypatch, seed):
    """get_updated_expert_bias: Megatron all-reduces the counts over TP x DP x CP inside; one process here."""
    mu = import_mcore("megatron.core.transformer.moe.moe_utils")
    from megalab.core.transformer.moe.moe_utils import get_updated_expert_bias
    monkeypatch.setattr(mu.parallel_state, "get_tensor_and_data_parallel_group", lambda **kw: None)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: None)
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 20, (8,), generator=g).float()
    counts[3] = counts.mean()  # a balanced expert: sign 0
    bias = torch.randn(8, generator=g)
    torch.testing.assert_close(get_updated_expert_bias(counts, bias, 1e-3), mu.get_updated_expert_bias(counts.clone(), bias, 1e-3),
                               rtol=0, atol=0)


@pytest.mark.parametrize("T, E, topk, h", [(8, 4, 2, 6), (16, 8, 1, 4), (10, 3, 3, 5)])
def test_permute_unpermute_match_megatron(mcore, T, E, topk, h):
    mu = import_mcore("megatron.core.transformer.moe.moe_utils")
    from megalab.core.transformer.moe.moe_utils import permute, unpermute
    g = torch.Generator().manual_seed(T)
    tokens, logits = torch.randn(T, h, generator=g), torch.randn(T, E, generator=g)
    probs, routing_map = mu.topk_routing_with_score_function(logits, topk)
    ours, our_probs, our_idx = permute(tokens, routing_map, probs)
    # since 0.19 Megatron's permute takes the row count (its dispatcher passes routing_map.sum()) and also
    # returns the fused kernel's pad offsets and per-expert counts (None, None on the unfused path)
    theirs, their_probs, their_idx, pad_offsets, _ = mu.permute(tokens, routing_map, probs,
                                                                num_out_tokens=int(routing_map.sum()))
    assert pad_offsets is None
    assert torch.equal(ours, theirs) and torch.equal(our_probs, their_probs) and torch.equal(our_idx, their_idx)
    expert_out = ours * 2 + 1
    back = unpermute(expert_out, our_idx, T, our_probs)
    their_back = mu.unpermute(expert_out, their_idx, torch.Size([T, h]), probs=probs, routing_map=routing_map)
    torch.testing.assert_close(back, their_back, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ rank groups (megatron/core/parallel_state.py)
LAYOUTS = [  # world, tp, pp, cp, ep, etp
    (8, 2, 2, 1, 2, 1), (16, 2, 2, 2, 4, 1), (8, 1, 2, 2, 2, 2), (12, 3, 2, 1, 1, 1), (16, 2, 1, 2, 2, 2),
    (24, 2, 3, 2, 4, 1),
]
ORDERS = ["tp-cp-ep-dp-pp", "tp-pp-dp-cp-ep", "tp-dp-pp", "pp-dp-tp-cp-ep", "cp-tp-ep-dp-pp", "dp-tp-cp-pp-ep"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("world, tp, pp, cp, ep, etp", LAYOUTS)
def test_rank_groups_match_megatron(mcore, order, world, tp, pp, cp, ep, etp):
    """Every group, both generators (dense with CP, expert with EP), as Megatron's RankGenerator builds them."""
    mps = import_mcore("megatron.core.parallel_state")
    from megalab.core.parallel_state import ParallelSizes, RankGenerator, default_embedding_ranks
    if "cp" not in order and cp > 1 or "ep" not in order and ep > 1:
        with pytest.raises(ValueError, match="missing from order"):
            RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order=order) if cp > 1 else \
                RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
        with pytest.raises(RuntimeError):  # Megatron refuses it too
            mps.RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order=order) if cp > 1 else \
                mps.RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
        return
    ours_dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order=order)
    ours_expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    if order.endswith("pp"):  # initialize_model_parallel's layouts use the same generators
        sizes = ParallelSizes(world, tp, pp, cp, ep, etp, order=order)
        assert sizes.dense_generator().order == ours_dense.order and sizes.expert_generator().order == ours_expert.order
    dense = mps.RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order=order)
    expert = mps.RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    for token in ("tp", "pp", "dp", "cp", "dp-cp", "tp-pp", "tp-cp", "tp-dp", "tp-dp-cp", "tp-cp-pp"):
        assert ours_dense.get_ranks(token) == dense.get_ranks(token), token
    for token in ("tp", "ep", "dp", "pp", "tp-ep", "tp-ep-pp", "ep-dp"):
        assert ours_expert.get_ranks(token) == expert.get_ranks(token), token
    pp_groups = dense.get_ranks("pp")
    assert [mps.default_embedding_ranks(g) for g in pp_groups] == [default_embedding_ranks(g) for g in pp_groups]


@pytest.mark.parametrize("offset", [0, 8])
def test_rank_generator_offset_matches_megatron(mcore, offset):
    mps = import_mcore("megatron.core.parallel_state")
    from megalab.core.parallel_state import RankGenerator
    ours, theirs = RankGenerator(2, 1, 2, 2, 1, "tp-dp-pp", offset), mps.RankGenerator(2, 1, 2, 2, 1, "tp-dp-pp", offset)
    for token in ("tp", "dp", "pp", "tp-dp"):
        assert ours.get_ranks(token) == theirs.get_ranks(token)


# ------------------------------------------------------------------ context parallel batch split (megatron/core/utils.py)
@pytest.mark.parametrize("cp, b, s", [(1, 2, 16), (2, 2, 16), (4, 2, 16), (2, 1, 32), (4, 1, 32), (2, 3, 8)])
def test_get_batch_on_this_cp_rank_matches_megatron(mcore, monkeypatch, cp, b, s):
    """Megatron's zigzag split (chunks r and 2cp-1-r of 2cp), every key; the attention mask on its dim 2."""
    mutils = import_mcore("megatron.core.utils")
    from megalab.core.utils import get_batch_on_this_cp_rank
    g = torch.Generator().manual_seed(b * s + cp)
    batch = {"tokens": torch.randint(0, 100, (b, s), generator=g), "labels": torch.randint(0, 100, (b, s), generator=g),
             "loss_mask": torch.rand(b, s, generator=g), "position_ids": torch.arange(s).expand(b, s),
             "attention_mask": torch.rand(b, 1, s, s, generator=g) > 0.5}
    cp_group = object()  # since 0.19 Megatron asks the CP group passed in for its size and rank
    for rank in range(cp):
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group: cp if group is cp_group else 1 / 0)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group, r=rank: r if group is cp_group else 1 / 0)
        theirs = mutils.get_batch_on_this_cp_rank({k: v.clone() for k, v in batch.items()}, is_hybrid_cp=False,
                                                  cp_group=cp_group)
        ours = get_batch_on_this_cp_rank({k: v.clone() for k, v in batch.items()}, cp, rank)
        assert ours.keys() == theirs.keys()
        for key in batch:
            assert torch.equal(ours[key], theirs[key]), (key, rank)


# ------------------------------------------------------------------ pipeline schedules (megatron/core/pipeline_parallel/schedules.py)
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 12, 16])
@pytest.mark.parametrize("vp", [1, 2, 3])
def test_pipeline_warmup_and_interleaved_table_match_megatron(mcore, monkeypatch, pp, m, vp):
    sched = import_mcore("megatron.core.pipeline_parallel.schedules")
    from megalab.core.pipeline_parallel.schedules import get_num_warmup_microbatches, get_schedule_table
    monkeypatch.setattr(sched.parallel_state, "get_pipeline_model_parallel_world_size", lambda: pp)
    monkeypatch.setattr(sched.parallel_state, "get_virtual_pipeline_model_parallel_world_size",
                        lambda: vp if vp > 1 else None)
    for rank in range(pp):
        monkeypatch.setattr(sched.parallel_state, "get_pipeline_model_parallel_rank", lambda r=rank: r)
        total, _, warmup, _ = sched.get_pp_rank_microbatches(m, vp, pp)
        assert get_num_warmup_microbatches(pp, rank, m, vp) == warmup, (pp, rank, m, vp)
        assert total == m * vp
    if vp > 1:
        assert get_schedule_table(m, vp, pp) == sched.get_schedule_table(m, vp, pp)


# ------------------------------------------------------------------ OptimizerParamScheduler (megatron/core/optimizer_param_scheduler.py)
SCHEDULES = [dict(lr_decay_style=s) for s in ("constant", "linear", "cosine", "inverse-square-root")] + [
    dict(lr_decay_style="WSD", wsd_decay_steps=10, lr_wsd_decay_style=w) for w in ("linear", "cosine", "exponential", "minus_sqrt")]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda d: "-".join(str(v) for v in d.values()))
@pytest.mark.parametrize("warmup, decay, init_lr", [(5, 30, 0.0), (0, 20, 0.0), (4, 12, 0.1)])
@pytest.mark.parametrize("wd", [("constant", 0.1, 0.1), ("linear", 0.01, 0.1), ("cosine", 0.0, 0.05)])
def test_optimizer_param_scheduler_matches_megatron(mcore, schedule, warmup, decay, init_lr, wd):
    mops = import_mcore("megatron.core.optimizer_param_scheduler")
    from megalab.core.optimizer_param_scheduler import OptimizerParamScheduler
    if "wsd_decay_steps" in schedule:  # at most the decay phase
        schedule = {**schedule, "wsd_decay_steps": min(schedule["wsd_decay_steps"], decay - warmup)}
    style, start_wd, end_wd = wd
    groups = lambda: torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},  # noqa: E731
                                      {"params": [torch.nn.Parameter(torch.zeros(1))], "wd_mult": 0.0}], lr=1.0)
    ours_opt, theirs_opt = groups(), groups()
    ours = OptimizerParamScheduler(ours_opt, 1.0, 0.05, warmup, decay, init_lr=init_lr, start_wd=start_wd,
                                   end_wd=end_wd, wd_incr_steps=decay, wd_incr_style=style, **schedule)
    theirs = mops.OptimizerParamScheduler(theirs_opt, init_lr=init_lr, max_lr=1.0, min_lr=0.05, lr_warmup_steps=warmup,
                                          lr_decay_steps=decay, start_wd=start_wd, end_wd=end_wd, wd_incr_steps=decay,
                                          wd_incr_style=style, **schedule)
    for step in range(decay + 5):
        for a, b in zip(ours_opt.param_groups, theirs_opt.param_groups):
            assert a["lr"] == pytest.approx(b["lr"], rel=1e-12, abs=1e-15), (step, a["lr"], b["lr"])
            assert a["weight_decay"] == pytest.approx(b["weight_decay"], rel=1e-12, abs=1e-15), step
        ours.step(1)
        theirs.step(1)


# ------------------------------------------------------------------ datasets (megatron/core/datasets)
def _documents(seed, n=24):
    rng = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (int(torch.randint(2, 40, (1,), generator=rng)),), generator=rng) for _ in range(n)]


@pytest.mark.parametrize("dtype", ["uint16", "int32", "int64"])
@pytest.mark.parametrize("seed", [0, 1])
def test_indexed_dataset_bytes_both_ways(mcore, tmp_path, dtype, seed):
    """megalab's builder writes Megatron's .bin/.idx byte for byte, and each reads the other's files."""
    import numpy as np

    mid = import_mcore("megatron.core.datasets.indexed_dataset")
    from megalab.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    docs, np_dtype = _documents(seed), getattr(np, dtype)
    ours = IndexedDatasetBuilder(tmp_path / "ours", dtype=np_dtype)
    theirs = mid.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np_dtype)
    for doc in docs:
        ours.add_item(doc)
        ours.end_document()
        theirs.add_item(doc)
        theirs.end_document()
    ours.finalize()
    theirs.finalize(str(tmp_path / "theirs.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes(), suffix
    mine_read_by_megatron, theirs_read_by_us = mid.IndexedDataset(str(tmp_path / "ours")), IndexedDataset(tmp_path / "theirs")
    assert len(mine_read_by_megatron) == len(theirs_read_by_us) == len(docs)
    for i, doc in enumerate(docs):
        assert np.array_equal(mine_read_by_megatron[i], doc.numpy()) and np.array_equal(theirs_read_by_us[i], doc.numpy())
        assert np.array_equal(mine_read_by_megatron.get(i, 1, 1), theirs_read_by_us.get(i, 1, 1))


class _Tokenizer:  # what GPTDatasetConfig reads of a tokenizer
    eod, pad, vocab_size = 0, -1, 512
    unique_identifiers = {"class": "megalab-test"}


@pytest.mark.parametrize("seq_length, num_samples, seed", [(16, 10, 1234), (8, 60, 7), (16, 75, 5), (12, 120, 11)])
@pytest.mark.parametrize("flags", [(False, False), (True, True)])
def test_gpt_dataset_matches_megatron(mcore, tmp_path, seq_length, num_samples, seed, flags):
    """The document, sample and shuffle indices (one and several epochs, the final epoch apart or not) and
    every item's tokens, labels, loss mask and position ids, as Megatron's GPTDataset builds them."""
    import numpy as np

    mid = import_mcore("megatron.core.datasets.indexed_dataset")
    mgpt = import_mcore("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets.utils import Split

    from megalab.core.datasets.gpt_dataset import GPTDataset
    from megalab.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    docs = _documents(seed)
    for d in docs[::3]:
        d[-1] = 0  # some documents end with eod
    with IndexedDatasetBuilder(tmp_path / "c", dtype=np.int32) as builder:
        for doc in docs:
            builder.add_item(doc)
            builder.end_document()
        builder.finalize()
    reset, eod_mask = flags
    config = mgpt.GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=None, blend_per_split=None,
                                   split="1,0,0", tokenizer=_Tokenizer(), reset_position_ids=reset,
                                   reset_attention_mask=False, eod_mask_loss=eod_mask, path_to_cache=None,
                                   mmap_bin_files=False)
    theirs = mgpt.GPTDataset(mid.IndexedDataset(str(tmp_path / "c")), str(tmp_path / "c"),
                             np.arange(len(docs), dtype=np.int32), num_samples, Split.train, config)
    ours = GPTDataset(IndexedDataset(tmp_path / "c"), seq_length, num_samples, seed, eod=0, reset_position_ids=reset,
                      eod_mask_loss=eod_mask)
    assert np.array_equal(ours.document_index, theirs.document_index)
    assert np.array_equal(ours.sample_index, theirs.sample_index)
    assert np.array_equal(ours.shuffle_index, theirs.shuffle_index)
    for i in range(num_samples):
        a, b = ours[i], theirs[i]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(a[key].to(b[key].dtype), b[key]), (i, key)


@pytest.mark.parametrize("weights, size", [([0.3, 0.7], 100), ([1, 2, 3], 257), ([0.5, 0.25, 0.125, 0.125], 64), ([5.0], 10)])
def test_blending_indices_match_megatron(mcore, weights, size):
    import numpy as np

    helpers = import_mcore("megatron.core.datasets.helpers")
    mutils = import_mcore("megatron.core.datasets.utils")
    from megalab.core.datasets.blended_dataset import build_blending_indices, normalize
    w = normalize(weights)
    assert np.allclose(w, mutils.normalize(weights))
    dataset_index, dataset_sample_index = np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, np.asarray(mutils.normalize(weights)),
                                   len(weights), size, False)
    ours = build_blending_indices(w, size)
    assert np.array_equal(ours[0], dataset_index) and np.array_equal(ours[1], dataset_sample_index)


@pytest.mark.parametrize("n", [100, 997, 4096])
def test_blended_dataset_sizes_match_megatron(mcore, n):
    """Each dataset of a blend is built with ceil(ceil(n * w) * 1.005) samples, as Megatron's builder sizes it."""
    from megalab.core.datasets.blended_dataset import dataset_size, normalize

    builder = import_mcore("megatron.core.datasets.blended_megatron_dataset_builder")
    for weights in ([1 / 3, 2 / 3], [0.1, 0.2, 0.7], [5, 3, 2]):
        theirs = builder._get_size_per_split_per_dataset(normalize(weights), [n, 0, 0], surplus=0.005)
        assert [dataset_size(w, n) for w in normalize(weights)] == [row[0] for row in theirs], (weights, n)


# ------------------------------------------------------------------ vocab padding, parameter counts (megatron/training: not in
# the megatron-core wheel; transcribed and cited)
def _megatron_vocab_size_with_padding(orig_vocab_size, make_vocab_size_divisible_by, tensor_model_parallel_size):
    """Megatron-LM megatron/training/tokenizer/tokenizer.py, _vocab_size_with_padding (commit 00caa53a): round up
    to a multiple of make_vocab_size_divisible_by * tensor_model_parallel_size."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(orig_vocab_size / multiple) * multiple)


@pytest.mark.parametrize("vocab, divisible, tp", [(50257, 128, 1), (50257, 128, 8), (32000, 64, 4), (128, 128, 1),
                                                  (1, 1, 3), (151936, 128, 2)])
def test_vocab_padding_matches_megatron(vocab, divisible, tp):
    from megalab.core.tensor_parallel.utils import vocab_size_with_padding
    assert vocab_size_with_padding(vocab, divisible, tp) == _megatron_vocab_size_with_padding(vocab, divisible, tp)


def _megatron_theoretical_parameters(c, padded_vocab_size):
    """The parameter count of Megatron-LM megatron/training/theoretical_memory_usage.py,
    compute_weight_and_optimizer_memory (commit 00caa53a), restated for one MoE-or-dense layer kind: attention
    2 h^2 (1 + groups/heads) (heads * kv_channels / h); MLP 2 h ffn (3/2 if gated) per expert and shared
    expert; 2 norms per layer and a final one of `norm_size` h each (2 for LayerNorm, 1 for RMSNorm); the
    embedding h * padded vocab, twice when untied. It leaves out biases, the router and learned positions."""
    h, L = c.hidden_size, c.num_layers
    gated = 3 / 2 if c.gated_linear_unit else 1
    norm_size = 1 if c.normalization == "RMSNorm" else 2
    attention = 2 * h * h * (1 + c.num_query_groups / c.num_attention_heads) * (c.kv_channels * c.num_attention_heads / h)
    if c.num_moe_experts is None:
        mlp = c.ffn_hidden_size * gated
    else:
        mlp = c.moe_ffn_hidden_size * c.num_moe_experts * gated + (c.moe_shared_expert_intermediate_size or 0) * gated
    layer = 2 * h * (mlp + norm_size) + attention
    embedding = h * padded_vocab_size * (1 if c.share_embeddings_and_output_weights else 2)
    return layer * L + norm_size * h + embedding


PARAM_CONFIGS = [
    dict(),
    dict(num_query_groups=2, gated_linear_unit=True, activation_func="silu", normalization="RMSNorm"),
    dict(share_embeddings_and_output_weights=False, num_query_groups=1),
    dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48),
    dict(num_moe_experts=4, moe_shared_expert_intermediate_size=32, gated_linear_unit=True, activation_func="silu"),
]


@pytest.mark.parametrize("change", PARAM_CONFIGS)
def test_parameter_count_matches_megatrons_theoretical_memory(change):
    """calc.model_parameters == Megatron's theoretical count + what that count leaves out (router, biases,
    learned positions), and == the parameters GPTModel really has."""
    from megalab.core.models.gpt.gpt_model import GPTModel
    from megalab.core.transformer.transformer_config import TransformerConfig
    from megalab.extras import calc
    config = TransformerConfig(**{**dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128,
                                         seq_length=16, ffn_hidden_size=64, add_bias_linear=False,
                                         position_embedding_type="rope"), **change})
    ours = calc.model_parameters(config)
    router = config.num_layers * config.num_moe_experts * config.hidden_size if config.num_moe_experts else 0
    assert ours["total"] == _megatron_theoretical_parameters(config, config.vocab_size) + router
    assert ours["total"] == sum(p.numel() for p in GPTModel(config).parameters())


@pytest.mark.parametrize("scale", [1.0, 0.25, 2.0 / 8])
def test_aux_loss_autoscaler_matches_megatron(mcore, scale):
    """The gradient an aux loss receives through MoEAuxLossAutoScaler, for the scale Megatron's schedule sets
    (loss_scale * cp / num_microbatches): ours (read at forward) == Megatron's (read at backward)."""
    mu = import_mcore("megatron.core.transformer.moe.moe_utils")
    from megalab.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    grads = []
    for scaler in (MoEAuxLossAutoScaler, mu.MoEAuxLossAutoScaler):
        saved = scaler.main_loss_backward_scale
        try:
            scaler.set_loss_scale(torch.tensor(scale))
            w = torch.tensor([1.0, 2.0], requires_grad=True)
            out = scaler.apply(w * 3, (w ** 2).sum())
            out.sum().backward()
            grads.append(w.grad.clone())
        finally:
            scaler.main_loss_backward_scale = saved
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    torch.testing.assert_close(grads[0], torch.tensor([3.0, 3.0]) + scale * torch.tensor([2.0, 4.0]))


# ------------------------------------------------------------------ tensor-parallel layers (megatron/core/tensor_parallel/layers.py)
def _tp_layers_case():
    """2 ranks, TP=2, gloo: Megatron's ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding with
    use_cpu_initialization next to megalab's: the rank's slice of a master weight (_initialize_affine_weight_cpu),
    and with Megatron's shards loaded, the outputs and gradients."""
    import warnings

    import torch.distributed as dist

    from megalab.core import parallel_state as ps
    from megalab.core.tensor_parallel import layers as ours
    from megalab.core.transformer.transformer_config import TransformerConfig
    from megalab.lab import dist as mdist
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as mps
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel import layers as theirs
    torch.cuda.current_device = lambda: "cpu"  # Megatron allocates its gather buffers on "the current CUDA device"
    rank, _ = mdist.init()
    state = ps.initialize_model_parallel(tensor_model_parallel_size=2)
    mps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        cfg = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=32, seq_length=4,
                                   ffn_hidden_size=12)
        init = lambda w: torch.nn.init.normal_(w, std=0.5)  # noqa: E731
        arange = lambda w: w.copy_(torch.arange(w.numel(), dtype=w.dtype).view_as(w))  # noqa: E731
        out = {"split": {}}
        for dim, stride in ((0, 1), (1, 1), (0, 2)):  # which slice of the master weight is this rank's
            shape = (12, 8)
            mine = torch.empty(shape[0] // 2 if dim == 0 else shape[0], shape[1] // 2 if dim == 1 else shape[1])
            theirs._initialize_affine_weight_cpu(mine, *shape, mine.shape[dim], dim, arange, stride)
            out["split"][f"dim {dim}, stride {stride}"] = torch.equal(
                mine, ours._split_master(arange(torch.empty(shape)), dim, state.get_tensor_model_parallel_group(), stride))
        torch.manual_seed(1)
        m_w = theirs.ColumnParallelLinear(8, 12, config=cfg, init_method=init, bias=False).weight
        torch.manual_seed(1)
        o_w = ours.ColumnParallelLinear(8, 12, config=config, init_method=init, bias=False).weight
        out["same seed, same draws"] = torch.equal(m_w, o_w)  # deliberately not: see the test
        x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(7))
        for gather in (False, True):
            m_col = theirs.ColumnParallelLinear(8, 12, config=cfg, init_method=init, bias=True, gather_output=gather)
            m_row = theirs.RowParallelLinear(12, 8, config=cfg, init_method=init, bias=True, input_is_parallel=not gather,
                                             skip_bias_add=False)
            o_col = ours.ColumnParallelLinear(8, 12, config=config, init_method=init, bias=True, gather_output=gather)
            o_row = ours.RowParallelLinear(12, 8, config=config, init_method=init, bias=True, input_is_parallel=not gather)
            with torch.no_grad():  # Megatron's shards (and nonzero biases) into ours
                for a in (m_col.bias, m_row.bias):
                    a.copy_(torch.linspace(-1, 1, a.numel()))
                for a, b in ((m_col.weight, o_col.weight), (m_row.weight, o_row.weight), (m_col.bias, o_col.bias),
                             (m_row.bias, o_row.bias)):
                    b.copy_(a)
            m_x, o_x = x.clone().requires_grad_(), x.clone().requires_grad_()
            m_y = m_row(m_col(m_x)[0])[0]
            o_y = o_row(o_col(o_x))
            m_y.square().sum().backward()
            o_y.square().sum().backward()
            out[f"gather_output={gather}"] = {
                "output": torch.allclose(m_y, o_y, atol=1e-5), "input grad": torch.allclose(m_x.grad, o_x.grad, atol=1e-5),
                "column weight grad": torch.allclose(m_col.weight.grad, o_col.weight.grad, atol=1e-5),
                "row weight grad": torch.allclose(m_row.weight.grad, o_row.weight.grad, atol=1e-5),
                "row bias grad": torch.allclose(m_row.bias.grad, o_row.bias.grad, atol=1e-5)}
        m_emb = theirs.VocabParallelEmbedding(32, 8, init_method=init, config=cfg)
        o_emb = ours.VocabParallelEmbedding(32, 8, init_method=init)
        with torch.no_grad():
            o_emb.weight.copy_(m_emb.weight)
        ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(5))
        out["embedding"] = {"output": torch.allclose(m_emb(ids), o_emb(ids))}
        return out
    finally:
        ps.destroy_model_parallel()
        mps.destroy_model_parallel()
        dist.barrier()


def test_tensor_parallel_layers_match_megatron(mcore):
    from megalab.lab import launch
    results = launch.run_function(_tp_layers_case, 2, launch=dict(backend="gloo", timeout=180)).returns
    for rank, cases in results.items():
        # deliberate difference (03·03 says so): megalab's Linear first runs nn.Linear's own init, then init_method,
        # so the same seed gives other weights than Megatron's single draw; the split of a master weight is the same
        assert cases.pop("same seed, same draws") is False
        for case, checks in cases.items():
            assert all(checks.values()), (rank, case, checks)


# ------------------------------------------------------------------ every load-balancing loss, through Megatron's own TopKRouter.routing
class _GroupOfOne:
    def size(self):
        return 1


def _mcore_topk_router(monkeypatch, E, topk, score, types, coeffs, z_coeff):
    """Megatron's TopKRouter.routing itself, bound to a stand-in `self` (the class allocates CUDA buffers in
    __init__): one process, so its TP/CP/DP groups are groups of one."""
    import types as pytypes

    mr = import_mcore("megatron.core.transformer.moe.router")
    mu = import_mcore("megatron.core.transformer.moe.moe_utils")
    monkeypatch.setattr(mu, "reduce_from_tensor_model_parallel_region", lambda x, group=None: x)
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    get_moe_metrics_tracker().clear()
    cfg = pytypes.SimpleNamespace(
        num_moe_experts=E, moe_router_topk=topk, moe_router_score_function=score, moe_router_pre_softmax=False,
        moe_router_num_groups=None, moe_router_group_topk=None, moe_router_topk_scaling_factor=None,
        moe_router_fusion=False, moe_expert_capacity_factor=None, moe_token_drop_policy="probs",
        moe_pad_expert_input_to_capacity=False, moe_aux_loss_coeff=coeffs, moe_z_loss_coeff=z_coeff, num_layers=1,
        mtp_num_layers=None, mtp_use_repeated_layer=False)
    self = pytypes.SimpleNamespace(
        config=cfg, topk=topk, routing_type=types, score_function=score, expert_bias=None, router_replay=None,
        tp_cp_group=_GroupOfOne(), tp_dp_cp_group=_GroupOfOne(), layer_number=1, is_mtp_layer=False, calculate_per_token_loss=False,
        training=True, enable_expert_bias=False, global_tokens_per_expert=torch.zeros(E), ga_steps=torch.zeros(()))
    for name in ("apply_z_loss", "get_aux_loss_coeff", "is_aux_loss_enabled", "_apply_aux_loss", "_apply_seq_aux_loss",
                 "_apply_global_aux_loss", "attach_and_log_load_balancing_loss"):
        setattr(self, name, pytypes.MethodType(getattr(mr.TopKRouter, name), self))
    self._apply_expert_bias = lambda routing_map, padding_mask=None: None
    routing = pytypes.MethodType(mr.TopKRouter.routing, self)
    tracker = lambda: {k: v.values[0].item() for k, v in get_moe_metrics_tracker().metrics.items()}  # noqa: E731
    return routing, tracker, get_moe_metrics_tracker()


BALANCING = [("aux_loss", 0.5), ("seq_aux_loss", 0.3), ("global_aux_loss", 0.2),
             (["aux_loss", "seq_aux_loss", "global_aux_loss"], [0.1, 0.2, 0.3]), (["seq_aux_loss", "none"], [1.0, 0.0])]


@pytest.mark.parametrize("types, coeffs", BALANCING)
@pytest.mark.parametrize("score, topk, s, b, E", [("softmax", 2, 6, 3, 4), ("sigmoid", 2, 4, 2, 8), ("softmax", 1, 5, 1, 4)])
def test_every_load_balancing_loss_matches_megatrons_router(mcore, monkeypatch, types, coeffs, score, topk, s, b, E):
    """aux_loss, seq_aux_loss, global_aux_loss (two steps: its counts accumulate), alone and together, with the
    z-loss: each loss value and the router weight's gradient through all of them, as Megatron's routing computes."""
    from megalab.core.transformer.moe.router import TopKRouter
    from megalab.core.transformer.transformer_config import TransformerConfig
    routing, tracker, metrics = _mcore_topk_router(monkeypatch, E, topk, score, types, coeffs, 0.01)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=32, seq_length=s,
                               ffn_hidden_size=16, num_moe_experts=E, moe_router_topk=topk, moe_router_score_function=score,
                               moe_router_load_balancing_type=types, moe_aux_loss_coeff=coeffs, moe_z_loss_coeff=0.01)
    torch.manual_seed(s * b)
    router = TopKRouter(config).train()
    weight = router.weight.detach().clone().requires_grad_()
    g = torch.Generator().manual_seed(E)
    names = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
             "global_aux_loss": "global_load_balancing_loss"}
    for step in range(2):
        hidden = torch.randn(s, b, 8, generator=g)
        probs, routing_map = router(hidden)
        (probs * torch.linspace(0.5, 1.5, E)).sum().backward()
        metrics.clear()
        m_probs, m_map = routing(hidden @ weight.t())  # [s, b, E] logits, as Megatron's router sees them
        (m_probs * torch.linspace(0.5, 1.5, E)).sum().backward()
        theirs = tracker()
        assert torch.equal(routing_map, m_map) and torch.allclose(probs, m_probs, atol=1e-6)
        for t in [types] if isinstance(types, str) else types:
            if t != "none":
                assert router.aux_losses[names[t]].item() == pytest.approx(theirs[names[t]], rel=1e-5), (step, t)
        assert router.aux_losses["z_loss"].item() == pytest.approx(0.01 * theirs["z_loss"], rel=1e-5)
        torch.testing.assert_close(router.weight.grad, weight.grad, rtol=1e-5, atol=1e-6)


def test_rank_groups_match_megatron_for_every_order(mcore):
    """All 120 orders of tp, cp, ep, dp, pp (dense generator with CP, expert generator with EP), every group."""
    import itertools

    mps = import_mcore("megatron.core.parallel_state")
    from megalab.core.parallel_state import RankGenerator
    tokens = ["tp", "pp", "dp", "cp", "ep", "tp-pp", "tp-dp", "dp-cp", "tp-cp", "tp-dp-cp", "tp-ep", "tp-ep-pp", "ep-dp"]
    for order in ("-".join(p) for p in itertools.permutations(["tp", "cp", "ep", "dp", "pp"])):
        for tp, ep, dp, pp, cp in ((2, 1, 2, 3, 2), (2, 2, 3, 2, 1), (3, 1, 2, 2, 2)):
            ours, theirs = RankGenerator(tp, ep, dp, pp, cp, order), mps.RankGenerator(tp, ep, dp, pp, cp, order)
            for token in tokens:
                if all(t in order for t in token.split("-")):
                    assert ours.get_ranks(token) == theirs.get_ranks(token), (order, (tp, ep, dp, pp, cp), token)
