"""A GPT built the way Megatron Core builds it, one module per file.

    config (megalab/config.py) ─> GPTModel (gpt.py)
                                   ├─ LanguageModelEmbedding, RotaryEmbedding   embeddings.py
                                   ├─ TransformerBlock ─ TransformerLayer       transformer.py
                                   │     ├─ LayerNorm / RMSNorm                 norm.py
                                   │     ├─ SelfAttention ─ CoreAttention       attention.py
                                   │     └─ MLP                                 mlp.py
                                   └─ output layer (tied to the word embeddings)
    linear layers come from a LayerSpec (spec.py, layers.py); recomputation is recompute.py.
"""

from megalab.model.attention import CoreAttention, SelfAttention
from megalab.model.embeddings import LanguageModelEmbedding, RotaryEmbedding, apply_rotary_pos_emb
from megalab.model.gpt import GPTModel
from megalab.model.layers import Linear, init_method_normal, scaled_init_method_normal
from megalab.model.mlp import MLP
from megalab.model.norm import LayerNorm, RMSNorm, build_norm
from megalab.model.recompute import CheckpointFunction, SavedTensorsMeter, checkpoint
from megalab.model.spec import LayerSpec
from megalab.model.transformer import TransformerBlock, TransformerLayer

__all__ = [
    "CheckpointFunction", "CoreAttention", "GPTModel", "LanguageModelEmbedding", "LayerNorm", "LayerSpec", "Linear",
    "MLP", "RMSNorm", "RotaryEmbedding", "SavedTensorsMeter", "SelfAttention", "TransformerBlock", "TransformerLayer",
    "apply_rotary_pos_emb", "build_norm", "checkpoint", "init_method_normal", "scaled_init_method_normal",
]
