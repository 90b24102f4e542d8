"""The training loop in Megatron's shape: pretrain -> train_step -> forward_backward_func.

    pretrain(config, dataset)                        megatron/training/training.py
      setup_model_and_optimizer                      TP model, PP stages, DDP over DP, AdamW groups
                                                     (or the DistributedOptimizer: AdamW state
                                                     sharded over DP), schedule; then _set_random_seed:
                                                     seed + 100·pp_rank, the same on every TP/CP/DP
                                                     rank, and the RNG tracker's TP stream
      [load_checkpoint]                              model, optimizer, scheduler, RNG, consumed_samples
      for iteration:
        train_step                                   one global batch = micro-batches x DP ranks
          ddp.zero_grad_buffer()
          forward_backward_pipelining(...)           chapter 03's executor; grads accumulate (no_sync);
                                                     MoE: aux-loss scale cp/m on every micro-batch
          finalize_model_grads(...)                  DDP first: average over DP x CP (distributed
                                                     optimizer: reduce-scatter, each rank keeps its
                                                     shard); then SP norms over TP, tied embeddings
                                                     over the embedding group (Megatron's order);
                                                     MoE: expert bias, the global aux loss's window reset
          clip_grad_norm(...)                        global norm over TP x PP (and DP when sharded)
          optimizer.step(); scheduler.step()
        training_log                                 loss, lr, grad norm, tokens/s, MFU
        [save_checkpoint]

The loss is the mean over ALL unmasked tokens of the global batch, not a mean of per-micro-batch
means (they differ when loss masks differ). The token count is all-reduced over DP first; each
micro-batch's loss is its token SUM divided by that count, times m·dp to undo the 1/m of the
pipeline executor and the 1/dp of DDP's gradient average:

    grad = sum over dp ranks, micro-batches of  (1/dp)(1/m) · m·dp · sum(loss·mask) / N  = d(mean)/dw

Data: iteration i reads the global batch of samples [consumed, consumed + B), micro-batch j of
DP rank r = samples consumed + (j·dp + r)·b ... + b (Megatron's MegatronPretrainingSampler);
`consumed_samples` is the data position a checkpoint stores. With context parallelism the cp
ranks of one DP rank share its samples, each keeping 2 of the 2·cp sequence chunks
(get_batch_on_this_cp_rank); N is then all-reduced, and dp replaced by dp·cp, over the DP x CP
group (Megatron's get_data_parallel_group(with_context_parallel=True)).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from megalab.core import parallel_state
from megalab.core.distributed.distributed_data_parallel import DistributedDataParallel
from megalab.core.distributed.finalize_model_grads import finalize_model_grads
from megalab.core.models.gpt.gpt_layer_specs import context_parallel_layer_spec, tensor_parallel_layer_spec
from megalab.core.models.gpt.gpt_model import GPTModel, build_gpt_stages
from megalab.core.optimizer import get_param_groups
from megalab.core.optimizer.clip_grads import clip_grad_norm
from megalab.core.optimizer.distrib_optimizer import DistributedOptimizer
from megalab.core.optimizer_param_scheduler import OptimizerParamScheduler
from megalab.core.pipeline_parallel.schedules import forward_backward_pipelining
from megalab.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalab.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import check_seq_length, get_batch_on_this_cp_rank
from megalab.extras.calc import flops_per_iteration
from megalab.lab import dist as mdist
from megalab.training.checkpointing import load_checkpoint, read_tracker, save_checkpoint


@dataclass
class TrainingConfig:
    """What Megatron's arguments say about a run (names as Megatron's flags, without the dashes)."""

    model: TransformerConfig
    train_iters: int
    micro_batch_size: int = 2
    global_batch_size: int = 8
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 2
    lr_decay_iters: int | None = None  # default: train_iters
    lr_decay_style: str = "cosine"
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_style: str = "exponential"  # Megatron's --lr-wsd-decay-style default
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0
    seed: int = 1234
    log_interval: int = 1
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    exit_interval: int | None = None  # stop (after saving) once iteration % exit_interval == 0, as if interrupted
    peak_flops_per_rank: float | None = None  # for MFU; None: MFU not reported
    context_parallel_size: int = 1  # CP: every sequence split over cp ranks (load-balanced chunks, ring attention)
    use_distributed_optimizer: bool = False  # ZeRO-1: AdamW state and the grads it reads sharded over DP
    device: str | None = None  # None: the rank's device (mdist.device(): its GPU under NCCL, else the CPU)

    def __post_init__(self):
        if self.context_parallel_size > 1:
            check_seq_length(self.model.seq_length, self.context_parallel_size)
        if self.model.sequence_parallel and self.model.seq_length % (self.context_parallel_size
                                                                    * self.tensor_model_parallel_size):
            raise ValueError(f"sequence_parallel splits each rank's {self.model.seq_length} // "
                             f"{self.context_parallel_size} tokens over tp={self.tensor_model_parallel_size}: "
                             "make seq_length divisible by context_parallel_size x tensor_model_parallel_size")


@dataclass
class TrainState:
    """Everything one rank holds for training (Megatron keeps these in globals and args)."""

    model: nn.Module  # the full (TP-split) model; this rank computes only `stages`
    stages: list[nn.Module]
    ddp: DistributedDataParallel
    optimizer: torch.optim.Optimizer | DistributedOptimizer
    scheduler: OptimizerParamScheduler
    ps: parallel_state.ParallelState
    iteration: int = 0
    consumed_samples: int = 0

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self.ddp.module.parameters())


def num_microbatches(config: TrainingConfig, dp: int) -> int:
    per_step = config.micro_batch_size * dp
    if config.global_batch_size % per_step != 0:
        raise ValueError(f"global_batch_size={config.global_batch_size} is not a multiple of micro_batch_size x dp "
                         f"= {per_step}: change the batch sizes or the parallel layout")
    return config.global_batch_size // per_step


def training_device(config: TrainingConfig) -> torch.device:
    """Where this rank trains: config.device, or the rank's own (mdist.device()). A CUDA device without a GPU,
    or a CPU device under NCCL (which moves CUDA tensors only), is an error that says what to use."""
    if config.device is None:
        return mdist.device()
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"TrainingConfig(device={config.device!r}) but this machine has no CUDA GPU: leave device=None "
                         "(the rank's device) or use 'cpu'")
    if device.type != "cuda" and dist.is_initialized() and dist.get_backend() == "nccl":
        raise ValueError(f"TrainingConfig(device={config.device!r}) under NCCL, which moves CUDA tensors only: leave "
                         "device=None (the rank's GPU) or launch with --backend gloo")
    return device


def setup_model_and_optimizer(config: TrainingConfig) -> TrainState:
    """Collective: parallel groups, the model's stages on this rank, DDP, AdamW with decay groups, the schedule."""
    device = training_device(config)
    ps = parallel_state.initialize_model_parallel(config.tensor_model_parallel_size,
                                                  config.pipeline_model_parallel_size, config.context_parallel_size)
    num_microbatches(config, ps.get_data_parallel_world_size())
    torch.manual_seed(config.seed)  # every rank draws the same full model, then keeps its slices
    if config.context_parallel_size > 1:
        spec = context_parallel_layer_spec(ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group())
    else:
        spec = tensor_parallel_layer_spec(ps.get_tensor_model_parallel_group())
    model = GPTModel(config.model, spec).to(device)
    stages = build_gpt_stages(model, ps.get_pipeline_model_parallel_world_size(),
                              ps.get_pipeline_model_parallel_rank())
    # grads are averaged over DP x CP: CP ranks saw other tokens of the same sequences
    ddp = DistributedDataParallel(nn.ModuleList(stages), group=ps.get_data_parallel_group(with_context_parallel=True),
                                  zero_stage=1 if config.use_distributed_optimizer else 0)
    groups = get_param_groups(ddp.module, config.weight_decay)
    adam = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2))
    if config.use_distributed_optimizer:
        optimizer = DistributedOptimizer(ddp, torch.optim.AdamW, param_groups=groups, **adam)
    else:
        optimizer = torch.optim.AdamW(groups, **adam)
    scheduler = OptimizerParamScheduler(optimizer, config.lr, config.min_lr, config.lr_warmup_iters,
                                        config.lr_decay_iters or config.train_iters, config.lr_decay_style,
                                        wsd_decay_steps=config.lr_wsd_decay_iters,
                                        lr_wsd_decay_style=config.lr_wsd_decay_style)
    _set_random_seed(config.seed, ps)  # the streams dropout draws from, from here on
    return TrainState(model, stages, ddp, optimizer, scheduler, ps)


