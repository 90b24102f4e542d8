"""One generation request: prompt, sampling parameters, generated tokens, status and timings.

Megatron: megatron/core/inference/inference_request.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megalab.core.inference.sampling_params import SamplingParams


@dataclass
class InferenceRequest:
    """One prompt and what has been generated for it. Megatron: InferenceRequest (inference_request.py)."""
    request_id: int
    prompt_tokens: list[int]
    sampling_params: SamplingParams
    on_token: Callable | None = None  # called as on_token(request, token_id) after each new token
    generated_tokens: list[int] = field(default_factory=list)
    generated_log_probs: list[float] = field(default_factory=list)
    status: str = "waiting"  # waiting -> active (<-> paused; evicted: back to waiting) -> completed
    finish_reason: str | None = None  # "length", "stop" (termination_id), "cancelled" or "error"
    error: str | None = None  # why it failed, when finish_reason == "error"
    arrival_time: float = field(default_factory=time.perf_counter)
    finish_time: float | None = None
    generator: torch.Generator | None = None
    kv_length: int = 0  # tokens of prompt + generated whose keys/values are in the cache
    precomputed_block_hashes: list[int] = field(default_factory=list)  # prefix caching: one per full prompt block

    @property
    def tokens(self) -> list[int]:
        """The whole sequence so far: what a prefill (or the recompute after an eviction) runs over."""
        return self.prompt_tokens + self.generated_tokens

    @property
    def final_length(self) -> int:
        return len(self.prompt_tokens) + self.sampling_params.num_tokens_to_generate
