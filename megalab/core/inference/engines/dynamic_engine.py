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

Two admission rules (`admission`):

    "final_length"  admit a request only if its FINAL length (prompt + num_tokens_to_generate) fits the
                    cache beside the others' (schedule()): no request ever runs out of blocks, but a cache
                    sized for the worst case sits mostly empty.
    "growing"       Megatron's dynamic engine (schedule_waiting_requests()): a request gets the blocks of
                    its prompt; each step a running request that filled its last block takes ONE more.
                    When none is left it is PAUSED (it keeps its blocks, skips steps); paused requests
                    resume from the most recently paused (Megatron resumes from the right of its paused
                    list, LIFO) as blocks free up, and no new request is admitted while any is paused.
                    Paused requests keep at most `paused_limit` blocks: the others are EVICTED (blocks
                    released, the request back at the head of the queue, its prompt + tokens so far
                    recomputed when it returns: Megatron's evict_overflow_paused_requests).

With "growing" also (off by default, as in Megatron's InferenceConfig):
    enable_chunked_prefill   a prompt longer than what is left of max_tokens is prefilled in chunks over
                             several steps (one such request at a time, its chunk after the decodes)
    prefix caching           (on the cache: PagedKVCache(enable_prefix_caching=True)) a new request takes
                             the cached blocks of its longest known prompt prefix and computes only the rest

A request's generated tokens do not depend on any of this (greedy or seeded): only when and where they
are computed changes.
"""

from __future__ import annotations

import itertools
import time
import traceback
from collections import deque
from collections.abc import Callable

import torch

from megalab.core.inference.contexts.dynamic_context import compute_block_hashes
from megalab.core.inference.inference_request import InferenceRequest
from megalab.core.inference.sampling_params import SamplingParams, make_generator, sample
from megalab.core.inference.text_generation_controllers.text_generation_controller import Segment, forward_step

MODES = ("continuous", "static")
ADMISSIONS = ("growing", "final_length")


class InferenceEngine:
    """Megatron: DynamicInferenceEngine (core/inference/engines/dynamic_engine.py).

    State a caller may read: waiting (queue), active (running), paused (out of blocks, newest last),
    chunked_prefill_request, and the counters pause_count, resume_count, evicted_request_count,
    prefix_cache_hit_tokens, chunked_prefill_chunks, peak_blocks_used.
    """

    def __init__(self, model, cache, max_batch_size: int = 8, max_tokens: int = 256, mode: str = "continuous",
                 admission: str | None = None, enable_chunked_prefill: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        paged = hasattr(cache, "allocator")
        admission = admission or ("growing" if paged else "final_length")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        if admission == "growing" and not paged:
            raise ValueError("admission='growing' takes blocks one at a time: it needs a PagedKVCache")
        if admission != "growing" and (enable_chunked_prefill or (paged and cache.allocator.enable_prefix_caching)):
            raise ValueError("chunked prefill and prefix caching need admission='growing'")
        self.model, self.cache, self.mode, self.admission = model.eval(), cache, mode, admission
        self.enable_chunked_prefill = enable_chunked_prefill
        device = model.embedding.word_embeddings.weight.device
        if cache.key.device != device:  # the cache lives where the model runs (a CUDA model, a CPU-built cache)
            cache.key, cache.value = cache.key.to(device), cache.value.to(device)
        self.max_batch_size, self.max_tokens = max_batch_size, max_tokens
        self.waiting: deque[InferenceRequest] = deque()
        self.active: list[InferenceRequest] = []
        self.paused: list[InferenceRequest] = []  # out of blocks; the right end (newest) resumes first
        self.chunked_prefill_request: InferenceRequest | None = None  # active, its prompt not all prefilled
        self.ids = itertools.count()
        self.steps = 0
        self.pause_count = self.resume_count = self.evicted_request_count = 0
        self.prefix_cache_hit_tokens = self.chunked_prefill_chunks = self.peak_blocks_used = 0
        self.weights_version = 0

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
        if len(prompt_tokens) > self.max_tokens and not self.enable_chunked_prefill:
            raise ValueError(f"prompt of {len(prompt_tokens)} tokens exceeds the engine's max_tokens "
                             f"{self.max_tokens} per step: shorten it, raise max_tokens or enable_chunked_prefill")
        if not self.cache.fits([total]):
            raise ValueError(f"a request of {total} tokens can never fit in the KV cache (out of KV memory even "
                             f"alone: {self._capacity()}): make the cache larger or generate fewer tokens")
        request = InferenceRequest(next(self.ids), list(prompt_tokens), params, on_token)
        request.generator = make_generator(params)
        if self.admission == "growing" and self.cache.allocator.enable_prefix_caching:
            request.precomputed_block_hashes = compute_block_hashes(request.prompt_tokens, self.cache.block_size)
        self.waiting.append(request)
        return request

    def _capacity(self) -> str:
        if hasattr(self.cache, "allocator"):
            return f"{self.cache.allocator.num_blocks} blocks of {self.cache.block_size} tokens"
        return f"{self.cache.max_seq_len} positions per slot"

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.active or self.paused)

    def schedule(self) -> list[InferenceRequest]:
        """Admit waiting requests (first come, first served) within the budgets; return the newcomers.

        The rule of admission="final_length": the final lengths of all admitted requests must fit the cache.
        """
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

    # ------------------------------------------------------------------ growing, pausing, chunks, prefixes
    def schedule_waiting_requests(self) -> list[tuple[InferenceRequest, int]]:
        """The growing engine's plan for one step: (request, number of its tokens to run) pairs.

        1. running requests that need a new block get one or are paused; paused ones resume (the newest first)
           or, beyond paused_limit, are evicted (_grow_and_pause);
        2. every running request decodes one token; a chunked prefill goes on with what max_tokens leaves;
        3. waiting requests are admitted in arrival order (none while any request is paused), each with the
           blocks of its prompt (minus a cached prefix); the first one too long for the budget is chunked
           (enable_chunked_prefill) or waits.
        """
        self._grow_and_pause()
        batch = [(r, 1) for r in self.active if r is not self.chunked_prefill_request]
        tokens = len(batch)
        chunked = self.chunked_prefill_request
        if chunked is not None:
            n = self._chunk_that_fits(chunked, len(chunked.tokens) - chunked.kv_length, self.max_tokens - tokens)
            if n:
                batch.append((chunked, n))
                tokens += n
                self.chunked_prefill_chunks += 1
            if chunked.kv_length + n < len(chunked.tokens):
                return batch  # one chunked prefill at a time: the queue waits for it
        if self.mode == "static" and (self.active or self.paused):
            return batch  # a static batch runs to its end before anyone joins
        pending: set[int] = set()  # hashes that requests admitted in this step will compute (not cached yet)
        while self.waiting and not self.paused and len(self.active) < self.max_batch_size:
            request = self.waiting[0]
            if pending.intersection(request.precomputed_block_hashes):
                break  # its prefix is being computed in this step: next step it is a cache hit
            matched = self._match_prefix(request)
            start = len(matched) * self.cache.block_size
            rest, budget = len(request.tokens) - start, self.max_tokens - tokens
            n = rest if rest <= budget else max(budget, 0) if self.enable_chunked_prefill else 0
            blocks = -(-(start + n) // self.cache.block_size) - len(matched)
            pinned = sum(1 for b in matched if self.cache.allocator.block_ref_counts[b] == 0)
            if n == 0 or not self.cache.allocator.is_memory_available(blocks + pinned):
                break
            self.waiting.popleft()
            self.cache.share(request.request_id, matched)
            assert self.cache.try_reserve(request.request_id, start + n)
            request.kv_length, request.status = start, "active"
            self.prefix_cache_hit_tokens += start
            self.active.append(request)
            batch.append((request, n))
            tokens += n
            pending.update(h for h in request.precomputed_block_hashes
                           if h not in self.cache.allocator.kv_hash_to_block_id)
            if n < rest:
                self.chunked_prefill_request = request
                self.chunked_prefill_chunks += 1
                break
        return batch

    def _match_prefix(self, request: InferenceRequest) -> list[int]:
        """Cached blocks of the request's prompt prefix; at least one token is left to run (its logits)."""
        if not request.precomputed_block_hashes:
            return []
        matched = self.cache.allocator.match(request.precomputed_block_hashes)
        return matched[:(len(request.tokens) - 1) // self.cache.block_size]

    def _chunk_that_fits(self, request: InferenceRequest, rest: int, budget: int) -> int:
        """The longest next chunk (<= rest, <= budget) whose blocks the pool can give now; they are taken."""
        n = min(rest, budget)
        while n > 0 and not self.cache.try_reserve(request.request_id, request.kv_length + n):
            n -= (request.kv_length + n - 1) % self.cache.block_size + 1  # end at the previous block's end
        return max(n, 0)

    def _grow_and_pause(self) -> None:
        """Each running request whose next token starts a new block takes one; Megatron's update_requests:
        the ones needing a block join the paused list's right end, the right end resumes while blocks last,
        paused requests beyond paused_limit blocks are evicted, and the rest resume if they can."""
        needing = [r for r in self.active if r is not self.chunked_prefill_request
                   and self.cache.blocks_needed(r.request_id, r.kv_length + 1)]
        for request in needing:
            self.active.remove(request)
            request.status = "paused"
        before = {id(r) for r in self.paused}
        self.paused.extend(needing)
        self._resume_paused_requests(before)
        self._evict_overflow_paused_requests()
        self._resume_paused_requests(before)
        self.pause_count += sum(1 for r in self.paused if id(r) not in before)

    def _resume_paused_requests(self, paused_before: set[int]) -> None:
        """Resume from the right (the most recently paused first) while a block and a batch place are free."""
        while self.paused and len(self.active) < min(self.max_batch_size, self.max_tokens):
            request = self.paused[-1]
            if not self.cache.try_reserve(request.request_id, request.kv_length + 1):
                return
            self.paused.pop()
            self.active.append(request)
            request.status = "active"
            self.resume_count += id(request) in paused_before

    def _evict_overflow_paused_requests(self) -> None:
        """Paused requests keep at most paused_limit blocks: the left-most ones within it stay paused; of the
        others, evict the shortest right-hand run whose release lets all the rest resume now."""
        allocator, held, kept = self.cache.allocator, set(), 0
        for request in self.paused:
            held.update(self.cache.block_tables.get(request.request_id, ()))
            if len(held) > allocator.paused_limit:
                break
            kept += 1
        overflow = self.paused[kept:]
        room = min(self.max_batch_size, self.max_tokens) - len(self.active)
        for evict in range(len(overflow) + 1):
            survivors = len(overflow) - evict
            if survivors <= room and survivors <= allocator.get_allocatable_count() + self._releasable(
                    overflow[survivors:]):
                break
        for request in overflow[len(overflow) - evict:]:
            self._evict(request)

    def _releasable(self, requests: list[InferenceRequest]) -> int:
        """Blocks that releasing these requests makes allocatable (a shared block only if they are all its holders)."""
        refs: dict[int, int] = {}
        for request in requests:
            for b in self.cache.block_tables.get(request.request_id, ()):
                refs[b] = refs.get(b, 0) + 1
        return sum(1 for b, n in refs.items() if n == self.cache.allocator.block_ref_counts[b])

    def _evict(self, request: InferenceRequest) -> None:
        """Release a paused request's blocks and queue it first: its prompt + tokens are recomputed later."""
        self.paused.remove(request)
        self.cache.free(request.request_id)
        request.kv_length, request.status = 0, "waiting"
        self.waiting.appendleft(request)
        self.evicted_request_count += 1

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy new weights into the model in place (a refit), refusing any missing, unexpected or mis-shaped
        tensor before changing anything; cached prefix blocks (K/V of the old weights) are forgotten."""
        if self.has_unfinished_requests():
            raise RuntimeError("update_weights with requests in flight: their K/V comes from the old weights; "
                               "finish them (generate) or abort_all() first")
        own = self.model.state_dict()
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise ValueError(f"update_weights: missing {missing[:5]}, unexpected {unexpected[:5]} "
                             f"(the state dict is for another model or layout)")
        wrong = [f"{k}: got {tuple(v.shape)}, the engine's is {tuple(own[k].shape)}"
                 for k, v in state_dict.items() if tuple(v.shape) != tuple(own[k].shape)]
        if wrong:
            raise ValueError("update_weights: shape mismatch (vocab padding? heads? TP slice?): " + "; ".join(wrong[:5]))
        with torch.no_grad():
            for k, v in state_dict.items():
                own[k].copy_(v)
        if hasattr(self.cache, "allocator"):
            allocator = self.cache.allocator
            allocator.evict_lru_blocks(allocator.get_evictable_block_count())  # stale prefixes out
        self.weights_version += 1

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[InferenceRequest]:
        """One forward: prefill the newcomers (or a chunk), decode one token for the others. Returns those that
        finished.

        A request that fails (its forward, its sampling, its callback) is failed alone: when the batched
        forward raises, each request runs alone (its K/V slots are simply rewritten) and only those
        that still fail are ended with finish_reason "error"; the others go on with the same tokens.
        """
        if self.admission == "final_length":
            admitted = self.schedule()
            batch = [(r, 1) for r in self.active] + [(r, len(r.prompt_tokens)) for r in admitted]
            for request in admitted:
                request.status = "active"
            self.active.extend(admitted)
        else:
            batch = self.schedule_waiting_requests()
            while not batch and self.paused:  # nothing can run: the newest paused request makes room
                self._evict(self.paused[-1])
                batch = self.schedule_waiting_requests()
            if not batch and self.has_unfinished_requests():
                raise RuntimeError(f"the engine cannot make progress: {len(self.waiting)} waiting, "
                                   f"{len(self.active)} running, {self.cache.allocator.get_allocatable_count()} of "
                                   f"{self.cache.allocator.num_blocks} KV blocks allocatable")
        if not batch:
            return []
        if hasattr(self.cache, "allocator"):
            self.peak_blocks_used = max(self.peak_blocks_used, self.cache.allocator.get_referenced_count())
        try:
            rows = self._forward(batch)
        except Exception as exc:
            if len(batch) == 1:
                self._fail(batch[0][0], exc)
                rows = [None]
            else:
                rows = [self._forward_alone(item) for item in batch]
        finished = []
        for (request, n), row in zip(batch, rows):
            if row is None:  # failed alone above
                continue
            request.kv_length += n
            self._register_prefix(request)
            if request.kv_length < len(request.tokens):
                continue  # a chunk of a prompt: no token yet
            if request is self.chunked_prefill_request:
                self.chunked_prefill_request = None
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

    def _register_prefix(self, request: InferenceRequest) -> None:
        """Prefix caching: make the request's full prompt blocks computed so far findable by their hash."""
        if not request.precomputed_block_hashes:
            return
        done = min(len(request.precomputed_block_hashes), request.kv_length // self.cache.block_size)
        if done:
            self.cache.allocator.register_kv_block_hashes(self.cache.block_tables[request.request_id][:done],
                                                          request.precomputed_block_hashes[:done])

    def _forward(self, batch: list[tuple[InferenceRequest, int]]) -> torch.Tensor:
        """Logits [len(batch), V]: one forward over every request's next n tokens, each request's last row."""
        ids, positions, segments = [], [], []
        for request, n in batch:
            start = request.kv_length
            ids.extend(request.tokens[start:start + n])
            positions.extend(range(start, start + n))
            segments.append(Segment(request.request_id, start, n))
            self.cache.reserve(request.request_id, start + n)
        device = self.model.embedding.word_embeddings.weight.device
        logits = forward_step(self.model, torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                              segments, self.cache)  # [T, V]
        last_rows = torch.tensor([s.length for s in segments], device=device).cumsum(0) - 1
        return logits[last_rows]

    def _forward_alone(self, item: tuple[InferenceRequest, int]) -> torch.Tensor | None:
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
        elif request in self.paused:
            self.paused.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request.status == "completed":
            return  # already over
        if request is self.chunked_prefill_request:
            self.chunked_prefill_request = None
        self.cache.free(request.request_id)
        request.status, request.finish_reason, request.finish_time = "completed", reason, time.perf_counter()
        if request.on_token is not None:
            try:
                request.on_token(request, None)
            except Exception:  # its listener is gone too: nothing more to tell
                pass

    def abort_all(self, reason: str = "error") -> None:
        """End every request in flight, paused or waiting (e.g. after a failed step) and free their cache."""
        for request in [*self.active, *self.paused, *self.waiting]:
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
