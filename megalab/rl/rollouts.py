"""What one GRPO step's rollouts are: the loop's settings, the policy's architecture, each rollout's sampling, and
the batch the trainer gets (ragged responses padded, the loss mask, the engine's log-probs, the rewards).

Shared by the loop on one process (megalab/train_rl.py) and on tp·pp ranks (megalab/rl/parallel.py).
Megatron: megatron/rl/rl_utils.py (prepare_trajectories pads the rollouts and extracts their generation masks,
inside prepare_data_for_update).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalab.core.inference import SamplingParams
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.extras.tiny_gpt import TINY_CONFIG
from megalab.rl.agent.arithmetic_agent import END_OF_ANSWER, MAX_RESPONSE_LENGTH, PROMPT_LENGTH, VOCAB_SIZE
from megalab.rl.logprob_check import TOLERANCE


@dataclass
class GRPOConfig:
    num_prompts: int = 16  # per step
    group_size: int = 8  # rollouts per prompt
    num_tokens_to_generate: int = MAX_RESPONSE_LENGTH  # the longest response; most stop earlier, at END_OF_ANSWER
    temperature: float = 1.0
    lr: float = 3e-3
    num_updates: int = 2  # optimizer steps per batch of rollouts: from the 2nd the ratio leaves 1 and the clip acts
    clamp_eps: float = 0.2
    kl_beta: float = 0.0
    normalization: str = "token"  # Megatron's
    tolerance: float = TOLERANCE
    seed: int = 0


def policy_config() -> TransformerConfig:
    """The tiny GPT's architecture over the task's vocabulary (prompt + the longest response fit in 8)."""
    return TransformerConfig(**{**TINY_CONFIG, "vocab_size": VOCAB_SIZE, "seq_length": 8})


@dataclass
class Rollouts:
    tokens: torch.Tensor  # [P * G, prompt + longest response]: each row padded with END_OF_ANSWER past its end
    loss_mask: torch.Tensor  # [P * G, prompt + longest response - 1]: 1 where a response token is predicted
    engine_logprobs: torch.Tensor  # [number of response tokens], in loss_mask order
    rewards: torch.Tensor  # [P, G]
    response_lengths: torch.Tensor | None = None  # [P * G]: 1 .. num_tokens_to_generate


def rollout_sampling_params(config: GRPOConfig, step: int, index: int) -> SamplingParams:
    """Rollout `index` of step `step`: its own seed, so any engine replica that generates it samples the same."""
    return SamplingParams(temperature=config.temperature, num_tokens_to_generate=config.num_tokens_to_generate,
                          return_log_probs=True, termination_id=END_OF_ANSWER,
                          seed=config.seed * 1_000_003 + step * 10_007 + index)


def assemble_rollouts(prompt_tokens: list[list[int]], responses: list[list[int]], log_probs: list[list[float]],
                      rewards: list[list[float]]) -> Rollouts:
    """Rows of prompt + ragged response, padded with END_OF_ANSWER; the loss mask keeps each response's tokens.
    prompt_tokens / responses / log_probs: one list per rollout (P * G, grouped by prompt); rewards [P][G]."""
    lengths = torch.tensor([len(r) for r in responses])  # [P * G]
    width = PROMPT_LENGTH + int(lengths.max())
    tokens = torch.full((len(responses), width), END_OF_ANSWER)
    for row, (prompt, response) in enumerate(zip(prompt_tokens, responses)):
        tokens[row, :PROMPT_LENGTH + len(response)] = torch.tensor(prompt + response)
    # position t predicts token t + 1: row i's response tokens are predicted at PROMPT_LENGTH - 1 .. + length_i - 1
    positions = torch.arange(width - 1)
    loss_mask = ((positions >= PROMPT_LENGTH - 1) & (positions < PROMPT_LENGTH - 1 + lengths[:, None])).float()
    engine_logprobs = torch.tensor([lp for row in log_probs for lp in row])  # row-major = the mask's order
    return Rollouts(tokens, loss_mask, engine_logprobs, torch.tensor(rewards), lengths)
