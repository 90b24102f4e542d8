"""GPTModel: embeddings, a TransformerBlock, and logits over the vocabulary — one class for every layout.

    input_ids [b, s] ─ embedding (word + learned positions) ─> [s, b, h]
                     ─ decoder (TransformerBlock: L layers, final_layernorm) ─> [s, b, h]
                     ─ output_layer (tied: the word-embedding matrix) ─> logits [b, s, V]
                       or, with labels, the per-token cross-entropy loss [b, s]

With RoPE the positions enter inside attention (rotary_pos_emb) instead of the embedding.
Megatron: GPTModel (megatron/core/models/gpt/gpt_model.py); `decoder`, `embedding`,
`rotary_pos_emb`, `output_layer`, `pre_process`/`post_process` and `shared_embedding_or_output_weight`
are its names.

Parallelism enters through the layer spec (gpt_layer_specs.py) and the config, never a subclass:
    tensor_parallel_layer_spec(tp_group)     parallel linears, the vocabulary split: logits [b, s, V/t]
                                             (as in Megatron, not gathered), loss by vocab_parallel_cross_entropy
    config.sequence_parallel                 with a TP spec: [s/t, b, h] between the embedding and the logits
    context_parallel_layer_spec(..., cp_group)  this rank's tokens [b, s/cp] (get_batch_on_this_cp_rank)
    pre_process / post_process, layer_range  a pipeline chunk: the embedding only on the first stage, the
                                             final norm and logits only on the last; `chunk` cuts one out
                                             of a model built whole (same modules, same random draws)

packed_seq_params (PackedSeqParams, megalab/core/packed_seq_params.py): the rows hold packed documents; the
positions restart in each one (position_ids default to that) and attention stays inside each.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalab.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megalab.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megalab.core.packed_seq_params import PackedSeqParams, packed_position_ids
from megalab.core.pipeline_parallel.schedules import virtual_stage
from megalab.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalab.core.tensor_parallel.layers import column_parallel_linear
from megalab.core.tensor_parallel.utils import divide
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.transformer_block import TransformerBlock, get_layer_range
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import check_seq_length, cp_rank_positions, init_method_normal
from megalab.transformer_engine.context_parallel import check_not_packed


class GPTModel(nn.Module):
    def __init__(self, config: TransformerConfig, spec: LayerSpec | None = None, pre_process: bool = True,
                 post_process: bool = True, layer_range: tuple[int, int] | None = None):
        super().__init__()
        spec = spec or LayerSpec()
        self.config, self.pre_process, self.post_process = config, pre_process, post_process
        self.tp_group, self.cp_group, self.cp_zigzag = spec.tp_group, spec.cp_group, spec.cp_zigzag
        if self.tp_group is not None:
            t = dist.get_world_size(self.tp_group)
            divide(config.num_query_groups, t, "num_query_groups")
            divide(config.vocab_size, t, "vocab_size (pad it with vocab_size_with_padding)")
        if self.cp_group is not None:
            check_seq_length(config.seq_length, dist.get_world_size(self.cp_group))
        tied = config.share_embeddings_and_output_weights
        self.embedding = LanguageModelEmbedding(config, self.tp_group) if pre_process else None
        if post_process and tied and not pre_process:  # the last stage's logits need the word embeddings
            # (Megatron keeps this copy in output_layer and copies the first stage's into it at the start)
            self.word_embeddings = LanguageModelEmbedding(config, self.tp_group).word_embeddings
            self.word_embeddings.weight.shared = True  # its grad is the first stage's: the grad norm skips it
        self.rotary_pos_emb = None
        if config.position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(config.kv_channels, config.rotary_percent, config.rotary_base,
                                                  config.rotary_interleaved, self.cp_group, self.cp_zigzag)
        self.decoder = TransformerBlock(config, spec, layer_range, post_layer_norm=post_process)
        self.output_layer = None
        if post_process and not tied:
            self.output_layer = spec.column_linear(
                config.hidden_size, config.vocab_size, config=config,
                init_method=init_method_normal(config.init_method_std), bias=False,
            )

    def chunk(self, start: int, stop: int, pre_process: bool, post_process: bool) -> GPTModel:
        """Layers [start, stop) of this model as a pipeline chunk: a GPTModel with the same modules (not
        copies), the embedding if pre_process, the final norm and output layer if post_process. A tied
        chunk with post_process but not pre_process keeps the word embeddings for its logits: sum their
        gradient with the first stage's over the embedding group (finalize_model_grads)."""
        chunk = GPTModel.__new__(GPTModel)
        nn.Module.__init__(chunk)
        chunk.config, chunk.pre_process, chunk.post_process = self.config, pre_process, post_process
        chunk.tp_group, chunk.cp_group, chunk.cp_zigzag = self.tp_group, self.cp_group, self.cp_zigzag
        chunk.embedding = self.embedding if pre_process else None
        if post_process and self.config.share_embeddings_and_output_weights and not pre_process:
            chunk.word_embeddings = self.embedding.word_embeddings
            chunk.word_embeddings.weight.shared = True  # its grad is the first stage's: the grad norm skips it
        chunk.rotary_pos_emb = self.rotary_pos_emb
        chunk.decoder = self.decoder.chunk(start, stop, post_layer_norm=post_process)
        chunk.output_layer = self.output_layer if post_process else None
        return chunk

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return (self.embedding.word_embeddings if self.embedding is not None else self.word_embeddings).weight

    def local_position_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[b, s/cp]: the positions in the full sequence of this context-parallel rank's tokens."""
        cp = dist.get_world_size(self.cp_group)
        return cp_rank_positions(input_ids.shape[1] * cp, cp, dist.get_rank(self.cp_group),
                                 self.cp_zigzag).to(input_ids.device).expand(input_ids.shape[0], -1)

    def rotary_seq_len(self, hidden_states: torch.Tensor) -> int:
        """The sequence length the rotary angles are for: this rank's tokens, whole again after SP."""
        sp = self.tp_group is not None and self.config.sequence_parallel
        return hidden_states.shape[0] * (dist.get_world_size(self.tp_group) if sp else 1)

    def output(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> logits [s, b, V] (this rank's V/t under TP): the output layer, or the word
        embeddings when tied (under SP the sequence is gathered first)."""
        if self.output_layer is not None:
            return self.output_layer(hidden_states)
        weight = self.shared_embedding_or_output_weight()
        if self.tp_group is None:
            return F.linear(hidden_states, weight)
        return column_parallel_linear(hidden_states, weight, None, self.config.sequence_parallel, self.tp_group)

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy [b, s] of logits [b, s, V] (vocab-parallel under TP), in fp32."""
        if self.tp_group is not None:
            return vocab_parallel_cross_entropy(logits.float(), labels, group=self.tp_group)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        return loss.view_as(labels)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        """input_ids [b, s] -> logits [b, s, V] or, with labels, the per-token loss [b, s].

        A pipeline chunk without pre_process takes the previous chunk's output [s, b, h] in place of
        input_ids (Megatron hands it over with set_input_tensor); one without post_process returns its
        hidden states [s, b, h] for the next."""
        if self.cp_group is not None:
            check_not_packed(packed_seq_params)
            if self.pre_process and position_ids is None:
                position_ids = self.local_position_ids(input_ids)
        if packed_seq_params is not None and self.pre_process:  # checks the boundaries; positions restart per document
            position_ids = packed_position_ids(input_ids, position_ids, packed_seq_params)
        # EXERCISE model.gpt_forward: embed, (rotary angles), decoder, output layer (tied or not), logits or loss
        ### BEGIN SOLUTION
        # HINT 1: embedding (first stage only) -> decoder -> output layer (last stage only): a chunk without pre_process
        #         receives hidden states [s, b, h] in place of ids, one without post_process returns them.
        # HINT 2: With RoPE, self.rotary_pos_emb(self.rotary_seq_len(hidden_states), packed_seq_params) gives the angles
        #         for the decoder. self.output gives logits [s, b, V]: transpose to [b, s, V] (contiguous); with labels
        #         return self.compute_language_model_loss instead.
        hidden_states = self.embedding(input_ids, position_ids) if self.pre_process else input_ids  # [s, b, h]
        rotary_pos_emb = None
        if self.rotary_pos_emb is not None:
            rotary_pos_emb = self.rotary_pos_emb(self.rotary_seq_len(hidden_states), packed_seq_params)
        hidden_states = self.decoder(hidden_states, rotary_pos_emb, packed_seq_params)
        if not self.post_process:
            return hidden_states  # to the next pipeline stage
        logits = self.output(hidden_states).transpose(0, 1).contiguous()  # [s, b, V] -> [b, s, V]
        if labels is None:
            return logits
        return self.compute_language_model_loss(labels, logits)  # [b, s]
        ### END SOLUTION


def build_gpt_stages(model: GPTModel, pp_size: int, pp_rank: int, num_model_chunks: int = 1,
                     layout=None) -> list[GPTModel]:
    """This rank's pipeline chunks of `model` (built whole), chunk k = virtual stage k·pp + rank.
    Megatron builds each rank's chunks directly (GPTModel(pre_process=..., post_process=..., vp_stage=k)).
    `layout` (a PipelineParallelLayerLayout for pp_size ranks and num_model_chunks chunks, validated for the
    model's num_layers) places uneven numbers of layers; without it every stage gets num_layers / (pp·v)."""
    num_stages = pp_size * num_model_chunks
    if layout is not None:
        if (layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size) != (pp_size, num_model_chunks):
            raise ValueError(f"the layout {layout!r} is for pp={layout.pipeline_model_parallel_size}, "
                             f"v={layout.virtual_pipeline_model_parallel_size}, not pp={pp_size}, v={num_model_chunks}")
        layout.validate_layer_layout(model.config.num_layers)
    stages = []
    for k in range(num_model_chunks):
        if layout is None:
            start, stop = get_layer_range(model.config.num_layers, pp_size, pp_rank, k, num_model_chunks)
        else:
            start = layout.get_layer_offset(vp_stage=k, pp_rank=pp_rank)
            stop = start + layout.get_num_layers_to_build(vp_stage=k, pp_rank=pp_rank)
        stage = virtual_stage(pp_size, pp_rank, k)
        stages.append(model.chunk(start, stop, pre_process=stage == 0, post_process=stage == num_stages - 1))
    return stages
