"""A verifiable task the course can grade without downloads: addition of two digits, answered in 1 or 2 tokens.

    prompt    "7+5="   as tokens [7, 10, 5, 11]
    response  "12;"    the sum's digits, then END_OF_ANSWER (";"): [1, 2, 12]; the engine stops at ";" or
                       after MAX_RESPONSE_LENGTH tokens, so responses are ragged: 1 to 3 tokens
    reward    1.0 for exactly the target [digits..., END_OF_ANSWER]; otherwise the fraction of the target's
              positions the response gets right (a shaped reward: a policy trained from scratch first
              learns the format, then the digits)

A character vocabulary of VOCAB_SIZE tokens (digits 0-9 are their own ids, then "+", "=", ";"; the rest
unused, so the size divides by 2 and 4 for tensor parallelism). Megatron's example environments
(examples/rl/environments/: countdown, math) grade model text the same way: a prompt, a reward function,
no learned judge. Megatron: RewardOnlyAgent (megatron/rl/agent/reward_only_agent.py: get_prompt,
get_reward).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PLUS, EQUALS, END_OF_ANSWER = 10, 11, 12
EOD = END_OF_ANSWER  # the engine's termination_id
VOCAB_SIZE = 16
PROMPT_LENGTH = 4
MAX_RESPONSE_LENGTH = 3  # two digits and the end-of-answer token


@dataclass
class Prompt:
    tokens: list[int]  # [a, PLUS, b, EQUALS]
    answer: int

    def text(self) -> str:
        return f"{self.tokens[0]}+{self.tokens[2]}="

    def target(self) -> list[int]:
        """The right response: the answer's digits, then END_OF_ANSWER."""
        return [int(d) for d in str(self.answer)] + [END_OF_ANSWER]


class ArithmeticAgent:
    """Prompts and rewards for a + b with digits a, b and a + b <= max_sum <= 18 (1 or 2 answer digits)."""

    name = "arithmetic"

    def __init__(self, max_sum: int = 18, reward_fn=None):
        if not 0 <= max_sum <= 18:
            raise ValueError(f"max_sum must be in [0, 18] (two digits a, b; at most two answer tokens), got {max_sum}")
        self.max_sum = max_sum
        self.reward_fn = reward_fn or shaped_match

    def get_prompt(self, rng: random.Random) -> Prompt:
        a = rng.randint(0, min(9, self.max_sum))
        b = rng.randint(0, min(9, self.max_sum - a))
        return Prompt([a, PLUS, b, EQUALS], a + b)

    def get_reward(self, prompt: Prompt, response: list[int]) -> float:
        """The reward of one response; a reward function that raises or returns a non-number stops the loop with
        the agent, the prompt and the response named (a silent 0 would train on a wrong signal)."""
        try:
            reward = self.reward_fn(prompt, response)
        except Exception as exc:
            raise RuntimeError(f"agent {self.name!r}: the reward function raised on prompt {prompt.text()!r}, "
                               f"response {response}: {type(exc).__name__}: {exc} (fix the reward function; "
                               f"no weight was updated)") from exc
        if isinstance(reward, bool) or not isinstance(reward, int | float) or reward != reward:
            raise RuntimeError(f"agent {self.name!r}: the reward function returned {reward!r} on prompt "
                               f"{prompt.text()!r}: a reward is a finite number")
        return float(reward)


def exact_match(prompt: Prompt, response: list[int]) -> float:
    """1.0 for exactly the target (digits, then END_OF_ANSWER), else 0.0."""
    return 1.0 if response == prompt.target() else 0.0


def shaped_match(prompt: Prompt, response: list[int]) -> float:
    """1.0 for exactly the target; otherwise the fraction of the target's positions the response matches."""
    target = prompt.target()
    return sum(a == b for a, b in zip(response, target)) / len(target)
