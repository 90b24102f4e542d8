"""Environments that hand out prompts and grade responses. Megatron: megatron/rl/agent/ (RewardOnlyAgent)."""
