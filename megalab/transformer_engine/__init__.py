"""Transformer Engine pieces Megatron reaches through extensions/transformer_engine.py: CP attention, FP8."""