def _set_random_seed(seed: int, ps: parallel_state.ParallelState) -> None:
    """Megatron's _set_random_seed (megatron/training/initialize.py): seed + 100 * pp_rank, the same on every
    TP, CP and DP rank of a stage (Megatron adds 10 * dp_rank only with --data-parallel-random-init), so
    the activations replicated over TP draw the same dropout masks and the replicated weights stay equal;
    the tracker's model-parallel stream (seed + 2718 + tp_rank) serves the TP-split regions."""
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
                                    ps.get_expert_tensor_parallel_rank())


def build_train_dataset(num_samples: int, seq_length: int, seed: int = 1234, names: tuple[str, ...] = ("shakespeare",)):
    """The shipped corpus as a GPTDataset of num_samples samples, and its tokenizer (pretrain_gpt.py's
    train_valid_test_datasets_provider, with one split and one dataset)."""
    from megalab.core.datasets.gpt_dataset import GPTDataset
    from megalab.core.datasets.indexed_dataset import IndexedDataset
    from megalab.tools.preprocess_data import prepare_corpus
    from megalab.training.tokenizer.tokenizer import Tokenizer

    if len(names) != 1:
        raise ValueError("build_train_dataset takes one corpus name; blend several with megalab.core.datasets.blended_dataset")
    tokenizer = Tokenizer.from_file()
    corpus = IndexedDataset(prepare_corpus(names)[0])
    return GPTDataset(corpus, seq_length, num_samples, seed, tokenizer.eod), tokenizer


def get_batch(dataset, first: int, count: int) -> dict[str, torch.Tensor]:
    """Samples first .. first+count-1 of the dataset, stacked: each field [count, s]."""
    items = [dataset[i] for i in range(first, first + count)]
    return {key: torch.stack([item[key] for item in items]) for key in ("tokens", "labels", "loss_mask")}


def masked_loss(losses: torch.Tensor, loss_mask: torch.Tensor, num_tokens: float, m: int, dp: int) -> torch.Tensor:
    """A micro-batch's share of the global token-mean loss, pre-scaled by m·dp (see the module docstring).

    losses, loss_mask: [b, s]; num_tokens: unmasked tokens in the whole global batch (all DP ranks).
    """
    # EXERCISE training.masked_loss: masked token-loss SUM over the global token count, times m*dp
    ### BEGIN SOLUTION
    # HINT 1: The idea. The loss of a global batch is the mean over its UNMASKED tokens: the sum of loss * mask over
    #         every micro-batch and DP rank, over num_tokens. So each micro-batch gives its masked sum over that count.
    # HINT 2: The approach. Which count belongs under the masked sum: this micro-batch's unmasked tokens, its
    #         b * s, or num_tokens of the whole global batch? Then undo what happens after you: the schedule divides
    #         each micro-batch's loss by m, and the gradient all-reduce averages over the dp ranks.
    return (losses * loss_mask).sum() / num_tokens * (m * dp)
    ### END SOLUTION


def loss_func(output: torch.Tensor, target: tuple, tp_group) -> torch.Tensor:
    """Megatron's loss_func: per-token cross entropy of the (vocab-split) logits [b, s, V/t], then masked_loss."""
    labels, loss_mask, num_tokens, m, dp = target
    losses = vocab_parallel_cross_entropy(output.float(), labels, group=tp_group)  # [b, s]
    return masked_loss(losses, loss_mask, num_tokens, m, dp)


