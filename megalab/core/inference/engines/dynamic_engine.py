"""The inference engine: requests in, tokens out, one forward step at a time.

    waiting queue ──admit (scheduler)──> active batch ──step: one forward──> each active request
                                              ^                              gets its next token
                                              └────── finished ones leave ────┘

A step runs the prefill of the newly admitted requests (all their prompt tokens) and the
decode of the active ones (one token each) in a single forward (text_generation_controller.py). The scheduler
admits waiting requests in arrival order while the step stays within

    max_batch_size  requests in the batch
    max_tokens      tokens in one forward (a prefill costs its prompt length, a decode 1)
    the KV cache    the final lengths of all admitted requests must fit

Static batching admits a new batch only when the previous one has completely finished, so
short requests leave holes; continuous batching (Orca, vLLM, Megatron's DynamicInferenceEngine
in megatron/core/inference/engines/dynamic_engine.py) lets requests join and leave every step.
Megatron's names: InferenceRequest, add_request, step, has_unfinished_requests, generate.
"""

from __future__ import annotations

import itertools
import time
import traceback
from collections import deque
from collections.abc import Callable

import torch

from megalab.core.inference.inference_request import InferenceRequest
from megalab.core.inference.sampling_params import SamplingParams, make_generator, sample
from megalab.core.inference.text_generation_controllers.text_generation_controller import Segment, forward_step

MODES = ("continuous", "static")


