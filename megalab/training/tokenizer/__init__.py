"""Tokenizers (Megatron: megatron/core/tokenizers/): the course's byte-level BPE, trained with Hugging Face `tokenizers`."""
