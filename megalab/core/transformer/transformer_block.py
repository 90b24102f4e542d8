"""A pre-norm transformer layer, and the block that stacks them (with activation recomputation).

    x ─┬─ input_layernorm ─ self_attention ─ dropout ─(+)─┬─ pre_mlp_layernorm ─ mlp ─ dropout ─(+)─> out
       └──────────────────── residual ─────────────────────┘└──────────────── residual ─────────────┘

Megatron: TransformerLayer (megatron/core/transformer/transformer_layer.py) and
TransformerBlock (transformer_block.py), whose final_layernorm ends the stack.

With config.num_moe_experts set, the MLP is a MoELayer (megalab/core/transformer/moe/moe_layer.py), as in Megatron's
MoE layer spec: a mixture-of-experts GPT is the same GPTModel.

Recomputation (config.recompute_granularity), in training only:
    "selective"  the core attention of every layer (SelfAttention checkpoints it): the s^2 part
    "full"       whole layers; recompute_method "uniform" checkpoints every chunk of
                 recompute_num_layers layers, "block" the first recompute_num_layers layers one by one.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megalab.core.packed_seq_params import PackedSeqParams
from megalab.core.pipeline_parallel.schedules import virtual_stage
from megalab.core.tensor_parallel.random import checkpoint, get_cuda_rng_tracker
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.torch_norm import build_norm
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.transformer.transformer_layer import TransformerLayer


class TransformerBlock(nn.Module):
    """The layers [start, stop) of the model (all by default), then the final layernorm (only on the
    last pipeline stage: post_layer_norm). Layer numbers are global, 1-based, as in Megatron."""

    def __init__(self, config: TransformerConfig, spec: LayerSpec | None = None,
                 layer_range: tuple[int, int] | None = None, post_layer_norm: bool = True):
        super().__init__()
        self.config = config
        start, stop = layer_range or (0, config.num_layers)
        self.layers = nn.ModuleList(TransformerLayer(config, spec, i + 1) for i in range(start, stop))
        self.final_layernorm = build_norm(config) if post_layer_norm else None

    def chunk(self, start: int, stop: int, post_layer_norm: bool) -> TransformerBlock:
        """A block of this block's layers [start, stop) (and its final norm if post_layer_norm), the
        same modules, not copies: a pipeline chunk of a model built whole."""
        block = TransformerBlock.__new__(TransformerBlock)
        nn.Module.__init__(block)
        block.config = self.config
        block.layers = nn.ModuleList(self.layers[start:stop])
        block.final_layernorm = self.final_layernorm if post_layer_norm else None
        return block

    def forward(self, hidden_states: torch.Tensor, rotary_pos_emb: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        # with sequence parallelism each TP rank holds other tokens: its dropout draws from the
        # tracker's model-parallel stream (Megatron's TransformerBlock.forward); without, the
        # replicated activations draw the same masks from the default stream
        with get_cuda_rng_tracker().fork() if self.config.sequence_parallel else contextlib.nullcontext():
            if self.config.recompute_granularity == "full" and self.training:
                hidden_states = self._checkpointed_forward(hidden_states, rotary_pos_emb, packed_seq_params)
            else:
                for layer in self.layers:
                    hidden_states = layer(hidden_states, rotary_pos_emb, packed_seq_params)
        return hidden_states if self.final_layernorm is None else self.final_layernorm(hidden_states)

    def _checkpointed_forward(self, hidden_states, rotary_pos_emb, packed_seq_params):
        n, layers = self.config.recompute_num_layers, self.layers
        if self.config.recompute_method == "uniform":  # only every chunk's input is kept
            for start in range(0, len(layers), n):
                hidden_states = checkpoint(_run_layers(layers[start:start + n]), hidden_states, rotary_pos_emb,
                                           packed_seq_params)
        else:  # "block": the first n layers are recomputed, the others keep their activations
            for i, layer in enumerate(layers):
                hidden_states = (checkpoint(layer, hidden_states, rotary_pos_emb, packed_seq_params) if i < n
                                 else layer(hidden_states, rotary_pos_emb, packed_seq_params))
        return hidden_states


def _run_layers(layers):
    def run(hidden_states, rotary_pos_emb, packed_seq_params):
        for layer in layers:
            hidden_states = layer(hidden_states, rotary_pos_emb, packed_seq_params)
        return hidden_states

    return run


# --------------------------------------------------------------------------------------- stages
def get_layer_range(num_layers: int, pp_size: int, pp_rank: int, chunk: int = 0,
                    num_model_chunks: int = 1) -> tuple[int, int]:
    """[start, stop) of the layers in virtual stage chunk·pp + rank, num_layers/(pp·v) layers each."""
    num_stages = pp_size * num_model_chunks
    if num_layers % num_stages != 0:
        raise ValueError(f"{num_layers} layers do not split evenly into pp_size*num_model_chunks={num_stages} stages; "
                         f"use a multiple of {num_stages} layers")
    # EXERCISE pp.stage_split: the contiguous block of layers of virtual stage chunk*pp_size + pp_rank
    ### BEGIN SOLUTION
    # HINT 1: Every virtual stage holds the same number of consecutive layers, and virtual stages are
    #         numbered chunk * pp_size + pp_rank, so a rank's chunks are spread over the model.
    # HINT 2: Layers per stage = num_layers // (pp_size * num_model_chunks); the stage number comes from
    #         virtual_stage(...); the range starts at stage number times layers per stage and is half-open.
    per_stage = num_layers // num_stages
    start = virtual_stage(pp_size, pp_rank, chunk) * per_stage
    return start, start + per_stage
    ### END SOLUTION
