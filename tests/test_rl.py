"""GRPO and the train/serve check (megalab/rl/, megalab/train_rl.py): Megatron's advantages and per-token loss, a
tiny run whose reward goes up, and the detector naming each planted systems bug with its public report."""

from __future__ import annotations

import random
import re

import pytest
import torch

from megalab.rl.agent.arithmetic_agent import END_OF_ANSWER, MAX_RESPONSE_LENGTH, PROMPT_LENGTH, ArithmeticAgent
from megalab.rl.logprob_check import TrainServeMismatch, check_loss_normalization, diagnose
from megalab.rl.rl_utils import calculate_grpo_advantages, calculate_grpo_loss, compute_logprobs, reduce_loss
from megalab.train_rl import GRPOConfig, build_engine, build_policy, collect_rollouts, grpo_step, train_rl


def test_advantages_and_clipped_loss_as_megatron():
    adv = calculate_grpo_advantages(torch.tensor([[-1.0, 1.0], [4.0, 4.0]]))  # Megatron's docstring example
    assert torch.allclose(adv, torch.tensor([[-1.0, 1.0], [0.0, 0.0]]), atol=1e-3)
    old = torch.zeros(2, 1)
    current = torch.log(torch.tensor([[1.5], [0.5]])).requires_grad_()  # ratios 1.5 and 0.5
    loss, _, ratios = calculate_grpo_loss(current, old, torch.tensor([1.0, -1.0]), 0.2, 0.2)
    assert torch.allclose(loss, torch.tensor([[-1.2], [0.8]]))  # both clipped: -min(r A, clip(r) A)
    loss.sum().backward()
    assert torch.equal(current.grad, torch.zeros(2, 1))  # a clipped token pushes no further
    per_token = torch.tensor([[2.0, 2, 2, 2, 2], [10, 3, 4, 5, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert reduce_loss(per_token, mask, "token") == pytest.approx(20 / 6)  # Megatron: Σ / tokens
    assert reduce_loss(per_token, mask, "sequence") == pytest.approx(6.0)


def test_reward_goes_up():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the fastest on a busy 2-core machine
    try:
        # 8 prompts x 8 rollouts a step; measured, seeds 0/1/2: 0.09/0.07/0.14 -> 0.43/0.44/0.41 (first 6 -> last 6 steps)
        history = train_rl(24, GRPOConfig(seed=0, num_prompts=8))
    finally:
        torch.set_num_threads(threads)
    first = sum(h["reward"] for h in history[:6]) / 6
    last = sum(h["reward"] for h in history[-6:]) / 6
    assert last > first + 0.15, f"mean reward {first:.3f} (first 6 steps) -> {last:.3f} (last 6)"
    assert max(h["max_logprob_diff"] for h in history) < 1e-4


def test_ragged_rollouts_and_normalization():
    """Responses of 1-3 tokens (digits, then END_OF_ANSWER): the mask keeps exactly each response's tokens, the
    engine's log-probs line up with the trainer's, and per-token vs per-sequence normalisation then differ."""
    config = GRPOConfig(num_prompts=8, group_size=4)
    model = build_policy(0)
    engine = build_engine(model, config)
    batch = collect_rollouts(engine, ArithmeticAgent(), random.Random(0), config, 0)
    lengths = batch.response_lengths
    assert sorted(set(lengths.tolist())) == [1, 2, 3], f"response lengths {lengths.tolist()}: not ragged"
    assert torch.equal(batch.loss_mask.sum(-1).long(), lengths)
    for row, n in enumerate(lengths.tolist()):  # a response ends at END_OF_ANSWER or at the longest allowed
        response = batch.tokens[row, PROMPT_LENGTH:PROMPT_LENGTH + n].tolist()
        assert response[-1] == END_OF_ANSWER or n == MAX_RESPONSE_LENGTH
        assert END_OF_ANSWER not in response[:-1]
    with torch.no_grad():
        trainer = compute_logprobs(model, batch.tokens)[batch.loss_mask.bool()]
    assert (trainer - batch.engine_logprobs).abs().max() < 1e-4
    advantages = calculate_grpo_advantages(batch.rewards).flatten()
    grads, losses = {}, {}
    for normalization in ("token", "sequence"):
        model.zero_grad()
        current = compute_logprobs(model, batch.tokens)
        per_token, _, _ = calculate_grpo_loss(current, current.detach(), advantages)
        loss = reduce_loss(per_token, batch.loss_mask, normalization)
        loss.backward()
        losses[normalization] = float(loss.detach())
        grads[normalization] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert abs(losses["token"] - losses["sequence"]) > 1e-3, losses
    gap = float((grads["token"] - grads["sequence"]).norm() / grads["token"].norm())  # measured: 0.19
    assert gap > 0.1, f"per-token and per-sequence gradients differ by only {gap:.3f} of their norm"


def _trained_pair():
    config = GRPOConfig(num_prompts=4, group_size=4)
    model, rng = build_policy(0), random.Random(0)
    engine = build_engine(model, config)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    grpo_step(model, optimizer, engine, ArithmeticAgent(), rng, config, 0)
    return config, model, engine, optimizer, rng


def _next_step_error(config, model, engine, optimizer, rng) -> str:
    with pytest.raises(TrainServeMismatch) as info:
        grpo_step(model, optimizer, engine, ArithmeticAgent(), rng, config, 2)  # the engine should have 2 refits
    return str(info.value)


def test_detector_names_weight_bugs():
    config, model, engine, optimizer, rng = _trained_pair()
    grpo_step(model, optimizer, engine, ArithmeticAgent(), rng, config, 1, refit=False)  # refit skipped
    assert "stale weights (trl #5312): the engine has had 1 refits, the trainer expects 2" in _next_step_error(config, model, engine, optimizer, rng)

    config, model, engine, optimizer, rng = _trained_pair()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    w = state["decoder.layers.0.mlp.linear_fc1.weight"]  # column-parallel: tp2 shards are its halves along dim 0
    state["decoder.layers.0.mlp.linear_fc1.weight"] = torch.cat(w.chunk(2)[::-1])
    engine.update_weights(state)
    assert "wrong slice (AReaL #1560)" in _next_step_error(config, model, engine, optimizer, rng)

    config, model, engine, optimizer, rng = _trained_pair()
    engine.update_weights({k: v.bfloat16().float() for k, v in model.state_dict().items()})  # a refit in bf16
    assert "precision (trl #3867)" in _next_step_error(config, model, engine, optimizer, rng)


def test_detector_names_temperature_and_normalization_bugs():
    config, model, engine, _, rng = _trained_pair()
    config.temperature = 0.7
    batch = collect_rollouts(engine, ArithmeticAgent(), rng, config, 1)
    mask = batch.loss_mask.bool()
    with torch.no_grad():
        raw, tempered = compute_logprobs(model, batch.tokens)[mask], compute_logprobs(model, batch.tokens, 0.7)[mask]
    assert diagnose(model, engine, batch.tokens, batch.loss_mask, raw, batch.engine_logprobs, 0.7, 1) == []
    engine_side = diagnose(model, engine, batch.tokens, batch.loss_mask, raw, tempered, 0.7, 1)
    assert [c for c, _, _ in engine_side] == ["temperature (engine side only)"]
    trainer_side = diagnose(model, engine, batch.tokens, batch.loss_mask, tempered, batch.engine_logprobs, 0.7, 1)
    assert [(c, r) for c, r, _ in trainer_side] == [("temperature (trainer side only)", "vllm #42259")]
    assert check_loss_normalization(lambda t, m: reduce_loss(t, m, "token")) == []
    found = check_loss_normalization(lambda t, m: reduce_loss(t, m, "sequence"))
    assert [(c, r) for c, r, _ in found] == [("per-sequence normalization", "Megatron-LM #4590")]


def test_reward_function_that_raises_is_named():
    agent = ArithmeticAgent(reward_fn=lambda prompt, response: 1 / 0)
    prompt = agent.get_prompt(random.Random(0))
    with pytest.raises(RuntimeError, match=re.escape(f"agent 'arithmetic': the reward function raised on prompt "
                                                     f"{prompt.text()!r}, response [3]: ZeroDivisionError")):
        agent.get_reward(prompt, [3])
    with pytest.raises(RuntimeError, match="returned None"):
        ArithmeticAgent(reward_fn=lambda p, r: None).get_reward(prompt, [3])
    config, model, engine, optimizer, rng = _trained_pair()  # inside the loop: the step stops before any update
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"agent 'arithmetic': the reward function raised on prompt '\d\+\d='"):
        grpo_step(model, optimizer, engine, agent, rng, config, 1)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert engine.weights_version == 1 and not engine.has_unfinished_requests()
