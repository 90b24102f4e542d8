"""model_provider and the layer spec, as Megatron's pretrain_gpt.py builds a model.

    pretrain_gpt.py:  config = core_transformer_config_from_args(args)
                      spec   = get_gpt_layer_local_spec(...)    (or the Transformer Engine spec)
                      model  = GPTModel(config, spec, vocab_size, max_sequence_length, ...)

The spec says which class plays each role; the config says every size and switch. GPT, LLaMA and
(with num_moe_experts) MoE models are the same GPTModel built from different configs; chapter 03
swaps the spec for tensor_parallel_layer_spec to get the parallel linears.
"""

from __future__ import annotations

from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.transformer_config import TransformerConfig


def get_gpt_layer_local_spec() -> LayerSpec:
    """Plain single-device modules: Linear for both linear roles, CoreAttention. Megatron:
    gpt_layer_specs.get_gpt_layer_local_spec (its "local" = not Transformer Engine)."""
    return LayerSpec()


def model_provider(config: TransformerConfig, spec: LayerSpec | None = None) -> GPTModel:
    """Build the model for `config` (Megatron: model_provider in pretrain_gpt.py)."""
    return GPTModel(config, spec or get_gpt_layer_local_spec())
