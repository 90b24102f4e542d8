"""Command-line tools (Megatron-LM: tools/)."""
