"""Tokenizers: the course BPE and a byte-level one (megatron/core/tokenizers/)."""
