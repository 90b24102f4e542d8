"""model_provider and the layer spec, as Megatron's pretrain_gpt.py builds a model.

    pretrain_gpt.py:  config = core_transformer_config_from_args(args)
                      spec   = get_gpt_layer_local_spec(...)    (or the Transformer Engine spec)
                      model  = GPTModel(config, spec, vocab_size, max_sequence_length, ...)

The spec says which class plays each role; the config says every size and switch. GPT, LLaMA and
(with num_moe_experts) MoE models are the same GPTModel built from different configs; chapter 03
swaps the spec for tensor_parallel_layer_spec to get the parallel linears.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from megalab.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalab.core.transformer.dot_product_attention import CoreAttention
from megalab.core.transformer.spec_utils import LayerSpec


def get_gpt_layer_local_spec() -> LayerSpec:
    """Plain single-device modules: Linear for both linear roles, CoreAttention. Megatron:
    gpt_layer_specs.get_gpt_layer_local_spec (its "local" = not Transformer Engine)."""
    return LayerSpec()


# ------------------------------------------------------------------ a tensor-parallel GPT
def tensor_parallel_layer_spec(tp_group=None, core_attention: Callable = CoreAttention) -> LayerSpec:
    """Chapter 02's layer with the parallel linears: linear_qkv and linear_fc1 column-parallel
    (each rank gets whole query groups and a slice of ffn), linear_proj and linear_fc2 row-parallel.
    Megatron: get_gpt_layer_local_spec (megatron/core/models/gpt/gpt_layer_specs.py)."""
    return LayerSpec(column_linear=partial(ColumnParallelLinear, tp_group=tp_group),
                     row_linear=partial(RowParallelLinear, input_is_parallel=True, tp_group=tp_group),
                     core_attention=core_attention)
