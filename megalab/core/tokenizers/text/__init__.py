"""Text tokenizers (megatron/core/tokenizers/text/)."""
