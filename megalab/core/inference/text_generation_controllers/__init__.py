"""One forward step over a ragged batch of requests (megatron/core/inference/text_generation_controllers/)."""
