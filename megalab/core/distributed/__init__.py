"""Data parallelism: DDP with gradient buckets and finalize_model_grads (megatron/core/distributed/)."""