class InferenceEngine:
    def __init__(self, model, cache, max_batch_size: int = 8, max_tokens: int = 256, mode: str = "continuous"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.model, self.cache, self.mode = model.eval(), cache, mode
        device = model.embedding.word_embeddings.weight.device
        if cache.key.device != device:  # the cache lives where the model runs (a CUDA model, a CPU-built cache)
            cache.key, cache.value = cache.key.to(device), cache.value.to(device)
        self.max_batch_size, self.max_tokens = max_batch_size, max_tokens
        self.waiting: deque[InferenceRequest] = deque()
        self.active: list[InferenceRequest] = []
        self.ids = itertools.count()
        self.steps = 0

    def add_request(self, prompt_tokens: list[int], sampling_params: SamplingParams | None = None,
                    on_token: Callable | None = None) -> InferenceRequest:
        params = sampling_params or SamplingParams()
        config = self.model.config
        if not prompt_tokens:
            raise ValueError("the prompt is empty: give at least one token")
        if not all(0 <= t < config.vocab_size for t in prompt_tokens):
            raise ValueError(f"prompt token ids must be in [0, vocab_size={config.vocab_size})")
        total = len(prompt_tokens) + params.num_tokens_to_generate
        if total > config.seq_length:
            raise ValueError(f"prompt ({len(prompt_tokens)} tokens) + num_tokens_to_generate "
                             f"({params.num_tokens_to_generate}) = {total} exceeds the model's seq_length "
                             f"{config.seq_length}: shorten the prompt or generate fewer tokens")
        if len(prompt_tokens) > self.max_tokens:
            raise ValueError(f"prompt of {len(prompt_tokens)} tokens exceeds the engine's max_tokens "
                             f"{self.max_tokens} per step: shorten it or raise max_tokens")
        if not self.cache.fits([total]):
            raise ValueError(f"a request of {total} tokens can never fit in the KV cache: make the cache larger")
        request = InferenceRequest(next(self.ids), list(prompt_tokens), params, on_token)
        request.generator = make_generator(params)
        self.waiting.append(request)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.active)

    def schedule(self) -> list[InferenceRequest]:
        """Admit waiting requests (first come, first served) within the budgets; return the newcomers."""
        if self.mode == "static" and self.active:
            return []  # a static batch runs to its end before anyone joins
        admitted = []
        tokens = len(self.active)  # one decode token per active request
        # EXERCISE inference.schedule: admit in arrival order while batch size, token budget and KV cache allow
        ### BEGIN SOLUTION
        # HINT 1: First come, first served: walk the waiting queue from the front and stop at the first
        #         request that does not fit, so no later request overtakes it.
        # HINT 2: While requests wait and the batch (active + admitted) is below max_batch_size: look at
        #         the front request; stop if `tokens` plus its prompt length exceeds max_tokens, or if the cache
        #         cannot fit the final lengths of active + admitted + it (cache.fits); else pop it, add its prompt
        #         length to `tokens`.
        # HINT 3: `tokens` already counts one decode token per active request, and a request that does
        #         not fit ends the admission (break), it is not skipped.
        while self.waiting and len(self.active) + len(admitted) < self.max_batch_size:
            request = self.waiting[0]
            if tokens + len(request.prompt_tokens) > self.max_tokens:
                break
            if not self.cache.fits([r.final_length for r in (*self.active, *admitted, request)]):
                break
            admitted.append(self.waiting.popleft())
            tokens += len(request.prompt_tokens)
        ### END SOLUTION
        return admitted

    @torch.inference_mode()
    def step(self) -> list[InferenceRequest]:
        """One forward: prefill the newcomers, decode one token for the others. Returns those that finished.

        A request that fails (its forward, its sampling, its callback) is failed alone: when the batched
        forward raises, each request runs alone (its K/V slots are simply rewritten) and only those
        that still fail are ended with finish_reason "error"; the others go on with the same tokens.
        """
        admitted = self.schedule()
        for request in admitted:
            request.status = "active"
        batch = [(r, Segment(r.request_id, len(r.prompt_tokens) + len(r.generated_tokens) - 1, 1))
                 for r in self.active]  # decode: the newest token, at the end of the sequence
        batch += [(r, Segment(r.request_id, 0, len(r.prompt_tokens))) for r in admitted]  # prefill: the prompt
        self.active.extend(admitted)
        if not batch:
            return []
        try:
            rows = self._forward(batch)
        except Exception as exc:
            if len(batch) == 1:
                self._fail(batch[0][0], exc)
                rows = [None]
            else:
                rows = [self._forward_alone(item) for item in batch]
        finished = []
        for (request, _), row in zip(batch, rows):
            if row is None:  # failed alone above
                continue
            try:
                self._append(request, row)
            except Exception as exc:
                self._fail(request, exc)
                continue
            if request.finish_reason is not None:
                finished.append(request)
        for request in finished:
            self.active.remove(request)
            self.cache.free(request.request_id)
        self.steps += 1
        return finished

    def _forward(self, batch: list[tuple[InferenceRequest, Segment]]) -> torch.Tensor:
        """Logits [len(batch), V]: one forward over every segment's tokens, each request's last row."""
        ids, positions, segments = [], [], [seg for _, seg in batch]
        for request, seg in batch:
            ids.extend(request.generated_tokens[-1:] if request.generated_tokens else request.prompt_tokens)
            positions.extend(range(seg.start, seg.start + seg.length))
            self.cache.reserve(seg.seq_id, seg.start + seg.length)
        device = self.model.embedding.word_embeddings.weight.device
        logits = forward_step(self.model, torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                              segments, self.cache)  # [T, V]
        last_rows = torch.tensor([s.length for s in segments], device=device).cumsum(0) - 1
        return logits[last_rows]

    def _forward_alone(self, item: tuple[InferenceRequest, Segment]) -> torch.Tensor | None:
        try:
            return self._forward([item])[0]
        except Exception as exc:
            self._fail(item[0], exc)
            return None

    def _fail(self, request: InferenceRequest, exc: BaseException) -> None:
        """End one request with finish_reason "error" (the reason kept in request.error); the rest go on."""
        traceback.print_exception(exc)
        request.error = f"{type(exc).__name__}: {exc}"
        self.cancel(request, "error")

    def cancel(self, request: InferenceRequest, reason: str = "cancelled") -> None:
        """End one request now (a client went away, a stop string matched, a failure) and free its cache."""
        if request in self.active:
            self.active.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request.status == "completed":
            return  # already over
        self.cache.free(request.request_id)
        request.status, request.finish_reason, request.finish_time = "completed", reason, time.perf_counter()
        if request.on_token is not None:
            try:
                request.on_token(request, None)
            except Exception:  # its listener is gone too: nothing more to tell
                pass

    def abort_all(self, reason: str = "error") -> None:
        """End every request in flight or waiting (e.g. after a failed step) and free their cache."""
        for request in [*self.active, *self.waiting]:
            self.cancel(request, reason)

    def _append(self, request: InferenceRequest, logits: torch.Tensor) -> None:
        params = request.sampling_params
        token = sample(logits, params, request.generator)
        request.generated_tokens.append(token)
        if params.return_log_probs:
            request.generated_log_probs.append(float(logits.float().log_softmax(-1)[token]))
        if token == params.termination_id:
            request.finish_reason = "stop"
        elif len(request.generated_tokens) == params.num_tokens_to_generate:
            request.finish_reason = "length"
        if request.finish_reason is not None:
            request.status, request.finish_time = "completed", time.perf_counter()
        if request.on_token is not None:
            request.on_token(request, token)

    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[InferenceRequest]:
        """Run the given prompts to completion; the requests come back in prompt order."""
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while self.has_unfinished_requests():
            self.step()
        return requests


@torch.inference_mode()
def generate_by_recompute(model, prompt_tokens: list[int], sampling_params: SamplingParams) -> list[int]:
    """The reference without a cache: every new token runs the full forward over the whole sequence."""
    model.eval()
    device = model.embedding.word_embeddings.weight.device
    generator, tokens = make_generator(sampling_params), list(prompt_tokens)
    for _ in range(sampling_params.num_tokens_to_generate):
        logits = model(torch.tensor([tokens], device=device))[0, -1]  # [V]: a forward over all len(tokens) positions
        tokens.append(sample(logits, sampling_params, generator))
        if tokens[-1] == sampling_params.termination_id:
            break
    return tokens[len(prompt_tokens):]
