"""GPTModel and its layer specs (megatron/core/models/gpt/)."""
