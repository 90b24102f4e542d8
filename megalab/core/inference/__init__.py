"""Chapter 06 · inference and serving: KV caches, sampling, a batching engine, an HTTP server.

    contexts/                      key/value caches: contiguous (static_context.py), paged
                                   (dynamic_context.py, with kv_block_allocator.py: ref counts, prefix caching)
    text_generation_controllers/   one step of the model over a ragged batch, attention reading the cache
    sampling_params.py             SamplingParams (Megatron's names), greedy / temperature / top-k / top-p
    inference_request.py           one request and its state
    engines/dynamic_engine.py      InferenceEngine: static vs continuous batching, a token-budget scheduler,
                                   blocks taken as requests grow, pausing/eviction, chunked prefill
    text_generation_server/        an OpenAI-style /v1/completions over FastAPI + uvicorn, a load test
"""

from megalab.core.inference.contexts.dynamic_context import DynamicInferenceContext, PagedKVCache, compute_block_hashes
from megalab.core.inference.contexts.kv_block_allocator import BlockAllocator, KVBlockAllocator
from megalab.core.inference.contexts.static_context import ContiguousKVCache
from megalab.core.inference.engines.dynamic_engine import InferenceEngine, generate_by_recompute
from megalab.core.inference.inference_request import InferenceRequest
from megalab.core.inference.sampling_params import SamplingParams, filter_logits, sample
from megalab.core.inference.text_generation_controllers.text_generation_controller import Segment, forward_step

__all__ = [
    "BlockAllocator", "ContiguousKVCache", "DynamicInferenceContext", "InferenceEngine", "InferenceRequest",
    "KVBlockAllocator", "PagedKVCache", "SamplingParams", "Segment", "compute_block_hashes", "filter_logits",
    "forward_step", "generate_by_recompute", "sample",
]
