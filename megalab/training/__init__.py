"""The training loop and checkpointing (megatron/training/)."""
