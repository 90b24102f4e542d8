"""The plan's data: what each rank holds (ParameterMetadata) and what it sends or receives (TransferOp).

Megatron: megatron/core/resharding/utils.py (TransferOp, ParameterMetadata, ReshardPlan; the resolved_name
that maps a pipeline stage's local layer numbers to global ones).

The model_signature check is ours: Megatron's planner compares shapes only, which lets a model with other heads but the same matrix shapes
through; here two models with a different architecture never exchange weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# the architecture fields that must agree between the trainer's and the engine's model (sizes, not layout)
SIGNATURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                    "ffn_hidden_size", "vocab_size", "gated_linear_unit", "position_embedding_type",
                    "share_embeddings_and_output_weights", "normalization", "add_bias_linear")


@dataclass
class TransferOp:
    """One send or receive of one slice of one parameter. Megatron: TransferOp (utils.py)."""
    param_name: str  # resolved (global) name
    peer_rank: int  # global rank of the other side
    is_send: bool
    my_slice: tuple[slice, ...]  # of this rank's local tensor
    peer_slice: tuple[slice, ...]  # of the peer's local tensor
    task_id: int  # the same on the send and its receive: the global schedule's counter
    nbytes: int = 0  # of the slice, in the destination's dtype
    dtype: torch.dtype = torch.float32  # the destination's: the sender casts to it


@dataclass
class ParameterMetadata:
    """What one rank holds of one parameter (gathered so every rank sees every rank's). Megatron's fields."""
    name: str  # the rank-local name (a pipeline stage counts its layers from 0)
    resolved_name: str  # the global name: decoder.layers.<global index>...
    shape: tuple[int, ...]  # the LOCAL shape (a TP slice)
    dtype: torch.dtype
    element_size: int
    owner_rank: int
    is_tp: bool = False
    partition_dim: int = 0
    partition_stride: int = 1
    tensor_parallel_group_ranks: list[int] = field(default_factory=list)


@dataclass
class ReshardPlan:
    """This rank's operations, in task_id order. Megatron: ReshardPlan (utils.py)."""
    send_ops: list[TransferOp]
    recv_ops: list[TransferOp]
    rank: int = 0

    def bytes_sent(self) -> int:
        """Bytes this rank puts on the wire (a same-rank copy moves nothing)."""
        return sum(op.nbytes for op in self.send_ops if op.peer_rank != self.rank)

    def bytes_received(self) -> int:
        return sum(op.nbytes for op in self.recv_ops if op.peer_rank != self.rank)

    def __str__(self):
        return f"ReshardPlan(sends={len(self.send_ops)}, recvs={len(self.recv_ops)})"


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def model_signature(config) -> dict:
    return {f: getattr(config, f, None) for f in SIGNATURE_FIELDS}


def named_resolved_params(model_chunks):
    """(resolved name, local name, parameter) of a GPTModel or a list of its pipeline chunks.

    A chunk's layers are numbered from 0 (decoder.layers.0 on stage 1 is the model's layer 2): the global
    number comes from each layer's layer_number (1-based, as in Megatron). The last stage's copy of the tied
    word embeddings (`word_embeddings.weight`) is left out: the first stage's is the source, and the engine
    (one pipeline stage) has no such copy.
    """
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    # EXERCISE resharding.named_resolved_params: every chunk's parameters under their global names (layer_number), without the last stage's tied embedding copy
    ### BEGIN SOLUTION
    # HINT 1: Two pipeline stages both hold a `decoder.layers.0`: the local number says where a layer sits in its
    #         chunk, not which layer of the model it is. Each TransformerLayer knows its global number,
    #         `layer_number`, counted from 1 as in Megatron; a resolved name counts from 0, like the whole
    #         model's own parameter names (GPTModel(config).named_parameters()).
    # HINT 2: For each chunk, for each (name, parameter) of chunk.named_parameters(): skip the name
    #         "word_embeddings.weight" (the last stage's copy of the tied embedding); if the name starts with
    #         `decoder.layers.<i>.` (the _LAYER pattern), look up chunk.decoder.layers[i].layer_number and
    #         rebuild the name with that number minus one; other names stay as they are. Yield
    #         (resolved name, local name, parameter).
    for chunk in chunks:
        layers = chunk.decoder.layers
        for name, p in chunk.named_parameters():
            if name == "word_embeddings.weight":
                continue
            m = _LAYER.match(name)
            resolved = f"decoder.layers.{layers[int(m.group(1))].layer_number - 1}." + name[m.end():] if m else name
            yield resolved, name, p
    ### END SOLUTION


def extract_param_metadata(model_chunks, owner_rank: int, tp_group=None) -> dict[str, ParameterMetadata]:
    """resolved name -> this rank's metadata (Megatron: _extract_module_metadata in planner.py)."""
    tp_ranks = [owner_rank] if tp_group is None else dist.get_process_group_ranks(tp_group)
    out = {}
    for resolved, name, p in named_resolved_params(model_chunks):
        is_tp = bool(getattr(p, "tensor_model_parallel", False)) and tp_group is not None
        out[resolved] = ParameterMetadata(
            name=name, resolved_name=resolved, shape=tuple(p.shape), dtype=p.dtype,
            element_size=p.element_size(), owner_rank=owner_rank, is_tp=is_tp,
            partition_dim=getattr(p, "partition_dim", 0) if is_tp else 0,
            partition_stride=getattr(p, "partition_stride", 1) if is_tp else 1,
            tensor_parallel_group_ranks=list(tp_ranks) if is_tp else [owner_rank])
    return out
