"""Choosing the next token from the logits: greedy, temperature, top-k, top-p (nucleus), seeds.

    logits [V] ─ / temperature ─ keep the top_k largest ─ keep the smallest set with prob >= top_p
               ─ softmax ─ draw one token with the request's own generator (seeded: reproducible)

Greedy is top_k = 1 (Megatron's convention) or temperature = 0 (the OpenAI API's). Field names
follow Megatron's SamplingParams (megatron/core/inference/sampling_params.py): top_k = 0 and
top_p = 0.0 mean "off". `seed` is ours (Megatron seeds one generator per text-generation controller);
Megatron's `termination_id` also defaults to None, which it reads as the tokenizer's end-of-document id.
With top_k and top_p both set we apply top-k, then top-p; Megatron's default (torch) sampling refuses the
pair ("Cannot have top-p and top-k both greater than zero"), only its FlashInfer backend combines them.
Megatron's sampling: TextGenerationController.sample_from_logits
(megatron/core/inference/text_generation_controllers/text_generation_controller.py), which calls
TorchSampling (megatron/core/inference/sampling/torch_sampling.py) or FlashInferSampling.
"""

from __future__ import annotations

import math
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
        if not (_is_number(self.temperature) and 0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 means off, 1 greedy), got {self.top_k!r}")
        if not (_is_number(self.top_p) and 0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be in [0, 1] (0 means off), got {self.top_p!r}")
        if not (_is_int(self.num_tokens_to_generate) and self.num_tokens_to_generate >= 1):
            raise ValueError(f"num_tokens_to_generate must be a positive integer, got {self.num_tokens_to_generate!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1 or self.temperature == 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (isinstance(x, int | float) and not isinstance(x, bool)) and not math.isnan(x)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """Set to -inf every logit below the top_k-th largest and outside the top-p nucleus: [V] -> [V].

    Top-k compares with the value of the k-th largest logit, so a logit tied with it stays too (more
    than k tokens may stay), as Megatron's `TorchSampling._modify_logits_for_top_k_filtering` does
    (`logits < topk(logits, k).values[-1]` is dropped). The nucleus is the smallest set of most likely
    tokens whose probabilities sum to >= top_p (the token that crosses top_p stays, and so does the most
    likely one), taken over what top-k kept. top_k = 0 / top_p = 0.0 switch a filter off.
    """
    # EXERCISE inference.filter_logits: top-k (drop logits below the k-th largest value: ties stay), then top-p over the sorted softmax; -inf outside
    ### BEGIN SOLUTION
    # HINT 1: Top-k keeps the k largest logits (ties with the k-th too); top-p then keeps the smallest
    #         set of most likely tokens whose probabilities reach top_p, so the token that crosses top_p stays.
    # HINT 2: Top-k: the k-th largest value from torch.topk is the threshold; set what is below it
    #         to -inf. top-p: sort descending, softmax, cumsum; a token is dropped when the mass BEFORE it already
    #         reached top_p; the first token always stays; map back through the sort order.
    # HINT 3: Clone the logits first (the caller's tensor must not change), and do top-p on the
    #         logits top-k has already filtered.
    logits = logits.clone()
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
        logits[logits < kth] = float("-inf")
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # mass before this token already reached top_p
        drop[0] = False  # the most likely token always stays (also when top_p rounds to 0 in float32)
        logits[order[drop]] = float("-inf")
    return logits
    ### END SOLUTION


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from the logits [V] of one request (drawn on the CPU, where its generator lives).

    The logits are shifted so their maximum is 0 before dividing by the temperature: however small
    the temperature, the top token keeps probability > 0 and nothing overflows into NaN (down to the smallest float64).
    """
    logits = logits.float().cpu()
    if logits.isnan().any() or logits.isposinf().any():
        raise ValueError("the model produced NaN or +inf logits for this request; it cannot be sampled")
    if params.greedy:
        return int(logits.argmax())
    logits = ((logits.double() - logits.max()) / params.temperature).float()  # <= 0, the top at 0 (float64: any T > 0)
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
