"""model_provider: the model of a run from its config, as Megatron-LM's pretrain_gpt.py builds it.
"""

from __future__ import annotations

from megalab.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.transformer_config import TransformerConfig


def model_provider(config: TransformerConfig, spec: LayerSpec | None = None) -> GPTModel:
    """Build the model for `config` (Megatron: model_provider in pretrain_gpt.py)."""
    return GPTModel(config, spec or get_gpt_layer_local_spec())
