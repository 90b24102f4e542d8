"""The inference engine: static and continuous batching (megatron/core/inference/engines/)."""
