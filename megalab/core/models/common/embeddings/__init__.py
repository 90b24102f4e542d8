"""Word, position and rotary embeddings (megatron/core/models/common/embeddings/)."""
