"""Pieces shared by the models (megatron/core/models/common/)."""
