"""Megatron-Core in small: each file here sits at the path of its counterpart under megatron/core/."""
