"""Models built from the transformer pieces (megatron/core/models/)."""
