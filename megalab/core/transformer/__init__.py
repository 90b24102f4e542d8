"""The transformer: config, specs, attention, MLP, layers, blocks, MoE (megatron/core/transformer/)."""
