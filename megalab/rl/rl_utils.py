"""GRPO as Megatron-RL computes it: group-relative advantages, the clipped objective, the per-token loss.

    a prompt ──engine──> G rollouts ──reward──> r_1..r_G ──> advantage A_i = (r_i - mean(r)) / (1e-4 + std(r))
    every response token t of rollout i:  ratio = exp(logp_now - logp_old)
        loss_t = -min(ratio · A_i, clamp(ratio, 1 - eps_lower, 1 + eps_upper) · A_i) + kl_beta · KL_t
    the step's loss = Σ loss_t over every response token of the batch / the number of those tokens

Normalisation (the choice Megatron-LM #4590 is about): PER TOKEN over the whole batch. train_rl.py's
`loss_func` returns [Σ masked per-token losses, number of tokens] and the schedule divides the batch's sum by
its token count when --calculate-per-token-loss is set. megatron/core/pipeline_parallel/schedules.py
(forward_step), without the flag, divides each micro-batch's sum by that micro-batch's tokens, then by the
number of micro-batches: still per token, within a micro-batch. The flag is in examples/rl/README.md's command
and in 7 of the 14 model configs at the pin (the Qwen2.5 and Nemotron-5 ones). A long response thus weighs in proportion to its length; the per-sequence
alternative (GRPO paper: mean over each response, then over responses) gives each response the same weight,
so each token of a short response counts more.

`reduce_loss(per_token, loss_mask, "sequence")` computes the per-sequence one for comparison: on the task's
ragged responses (1-3 tokens) the two give measurably different losses and gradients (tests/test_rl.py).

Megatron: megatron/rl/rl_utils.py (calculate_grpo_advantages: population std, +1e-4; calculate_grpo_loss: the
k3 KL estimator exp(d) - d - 1 with d = logp_ref - logp, the importance weight exp(logp_old - logp_inference)
when the engine's log-probs are given), train_rl.py (loss_func).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def calculate_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """rewards [num_groups, group_size] -> advantages [num_groups, group_size]: each group's rewards minus the
    group's mean, over (1e-4 + the group's population std). A group whose rollouts all scored the same teaches
    nothing (advantages 0)."""
    # EXERCISE rl.calculate_grpo_advantages: each reward minus its group's mean, over 1e-4 + the group's population std
    ### BEGIN SOLUTION
    # HINT 1: GRPO has no value network: a rollout is good or bad only relative to the other G rollouts of the
    #         SAME prompt (one row of `rewards`). Centre each row on its own mean and scale it by its own spread;
    #         the small constant keeps a row of equal rewards (spread 0) at advantage 0 instead of 0/0.
    # HINT 2: Along the last dimension (keepdim, so the row's statistics broadcast over the row): the mean, and the
    #         POPULATION standard deviation (divide by G, not G - 1: torch's std needs correction=0). Then
    #         (reward - mean) / (1e-4 + std), computed in float64 and returned as float32.
    rewards = rewards.double()
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True, correction=0)
    return ((rewards - mean) / (1e-4 + std)).float()
    ### END SOLUTION


def calculate_grpo_loss(current_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        clamp_eps_lower: float = 0.2, clamp_eps_upper: float = 0.2, kl_beta: float = 0.0,
                        ref_logprobs: torch.Tensor | None = None, inference_logprobs: torch.Tensor | None = None,
                        is_truncation_coef: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss [b, s], KL term [b, s], ratios [b, s]; advantages [b] (one per rollout)."""
    ratios = (current_logprobs - old_logprobs).exp()
    clamped = ratios.clamp(1 - clamp_eps_lower, 1 + clamp_eps_upper)
    advantages = advantages.view(-1, 1)
    kl_term = torch.zeros_like(current_logprobs)
    if ref_logprobs is not None:
        diff = ref_logprobs - current_logprobs
        kl_term = diff.exp() - diff - 1
    is_weights = 1.0
    if inference_logprobs is not None:  # the engine sampled from its own distribution: correct for it
        is_weights = (old_logprobs - inference_logprobs).exp()
        if is_truncation_coef is not None:
            is_weights = is_weights.clamp(max=is_truncation_coef)
    loss = -is_weights * torch.min(ratios * advantages, clamped * advantages) + kl_beta * kl_term
    return loss, kl_term, ratios


def reduce_loss(per_token: torch.Tensor, loss_mask: torch.Tensor, normalization: str = "token") -> torch.Tensor:
    """per_token [b, s] and loss_mask [b, s] (1 on response tokens) -> the scalar loss.
    "token" (Megatron's): Σ masked / Σ mask. "sequence": each row's masked mean, then the mean over rows (a row
    with no response token has mean 0 and still counts as a row)."""
    if normalization not in ("token", "sequence"):
        raise ValueError(f"normalization must be 'token' (Megatron's) or 'sequence', got {normalization!r}")
    # EXERCISE rl.reduce_loss: "token": masked sum over the batch / number of response tokens; "sequence": mean over rows of each row's masked mean
    ### BEGIN SOLUTION
    # HINT 1: Only response tokens count (mask 1); prompt and padding positions (mask 0) add nothing to the sum
    #         and nothing to the count. Megatron normalises PER TOKEN over the whole batch: every response token
    #         has the same weight, so a long response weighs in proportion to its length. "sequence" (the GRPO
    #         paper's) gives every response the same weight instead: its own mean, then the mean of those.
    # HINT 2: Cast the mask to the loss's dtype and multiply. "token": the batch's masked sum divided by the
    #         mask's total (clamped to at least 1: a batch with no response token gives 0, not NaN). "sequence":
    #         each row's masked sum over that row's count (each clamped to at least 1), then the mean over rows.
    mask = loss_mask.to(per_token.dtype)
    if normalization == "token":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    ### END SOLUTION


def compute_logprobs(model, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """tokens [b, s] -> logprobs [b, s - 1]: log p(tokens[:, t + 1] | tokens[:, :t + 1]) under the model, in fp32,
    from the raw logits (temperature 1) as Megatron's engine returns them (F.log_softmax of the logits).
    A `temperature` other than 1 divides the logits first: the planted one-side-temperature bug."""
    logits = model(tokens[:, :-1]).float()  # [b, s - 1, V]
    if temperature != 1.0:
        logits = logits / temperature
    return F.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
