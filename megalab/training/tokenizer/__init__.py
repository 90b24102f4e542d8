"""Tokenizers (megatron/training/tokenizer/): the course's byte-level BPE, trained with Hugging Face `tokenizers`."""
