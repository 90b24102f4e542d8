"""Tokenizers of Megatron-Core (megatron/core/tokenizers/): a byte-level one for the serving examples."""
