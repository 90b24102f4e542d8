"""Mixture of experts: router, token dispatchers, experts, the MoE layer (megatron/core/transformer/moe/)."""
