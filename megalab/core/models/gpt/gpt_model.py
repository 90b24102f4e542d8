"""GPTModel: embeddings, a TransformerBlock, and logits over the vocabulary.

    input_ids [b, s] ─ embedding (word + learned positions) ─> [s, b, h]
                     ─ decoder (TransformerBlock: L layers, final_layernorm) ─> [s, b, h]
                     ─ output_layer (tied: the word-embedding matrix) ─> logits [b, s, V]
                       or, with labels, the per-token cross-entropy loss [b, s]

With RoPE the positions enter inside attention (rotary_pos_emb) instead of the embedding.
Megatron: GPTModel (megatron/core/models/gpt/gpt_model.py); `decoder`, `embedding`,
`rotary_pos_emb`, `output_layer` and `shared_embedding_or_output_weight` are its names.

packed_seq_params (PackedSeqParams, megalab/core/packed_seq_params.py): the rows hold packed documents; the
positions restart in each one (position_ids default to that) and attention stays inside each.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalab.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megalab.core.models.common.embeddings.rotary_pos_embedding import ContextParallelRotaryEmbedding, RotaryEmbedding
from megalab.core.models.gpt.gpt_layer_specs import tensor_parallel_layer_spec
from megalab.core.packed_seq_params import PackedSeqParams, packed_position_ids
from megalab.core.pipeline_parallel.schedules import virtual_stage
from megalab.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalab.core.tensor_parallel.layers import VocabParallelEmbedding, column_parallel_linear
from megalab.core.tensor_parallel.mappings import (
    _group,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megalab.core.tensor_parallel.utils import divide
from megalab.core.transformer.dot_product_attention import CoreAttention
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.transformer_block import TransformerBlock, get_layer_range
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import check_seq_length, cp_rank_positions, init_method_normal
from megalab.transformer_engine.context_parallel import ContextParallelAttention, check_not_packed
from megalab.transformer_engine.context_parallel import _group as _cp_group


class GPTModel(nn.Module):
    def __init__(self, config: TransformerConfig, spec: LayerSpec | None = None):
        super().__init__()
        spec = spec or LayerSpec()
        self.config = config
        self.embedding = LanguageModelEmbedding(config)
        self.rotary_pos_emb = None
        if config.position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels, config.rotary_percent, config.rotary_base, config.rotary_interleaved
            )
        self.decoder = TransformerBlock(config, spec)
        self.output_layer = None
        if not config.share_embeddings_and_output_weights:
            self.output_layer = spec.column_linear(
                config.hidden_size, config.vocab_size, config=config,
                init_method=init_method_normal(config.init_method_std), bias=False,
            )

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.embedding.word_embeddings.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if packed_seq_params is not None:  # checks the boundaries; positions restart in every document
            position_ids = packed_position_ids(input_ids, position_ids, packed_seq_params)
        # EXERCISE model.gpt_forward: embed, (rotary angles), decoder, output layer (tied or not), logits or loss
        ### BEGIN SOLUTION
        hidden_states = self.embedding(input_ids, position_ids)  # [s, b, h]
        rotary = self.rotary_pos_emb
        rotary_pos_emb = rotary(input_ids.shape[1], packed_seq_params) if rotary is not None else None
        hidden_states = self.decoder(hidden_states, rotary_pos_emb, packed_seq_params)
        if self.output_layer is None:
            logits = F.linear(hidden_states, self.shared_embedding_or_output_weight())  # [s, b, V]
        else:
            logits = self.output_layer(hidden_states)
        logits = logits.transpose(0, 1).contiguous()  # [b, s, V]
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        return loss.view_as(labels)  # [b, s]
        ### END SOLUTION


class TensorParallelGPTModel(GPTModel):
    """GPTModel over a TP group: vocab-parallel embedding and logits, parallel layers, and (with
    config.sequence_parallel) the hidden states split along the sequence between the embedding
    and the logits. The loss is vocab_parallel_cross_entropy; without labels the logits are
    gathered to [b, s, V]. Built with the same random draws as GPTModel(config), so the same seed
    gives the same model. Under SP call allreduce_sequence_parallel_grads(model) after backward.
    """

    def __init__(self, config: TransformerConfig, tp_group=None, core_attention: Callable = CoreAttention):
        group = _group(tp_group)
        t = dist.get_world_size(group)
        divide(config.num_query_groups, t, "num_query_groups")
        divide(config.vocab_size, t, "vocab_size (pad it with vocab_size_with_padding)")
        super().__init__(config, tensor_parallel_layer_spec(group, core_attention))
        self.tp_group = group
        full = self.embedding.word_embeddings.weight  # drawn exactly as on one device, then split
        self.embedding.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, init_method=lambda w: w.copy_(full), tp_group=group)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        sp, group = self.config.sequence_parallel, self.tp_group
        if packed_seq_params is not None:  # packed documents: every rank holds all tokens, attention needs no change
            position_ids = packed_position_ids(input_ids, position_ids, packed_seq_params)
        hidden_states = self.embedding(input_ids, position_ids)  # [s, b, h], summed over vocab slices
        if sp:
            hidden_states = scatter_to_sequence_parallel_region(hidden_states, group)  # [s/t, b, h]
        rotary = self.rotary_pos_emb
        rotary_pos_emb = rotary(input_ids.shape[1], packed_seq_params) if rotary is not None else None
        hidden_states = self.decoder(hidden_states, rotary_pos_emb, packed_seq_params)
        if self.output_layer is None:
            logits = column_parallel_linear(hidden_states, self.shared_embedding_or_output_weight(), None, sp, group)
        else:
            logits = self.output_layer(hidden_states)  # [s, b, V/t]
        logits = logits.transpose(0, 1).contiguous()  # [b, s, V/t]
        if labels is None:
            return gather_from_tensor_model_parallel_region(logits, group)  # [b, s, V]
        return vocab_parallel_cross_entropy(logits.float(), labels, group=group)  # [b, s]


class GPTStage(nn.Module):
    """One virtual stage of a GPTModel: [embedding] + decoder layers [start, stop) + [final norm, output layer].

    The first stage takes input_ids [b, s] and the others hidden states [s, b, h]; the last
    returns logits [b, s, V], the others hidden states [s, b, h]. The modules are the model's
    own (shared, not copied), so gradients land in the model's parameters. With tied
    embeddings the first and last stage both use the word embeddings: sum their gradients
    over the embedding group (`allreduce_word_embedding_grads`).
    (Megatron builds the same thing with GPTModel(pre_process=..., post_process=...).)
    """

    def __init__(self, model: nn.Module, start: int, stop: int, pre_process: bool, post_process: bool):
        super().__init__()
        self.model = [model]  # a list, so the whole model is not registered as a submodule
        self.pre_process, self.post_process, self.start = pre_process, post_process, start
        self.embedding = model.embedding if pre_process else None
        self.layers = model.decoder.layers[start:stop]
        self.final_layernorm = model.decoder.final_layernorm if post_process else None
        self.output_layer = model.output_layer if post_process else None
        self.word_embeddings = (model.embedding.word_embeddings
                                if post_process and model.output_layer is None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self.model[0]
        tp_group = getattr(model, "tp_group", None)  # a TensorParallelGPTModel's stages
        sp = model.config.sequence_parallel and tp_group is not None
        if self.pre_process:  # [b, s] -> [s, b, h]; a CP model's tokens are chunks of the sequence
            x = self.embedding(x, model.local_position_ids(x) if hasattr(model, "local_position_ids") else None)
            if sp:
                x = scatter_to_sequence_parallel_region(x, tp_group)  # [s/t, b, h]
        rotary, s = model.rotary_pos_emb, x.shape[0] * (dist.get_world_size(tp_group) if sp else 1)
        rotary_pos_emb = rotary(s) if rotary is not None else None
        for layer in self.layers:
            x = layer(x, rotary_pos_emb)
        if not self.post_process:
            return x  # [s, b, h] ([s/t, b, h] with SP)
        x = self.final_layernorm(x)
        if self.output_layer is not None:
            logits = self.output_layer(x)
        elif tp_group is not None:  # tied, vocab-parallel: [s, b, V/t]
            logits = column_parallel_linear(x, self.word_embeddings.weight, None, sp, tp_group)
        else:
            logits = F.linear(x, self.word_embeddings.weight)
        return logits.transpose(0, 1).contiguous()  # [b, s, V] ([b, s, V/t] under TP)


def build_gpt_stages(model: nn.Module, pp_size: int, pp_rank: int, num_model_chunks: int = 1) -> list[GPTStage]:
    """This rank's model chunks of `model` (chapter 02's GPTModel), chunk k = virtual stage k·pp + rank."""
    num_stages = pp_size * num_model_chunks
    stages = []
    for chunk in range(num_model_chunks):
        start, stop = get_layer_range(model.config.num_layers, pp_size, pp_rank, chunk, num_model_chunks)
        stage = virtual_stage(pp_size, pp_rank, chunk)
        stages.append(GPTStage(model, start, stop, stage == 0, stage == num_stages - 1))
    return stages


class ContextParallelGPTModel(TensorParallelGPTModel):
    """The TP GPT (tp may be 1) with CP core attention: takes this rank's tokens
    (get_batch_on_this_cp_rank) and returns their logits or per-token loss [b, s/cp].

    Built with the same random draws as GPTModel(config). Train with the loss summed over local
    tokens divided by the tokens of the whole batch, then finalize_context_parallel_grads.
    """

    def __init__(self, config: TransformerConfig, tp_group=None, cp_group=None, zigzag: bool = True,
                 variant: str = "p2p"):
        self.cp_group, self.zigzag = _cp_group(cp_group), zigzag
        check_seq_length(config.seq_length, dist.get_world_size(self.cp_group))
        super().__init__(config, tp_group, core_attention=partial(
            ContextParallelAttention, cp_group=self.cp_group, zigzag=zigzag, variant=variant))
        if self.rotary_pos_emb is not None:
            self.rotary_pos_emb = ContextParallelRotaryEmbedding(
                config.kv_channels, config.rotary_percent, config.rotary_base, self.cp_group, zigzag)

    def local_position_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[b, s/cp]: the positions in the full sequence of this rank's tokens."""
        cp = dist.get_world_size(self.cp_group)
        return cp_rank_positions(input_ids.shape[1] * cp, cp, dist.get_rank(self.cp_group),
                                 self.zigzag).to(input_ids.device).expand(input_ids.shape[0], -1)

    def forward(self, input_ids, position_ids=None, labels=None, packed_seq_params=None):
        check_not_packed(packed_seq_params)
        if position_ids is None:
            position_ids = self.local_position_ids(input_ids)
        return super().forward(input_ids, position_ids, labels)
