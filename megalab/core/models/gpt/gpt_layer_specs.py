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
from megalab.core.tensor_parallel.mappings import _group
from megalab.core.transformer.dot_product_attention import CoreAttention
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.transformer_engine.context_parallel import ContextParallelAttention
from megalab.transformer_engine.context_parallel import _group as _cp_group


def get_gpt_layer_local_spec() -> LayerSpec:
    """Plain single-device modules: Linear for both linear roles, CoreAttention. Megatron:
    gpt_layer_specs.get_gpt_layer_local_spec (its "local" = not Transformer Engine)."""
    return LayerSpec()


# ------------------------------------------------------------------ the parallel specs
def tensor_parallel_layer_spec(tp_group=None, core_attention: Callable = CoreAttention) -> LayerSpec:
    """Chapter 02's layer with the parallel linears: linear_qkv and linear_fc1 column-parallel
    (each rank gets whole query groups and a slice of ffn), linear_proj and linear_fc2 row-parallel;
    a GPTModel built from it also splits the vocabulary. `tp_group`: the current ParallelState's
    tensor-parallel group unless given. Megatron: get_gpt_layer_local_spec (gpt_layer_specs.py)."""
    tp_group = _group(tp_group)
    return LayerSpec(column_linear=partial(ColumnParallelLinear, tp_group=tp_group),
                     row_linear=partial(RowParallelLinear, input_is_parallel=True, tp_group=tp_group),
                     core_attention=core_attention, tp_group=tp_group)


def context_parallel_layer_spec(tp_group=None, cp_group=None, zigzag: bool = True, variant: str = "p2p") -> LayerSpec:
    """The tensor-parallel spec (tp may be 1) with context-parallel core attention: a GPTModel built
    from it takes this rank's tokens (get_batch_on_this_cp_rank) and returns their logits or loss
    [b, s/cp]. `variant` (Megatron's cp_comm_type): "p2p" (ring), "all_gather", "all_gather_te", "a2a" or
    "a2a+p2p" (initialize_model_parallel's hierarchical_context_parallel_sizes). Groups: the current
    ParallelState's unless given. Megatron: the TE spec's TEDotProductAttention with cp_group."""
    cp_group = _cp_group(cp_group)
    spec = tensor_parallel_layer_spec(tp_group, partial(ContextParallelAttention, cp_group=cp_group, zigzag=zigzag,
                                                        variant=variant))
    spec.cp_group, spec.cp_zigzag = cp_group, zigzag
    return spec
