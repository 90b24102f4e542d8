"""A verifiable task the course can grade without downloads: single-digit addition, one token to answer.

    prompt   "3+4="   as tokens [3, 10, 4, 11]          (a + b <= 9: the answer is one digit)
    answer   "7"      the first generated token; reward 1.0 if it is the sum, else 0.0

A character vocabulary of VOCAB_SIZE tokens (digits 0-9 are their own ids, then "+", "=", end of text;
the rest unused, so the size divides by 2 and 4 for tensor parallelism). Megatron's example environments
(examples/rl/environments/: countdown, math) grade model text the same way: a prompt, a reward function,
no learned judge. Megatron: RewardOnlyAgent (megatron/rl/agent/reward_only_agent.py: get_prompt,
get_reward).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PLUS, EQUALS, EOD = 10, 11, 12
VOCAB_SIZE = 16
PROMPT_LENGTH = 4


@dataclass
class Prompt:
    tokens: list[int]  # [a, PLUS, b, EQUALS]
    answer: int

    def text(self) -> str:
        return f"{self.tokens[0]}+{self.tokens[2]}="


class ArithmeticAgent:
    """Prompts and rewards for a + b (a + b <= max_sum <= 9)."""

    def __init__(self, max_sum: int = 9, reward_fn=None):
        if not 0 <= max_sum <= 9:
            raise ValueError(f"max_sum must be in [0, 9] (the answer is one token), got {max_sum}")
        self.max_sum = max_sum
        self.reward_fn = reward_fn or exact_match

    def get_prompt(self, rng: random.Random) -> Prompt:
        a = rng.randint(0, self.max_sum)
        b = rng.randint(0, self.max_sum - a)
        return Prompt([a, PLUS, b, EQUALS], a + b)

    def get_reward(self, prompt: Prompt, response: list[int]) -> float:
        """The reward of one response; a reward function that raises or returns a non-number stops the loop with
        the prompt and response named (a silent 0 would train on a wrong signal)."""
        try:
            reward = self.reward_fn(prompt, response)
        except Exception as exc:
            raise RuntimeError(f"the reward function raised on prompt {prompt.text()!r}, response {response}: "
                               f"{type(exc).__name__}: {exc}") from exc
        if isinstance(reward, bool) or not isinstance(reward, int | float) or reward != reward:
            raise RuntimeError(f"the reward function returned {reward!r} on prompt {prompt.text()!r}: "
                               f"a reward is a finite number")
        return float(reward)


def exact_match(prompt: Prompt, response: list[int]) -> float:
    return 1.0 if response[:1] == [prompt.answer] else 0.0
