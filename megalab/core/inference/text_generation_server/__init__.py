"""An OpenAI-style HTTP server for the engine (megatron/core/inference/text_generation_server/)."""
