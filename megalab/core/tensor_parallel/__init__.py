"""Tensor and sequence parallelism (megatron/core/tensor_parallel/)."""
