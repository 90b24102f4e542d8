"""Tokenizer libraries (megatron/core/tokenizers/text/libraries/)."""
