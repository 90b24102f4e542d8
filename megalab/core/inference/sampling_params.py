"""Choosing the next token from the logits: greedy, temperature, top-k, top-p (nucleus), seeds.

    logits [V] ─ / temperature ─ keep the top_k largest ─ keep the smallest set with prob >= top_p
               ─ softmax ─ draw one token with the request's own generator (seeded: reproducible)

Greedy is top_k = 1 (Megatron's convention) or temperature = 0 (the OpenAI API's). Field names
follow Megatron's SamplingParams (megatron/core/inference/sampling_params.py): top_k = 0 and
top_p = 0.0 mean "off". `seed` and `termination_id` are ours (Megatron seeds globally and takes
the termination id from the tokenizer). Megatron's sampling: TextGenerationController.sample_from_logits
(megatron/core/inference/text_generation_controllers/text_generation_controller.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    return_log_probs: bool = False
    num_tokens_to_generate: int = 30
    seed: int | None = None
    termination_id: int | None = None  # stop after generating this token

    def __post_init__(self):
        if not (isinstance(self.temperature, int | float) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 means off, 1 greedy), got {self.top_k!r}")
        if not (isinstance(self.top_p, int | float) and 0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be in [0, 1] (0 means off), got {self.top_p!r}")
        if not (isinstance(self.num_tokens_to_generate, int) and self.num_tokens_to_generate >= 1):
            raise ValueError(f"num_tokens_to_generate must be a positive integer, got {self.num_tokens_to_generate!r}")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1 or self.temperature == 0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """Set to -inf every logit outside the top_k largest and outside the top-p nucleus: [V] -> [V].

    The nucleus is the smallest set of most likely tokens whose probabilities sum to >= top_p
    (the most likely token always stays). top_k = 0 / top_p = 0.0 switch a filter off.
    """
    # EXERCISE inference.filter_logits: top-k, then top-p over the sorted softmax; -inf outside
    ### BEGIN SOLUTION
    logits = logits.clone()
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
        logits[logits < kth] = float("-inf")
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # mass before this token already reached top_p
        logits[order[drop]] = float("-inf")
    return logits
    ### END SOLUTION


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from the logits [V] of one request (drawn on the CPU, where its generator lives)."""
    logits = logits.float().cpu()
    if params.greedy:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k or params.top_p:
        logits = filter_logits(logits, params.top_k, params.top_p)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(params: SamplingParams) -> torch.Generator:
    """The request's own random stream: seeded, so the same request samples the same tokens in any batch."""
    generator = torch.Generator()
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator
