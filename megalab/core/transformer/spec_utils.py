"""Which class plays which role in a transformer layer: a tiny version of Megatron's ModuleSpec.

Megatron describes a layer by a spec (megatron/core/models/gpt/gpt_layer_specs.py) naming the
class of each submodule; local, Transformer Engine and parallel variants differ only in their
specs. Here a spec names the two linear roles and the core attention:

    column_linear  linear_qkv, linear_fc1, output_layer   (ColumnParallelLinear in chapter 03)
    row_linear     linear_proj, linear_fc2                (RowParallelLinear in chapter 03)

A core attention maps (query [s, b, np, hn], key, value [s, b, ng, hn]) -> context [s, b, np * hn];
one that also takes `packed_seq_params` (as CoreAttention does) supports packed sequences.

A parallel spec also carries its groups, so the model built from it knows them: `tp_group` (the
tensor-parallel specs: vocab-parallel embedding and logits) and `cp_group` (the context-parallel spec:
this rank's chunks of the sequence). The local spec has neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from megalab.core.tensor_parallel.layers import Linear
from megalab.core.transformer.dot_product_attention import CoreAttention


@dataclass
class LayerSpec:
    column_linear: Callable = Linear
    row_linear: Callable = Linear
    core_attention: Callable = CoreAttention
    tp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    cp_zigzag: bool = True  # with cp_group: rank r holds chunks r and 2cp-1-r of the sequence