def train_step(state: TrainState, config: TrainingConfig, dataset) -> dict:
    """One iteration on one global batch; returns the global token-mean loss (on every rank), grad norm, lr.

    Under CP the DP rank's samples are cut along the sequence (get_batch_on_this_cp_rank) and the
    token count, the loss and the gradient are summed / averaged over the DP x CP group.
    MoE aux losses: the schedule sets their gradient scale to cp/m (Megatron's default, not its
    --calculate-per-token-loss plumbing: the token mean here goes through the schedule's 1/m and DDP's
    average), so each micro-batch's aux loss weighs 1/(m·dp), as Megatron's does.
    """
    ps = state.ps
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
    b, m = config.micro_batch_size, num_microbatches(config, dp)
    device = state.params[0].device  # the data follows the model
    batches = [{k: v.to(device) for k, v in get_batch(dataset, state.consumed_samples + (j * dp + dp_rank) * b,
                                                       b).items()} for j in range(m)]
    if cp > 1:
        batches = [get_batch_on_this_cp_rank(batch, cp, cp_rank) for batch in batches]  # [b, s/cp] each
    num_tokens = sum(batch["loss_mask"].sum() for batch in batches).float()  # on the device, no host sync
    dist.all_reduce(num_tokens, group=dp_cp_group)
    tp_group = ps.get_tensor_model_parallel_group()
    s = config.model.seq_length // cp // (ps.get_tensor_model_parallel_world_size()
                                          if config.model.sequence_parallel else 1)

    state.ddp.zero_grad_buffer()
    with state.ddp.no_sync():
        result = forward_backward_pipelining(
            state.stages, [batch["tokens"] for batch in batches],
            [(batch["labels"], batch["loss_mask"], num_tokens.item(), m, dp * cp) for batch in batches],
            lambda output, target: loss_func(output, target, tp_group),
            tensor_shape=(s, b, config.model.hidden_size),  # what passes between stages: [s/cp(/t with SP), b, h]
            group=ps.get_pipeline_model_parallel_group())
    finalize_model_grads([state.ddp], state.ps)
    # the loss: sum over micro-batches and DP x CP of each micro-batch's share, on the last stage; sent to all
    loss = torch.tensor(sum(result.losses) / (m * dp * cp) if ps.is_pipeline_last_stage() else 0.0,
                        dtype=torch.float64, device=device)
    dist.all_reduce(loss, group=dp_cp_group)
    dist.broadcast(loss, ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    if config.use_distributed_optimizer:  # each rank holds 1/dp of the grads: the norm sums over every rank
        grad_norm = clip_grad_norm(state.optimizer.main_params, config.clip_grad, dist.group.WORLD,
                                   ps.get_tensor_model_parallel_rank())
    else:
        grad_norm = clip_grad_norm(state.params, config.clip_grad, ps.get_model_parallel_group(),
                                   ps.get_tensor_model_parallel_rank())
    lr = state.optimizer.param_groups[0]["lr"]
    state.optimizer.step()
    state.scheduler.step()
    state.iteration += 1
    state.consumed_samples += config.global_batch_size
    return {"iteration": state.iteration, "loss": loss.item(), "grad_norm": grad_norm, "lr": lr}


def training_log(record: dict, config: TrainingConfig, elapsed: float, world_size: int) -> dict:
    """Add tokens/s and MFU (model FLOPs from calc.flops_per_iteration, no recompute counted) to a step's record."""
    m = config.model
    tokens = config.global_batch_size * m.seq_length
    flops = flops_per_iteration(config.global_batch_size, m.seq_length, m.num_layers, m.hidden_size, m.vocab_size,
                                recompute=False)
    record = {**record, "step_time": elapsed, "tokens_per_s": tokens / elapsed}
    if config.peak_flops_per_rank:
        record["mfu"] = flops / elapsed / (world_size * config.peak_flops_per_rank)
    return record


def measure_peak_flops(n: int = 512, repeats: int = 10) -> float:
    """FLOP/s of an n x n fp32 matmul on this device: the "peak" MFU is relative to, where no datasheet applies."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b  # warm up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def print_log(record: dict) -> None:
    mfu = f" | MFU {100 * record['mfu']:.2f}%" if "mfu" in record else ""
    print(f"iteration {record['iteration']:4d} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
          f"grad norm {record['grad_norm']:.3f} | {record['tokens_per_s']:.0f} tokens/s{mfu}", flush=True)


def pretrain(config: TrainingConfig, dataset, on_log: Callable[[dict], None] | None = print_log) -> list[dict]:
    """Collective: train for config.train_iters iterations (resuming from config.load); returns every step's record.

    Logs (on_log) run on global rank 0 every log_interval iterations; pass on_log=None for silence.
    """
    state = setup_model_and_optimizer(config)
    try:
        if config.load is not None and read_tracker(config.load) is not None:
            common = load_checkpoint(config.load, state.model, state.params, state.optimizer, state.scheduler,
                                     state.ps.get_tensor_model_parallel_group())
            state.iteration, state.consumed_samples = common["iteration"], common["consumed_samples"]
        needed = config.train_iters * config.global_batch_size
        if len(dataset) < needed:
            raise ValueError(f"the dataset has {len(dataset)} samples, {config.train_iters} iterations need {needed}")
        records = []
        while state.iteration < config.train_iters:
            start = time.perf_counter()
            record = training_log(train_step(state, config, dataset), config, time.perf_counter() - start,
                                  dist.get_world_size())
            records.append(record)
            if on_log is not None and dist.get_rank() == 0 and state.iteration % config.log_interval == 0:
                on_log(record)
            if config.save and config.save_interval and state.iteration % config.save_interval == 0:
                save_checkpoint(config.save, state.iteration, state.model, state.params, state.optimizer,
                                state.scheduler, state.consumed_samples, state.ps.get_tensor_model_parallel_group())
            if config.exit_interval and state.iteration % config.exit_interval == 0:
                break
        return records
    finally:
        parallel_state.destroy_model_parallel()


def small_gpt_config(vocab_size: int, seq_length: int = 64) -> TransformerConfig:
    """The chapter's model: 4 layers, hidden 64, untied output layer, no dropout (runs on a laptop CPU)."""
    return TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=vocab_size,
                             seq_length=seq_length, hidden_dropout=0.0, attention_dropout=0.0,
                             share_embeddings_and_output_weights=False)
