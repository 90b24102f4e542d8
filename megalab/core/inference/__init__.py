"""Chapter 06 · inference and serving: KV caches, sampling, a batching engine, an HTTP server.

    kv_cache.py   contiguous and paged (block table + allocator) key/value caches
    forward.py    one step of the model over a ragged batch, attention reading the cache
    sampling.py   SamplingParams (Megatron's names), greedy / temperature / top-k / top-p, seeds
    engine.py     InferenceEngine: static vs continuous batching, a scheduler with a token budget
    server.py     an OpenAI-style /v1/completions over FastAPI + uvicorn, streaming, a load test
"""

from megalab.core.inference.contexts.dynamic_context import PagedKVCache
from megalab.core.inference.contexts.kv_block_allocator import BlockAllocator
from megalab.core.inference.contexts.static_context import ContiguousKVCache
from megalab.core.inference.engines.dynamic_engine import InferenceEngine, generate_by_recompute
from megalab.core.inference.inference_request import InferenceRequest
from megalab.core.inference.sampling_params import SamplingParams, filter_logits, sample
from megalab.core.inference.text_generation_controllers.text_generation_controller import Segment, forward_step

__all__ = [
    "BlockAllocator", "ContiguousKVCache", "InferenceEngine", "InferenceRequest", "PagedKVCache", "SamplingParams",
    "Segment", "filter_logits", "forward_step", "generate_by_recompute", "sample",
]
