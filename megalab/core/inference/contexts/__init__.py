"""Key/value caches for inference (megatron/core/inference/contexts/)."""
