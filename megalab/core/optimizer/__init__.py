"""Optimizers: param groups, clipping, mixed precision, the distributed optimizer (megatron/core/optimizer/)."""
