"""All parallelisms in one training step: a GPT on a tp·cp·ep·dp·pp grid of real ranks.

Each rank builds the same model from the same seed, keeps its part and runs one step:

    ParallelState ─ tp: GPTModel from tensor_parallel_layer_spec (parallel linears, vocab-parallel embedding)
                  ─ cp: GPTModel from context_parallel_layer_spec: ring attention over the zigzag chunks
                  ─ pp: build_gpt_stages (GPTModel chunks), forward_backward_pipelining (1F1B over micro-batches)
                  ─ dp: its slice of the global batch; DistributedDataParallel averages the grads over
                        the dp-cp group (ZeRO 1-3 with DistributedOptimizer when pp = tp = 1)
                  ─ ep: MoE layers (megalab/core/transformer/moe/moe_layer.py): experts split over the EP group,
                        their grads averaged over expert-DP and the rest over DP-CP
                  ─ sp: norms' grads summed over tp
    finalize_model_grads completes every gradient (dp, sp, tied embeddings), as in Megatron's train_step.

and the step must equal the single-process one: the same loss (the mean over every token of the
global batch) and the same weights after the optimizer step, compared shard by shard
(`tensor_parallel.full_shard_of`). Megatron: pretrain_gpt.py's model_provider + megatron/training/training.py
train_step, which run exactly these pieces for every layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalab.core import parallel_state as ps
from megalab.core.distributed.distributed_data_parallel import DistributedDataParallel
from megalab.core.distributed.finalize_model_grads import finalize_model_grads
from megalab.core.models.gpt.gpt_layer_specs import context_parallel_layer_spec, tensor_parallel_layer_spec
from megalab.core.models.gpt.gpt_model import GPTModel, build_gpt_stages
from megalab.core.optimizer.distrib_optimizer import DistributedOptimizer
from megalab.core.pipeline_parallel.schedules import forward_backward_pipelining
from megalab.core.tensor_parallel import layers as tp
from megalab.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalab.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import get_batch_on_this_cp_rank
from megalab.lab import dist as mdist


@dataclass
class StepResult:
    loss: float  # mean over the global batch (the same on every rank)
    reference_loss: float  # the single-process step's
    worst_weight_diff: float  # max |ours - single process| over this rank's parameters after the step
    num_params: int  # parameters this rank holds


def global_batch(config: TransformerConfig, batch_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, s] and next-token labels, the same on every rank."""
    ids = torch.randint(0, config.vocab_size, (batch_size, config.seq_length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.roll(ids, -1, dims=1)


def build_model(config: TransformerConfig, state: ps.ParallelState, seed: int = 0,
                device: torch.device | str | None = None) -> tuple[nn.Module, list[nn.Module]]:
    """This rank's model (all of it built, same draws everywhere) and its pipeline stages, on `device`
    (default: the rank's, mdist.device())."""
    torch.manual_seed(seed)
    tp_group, cp_group = state.get_tensor_model_parallel_group(), state.get_context_parallel_group()
    if state.get_context_parallel_world_size() > 1:
        model = GPTModel(config, context_parallel_layer_spec(tp_group, cp_group))
    else:
        model = GPTModel(config, tensor_parallel_layer_spec(tp_group))
    model.to(device if device is not None else mdist.device())
    stages = build_gpt_stages(model, state.get_pipeline_model_parallel_world_size(),
                              state.get_pipeline_model_parallel_rank())
    return model, stages


def _local_loss(logits: torch.Tensor, labels: torch.Tensor, tp_group) -> torch.Tensor:
    """Mean next-token loss of one micro-batch from vocab-parallel logits [b, s, V/t]."""
    return vocab_parallel_cross_entropy(logits.float(), labels, group=tp_group).mean()


OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}


def train_step(config: TransformerConfig, state: ps.ParallelState, batch_size: int, num_microbatches: int, *,
               zero_stage: int = 0, optimizer: str = "sgd", lr: float = 0.1, seed: int = 0) -> StepResult:
    """One optimizer step of a GPT on this layout, checked against the same step on one process.

    SGD moves each weight by lr x grad, so the weights differ by lr x (the rounding of the grads).
    Adam's first step is lr x g / (|g| + eps): for the ~1e-9 gradients a small model has it turns
    rounding noise into differences of up to ~lr x 1e-2, whatever the layout.
    """
    optimizer_cls = OPTIMIZERS[optimizer]
    tp_group, tp_rank = state.get_tensor_model_parallel_group(), state.get_tensor_model_parallel_rank()
    dp_group = state.get_data_parallel_group(with_context_parallel=True)  # grads are averaged over dp-cp
    dp, dp_rank = state.get_data_parallel_world_size(), state.get_data_parallel_rank()  # the batch splits over dp
    cp, cp_rank = state.get_context_parallel_world_size(), state.get_context_parallel_rank()  # the sequence over cp
    pp = state.get_pipeline_model_parallel_world_size()
    if batch_size % (dp * num_microbatches):
        raise ValueError(f"batch_size {batch_size} must split into dp={dp} ranks x {num_microbatches} micro-batches")
    if config.hidden_dropout or config.attention_dropout:
        raise ValueError("set hidden_dropout = attention_dropout = 0: dropout masks are drawn differently per layout, "
                         "so the step could not equal the single-process one")
    if zero_stage and (pp > 1 or state.get_tensor_model_parallel_world_size() > 1):
        raise ValueError("this step runs ZeRO (zero_stage > 0) on pure data parallelism only (tp = pp = 1)")
    moe = config.num_moe_experts is not None
    if moe and (pp > 1 or zero_stage or config.moe_grouped_gemm):
        raise ValueError("MoE layouts here combine tp, cp, ep and dp (no pp, no ZeRO) with the loop of expert "
                         "MLPs (moe_grouped_gemm=False), so each expert maps to its single-process twin")
    ids, labels = (t.to(mdist.device()) for t in global_batch(config, batch_size))  # where build_model puts the model
    # EXERCISE hybrid.train_step: this rank's slice of the batch, micro-batches through the stages (pipelined if pp > 1), grads averaged over dp-cp, one optimizer step
    ### BEGIN SOLUTION
    # HINT 1: Every parallelism only cuts the work: each rank takes its data-parallel slice of the batch and
    #         its context-parallel share of the sequence, runs its micro-batches, and the gradients are then completed
    #         (averaged over dp-cp) so that the step equals the single-process one.
    # HINT 2: build_model; slice the batch by dp rank and get_batch_on_this_cp_rank; chunk it into
    #         micro-batches; wrap the stages in DistributedDataParallel (no wrapper for MoE) and make the optimizer;
    #         forward_backward_pipelining if pp > 1, else backward of loss / num_microbatches per micro-batch;
    #         finalize_model_grads; optimizer step.
    # HINT 3: Gradients must be means, not sums: over micro-batches (divide the loss) and over dp ranks
    #         (DDP averages; a plain all_reduce sums).
    model, stages = build_model(config, state, seed)
    local = slice(dp_rank * batch_size // dp, (dp_rank + 1) * batch_size // dp)
    mine = get_batch_on_this_cp_rank({"ids": ids[local], "labels": labels[local]}, cp, cp_rank)  # zigzag chunks
    inputs, targets = mine["ids"].chunk(num_microbatches), mine["labels"].chunk(num_microbatches)
    local = nn.ModuleList(stages)  # this rank's parameters
    if moe:  # experts reduce over expert-DP, the rest over DP (finalize_model_grads): no DP wrapper
        ddp, opt = None, optimizer_cls(local.parameters(), lr=lr)
    else:
        ddp = DistributedDataParallel(local, group=dp_group, zero_stage=zero_stage,
                                      overlap_grad_reduce=False)  # reduce once, after the last micro-batch
        opt = DistributedOptimizer(ddp, optimizer_cls, lr=lr) if zero_stage else optimizer_cls(ddp.parameters(), lr=lr)
    loss_func = lambda logits, y: _local_loss(logits, y, tp_group)
    with MoEAuxLossAutoScaler.loss_scale(1 / num_microbatches):  # MoE aux losses: their share of the mean
        if pp > 1:
            s, b, h = config.seq_length // cp, inputs[0].shape[0], config.hidden_size
            shape = (s // state.get_tensor_model_parallel_world_size() if config.sequence_parallel else s, b, h)
            result = forward_backward_pipelining(stages, inputs, targets, loss_func, shape,
                                                 group=state.get_pipeline_model_parallel_group())
            losses = result.losses
        else:
            losses = []
            for x, y in zip(inputs, targets):
                loss = loss_func(stages[0](x), y)
                (loss / num_microbatches).backward()
                losses.append(loss.item())
    finalize_model_grads([ddp] if ddp is not None else stages, state)  # dp(-cp) / edp, SP norms over tp, tied embeddings
    opt.step()
    ### END SOLUTION
    # the loss lives on the last stage: average over dp, then hand it to every rank
    loss = torch.tensor(sum(losses) / len(losses) if losses else 0.0, device=ids.device)
    dist.all_reduce(loss, group=dp_group)  # the mean over dp-cp of equal-sized local means
    dist.broadcast(loss, state.get_pipeline_model_parallel_last_rank(), group=state.get_pipeline_model_parallel_group())
    reference, reference_loss = single_process_step(config, ids, labels, num_microbatches * dp, optimizer_cls, lr, seed)
    full = ddp.full_parameters() if zero_stage == 3 else dict(local.named_parameters())
    first_expert = state.get_expert_model_parallel_rank() * (config.num_moe_experts or 0) // (
        state.get_expert_model_parallel_world_size())
    worst = 0.0
    for name, param in full.items():  # "<stage>.<name in the stage>"
        chunk, _, stage_name = name.partition(".")
        ref = reference[_model_name(stage_name, stages, int(chunk), first_expert)]
        stride = 2 if config.gated_linear_unit and "linear_fc1" in name else 1
        worst = max(worst, (param.detach() - tp.full_shard_of(ref, param, tp_rank, stride)).abs().max().item())
    return StepResult(loss.item() / (dp * cp), reference_loss, worst, sum(p.numel() for p in full.values()))


def _model_name(stage_name: str, stages: list[nn.Module], chunk: int, first_expert: int = 0) -> str:
    """A chunk's parameter name -> the whole GPTModel's (the chunk's "decoder.layers.0" is the layer with
    its layer_number; local expert i of this EP rank is expert first_expert + i)."""
    stage_name = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{first_expert + int(m.group(1))}.",
                        stage_name)
    if m := re.match(r"decoder\.layers\.(\d+)\.(.*)", stage_name):
        return f"decoder.layers.{stages[chunk].decoder.layers[int(m[1])].layer_number - 1}.{m[2]}"
    if stage_name.startswith("word_embeddings."):  # the last stage's share of the tied embedding
        return "embedding." + stage_name
    return stage_name


def single_process_step(config: TransformerConfig, ids: torch.Tensor, labels: torch.Tensor, num_microbatches: int,
                        optimizer_cls: type[torch.optim.Optimizer], lr: float,
                        seed: int) -> tuple[dict[str, torch.Tensor], float]:
    """The reference: the same model on one process, the loss averaged over the same micro-batches."""
    config = TransformerConfig(**{**vars(config), "sequence_parallel": False})
    with ps.no_model_parallel():  # no groups: MoE layers hold every expert
        torch.manual_seed(seed)
        model = GPTModel(config).to(ids.device)
        optimizer = optimizer_cls(model.parameters(), lr=lr)
        total = 0.0
        for x, y in zip(ids.chunk(num_microbatches), labels.chunk(num_microbatches)):
            with MoEAuxLossAutoScaler.loss_scale(1 / num_microbatches):
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) / num_microbatches
            loss.backward()
            total += loss.item()
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}, total
