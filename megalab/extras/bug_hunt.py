"""Silent bugs of parallel training: five real ones, each in one small function, and the toy trainers that hide them.

Chapter 07 · 05 (course/07_projects/05_silent_bug_hunt.ipynb). A silent bug trains: no error, no NaN, a loss
curve that goes down. Only a comparison shows it. Each function below holds one bug hunt's exercise region:
the reference runs the fix, the learner's copy starts with the bug (the lines after `### BUGGY`).

    bug (exercise)         function                       trainer       the tool that exposes it
    bugs.tp_dropout_seed   tensor_parallel_dropout_seed   train_tp      the TP ranks' dropout masks vs one process's
    bugs.vocab_padding     vocab_partition                train_tp      one process (same padded vocabulary)
    bugs.output_layer      build_output_layer             train_tp      per-rank gradient norms, the comm tracer
    bugs.pp_grad_sync      should_sync_grads              train_pp_dp   per-rank gradient norms of DP replicas
    bugs.cp_packed         cp_batch_from_documents        train_cp      one process, document by document

The trainers are small but real: Megatron's layers (VocabParallelEmbedding, Column/RowParallelLinear,
vocab_parallel_cross_entropy), its 1F1B schedule, ring attention in the GPTModel; every rank also builds the
single-process model from the same seed, so "== single process" is a comparison of numbers, not a belief.
`injected(name)` runs a trainer with a function's buggy version (read from its region), to show the bug next
to the fix.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import textwrap
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalab.core import parallel_state as ps
from megalab.core.distributed.finalize_model_grads import finalize_model_grads
from megalab.core.models.gpt.gpt_layer_specs import context_parallel_layer_spec
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.packed_seq_params import pack_batch
from megalab.core.pipeline_parallel.schedules import forward_backward_pipelining, get_num_warmup_microbatches
from megalab.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalab.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_shard_of,
)
from megalab.core.tensor_parallel.utils import vocab_size_with_padding
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import get_batch_on_this_cp_rank, init_method_normal
from megalab.extras.comm_tracer import CollectiveTracer
from megalab.lab import dist as mdist


# ================================================================== the five functions (one bug each)
def tensor_parallel_dropout_seed(base_seed: int, tp_rank: int) -> int:
    """The seed of this rank's dropout stream inside tensor-parallel regions (dropout on a [.., ffn/t] slice).

    The default stream (seed `base_seed`, the same on every TP rank) drops the replicated residual stream;
    inside a TP region every rank holds different features and needs its own draws
    (Megatron: model_parallel_cuda_manual_seed, tensor_model_parallel_seed)."""
    # EXERCISE bugs.tp_dropout_seed: each tensor-parallel rank needs its own dropout stream, apart from the default one
    ### BEGIN SOLUTION
    # HINT 1: Inside a TP region rank r holds features [r·ffn/t, (r+1)·ffn/t). One seed for all ranks means the
    #         same mask pattern on every slice: the full-width mask repeats itself t times.
    # HINT 2: Megatron's model_parallel_cuda_manual_seed offsets the seed by a constant (2718) plus the TP rank,
    #         so no TP rank's stream coincides with the default one or with another rank's.
    return base_seed + 2718 + tp_rank
    ### BUGGY
    # return base_seed
    ### END SOLUTION


def vocab_partition(vocab_size: int, tp_size: int) -> tuple[int, int]:
    """(rows of the embedding table and output layer, rows per TP rank) for a vocabulary of `vocab_size` ids.

    Every token id in [0, vocab_size) must belong to exactly one rank's slice [r·per, (r+1)·per)."""
    # EXERCISE bugs.vocab_padding: every token id belongs to exactly one rank's slice, whatever vocab_size % tp_size is
    ### BEGIN SOLUTION
    # HINT 1: With a vocabulary that tp_size does not divide, equal slices cannot cover it exactly. Slices that
    #         are too short leave the last ids to nobody: their embedding is zero and their logit never exists.
    # HINT 2: Megatron pads the table instead (_vocab_size_with_padding: --make-vocab-size-divisible-by × TP);
    #         megalab.core.tensor_parallel.utils has the same helper. The extra rows are ids no data uses.
    padded = vocab_size_with_padding(vocab_size, 1, tp_size)
    return padded, padded // tp_size
    ### BUGGY
    # per_partition = vocab_size // tp_size  # each rank's slice
    # return per_partition * tp_size, per_partition
    ### END SOLUTION


def build_output_layer(config: TransformerConfig, vocab_size: int, tp_group) -> nn.Module:
    """The final projection hidden -> logits: [b, s, h] -> [b, s, vocab_size / t], this rank's vocabulary slice
    (what vocab_parallel_cross_entropy takes). `vocab_size` is the padded size (vocab_partition)."""
    # EXERCISE bugs.output_layer: the output layer is a tensor-parallel layer: this rank's vocabulary rows, and f before them
    ### BEGIN SOLUTION
    # HINT 1: A layer that computes this rank's vocabulary slice is only half of Megatron's ColumnParallelLinear:
    #         the forward is the same, but in backward the hidden state must receive the gradient of EVERY slice.
    # HINT 2: Which layer of megalab.core.tensor_parallel.layers applies copy_to_tensor_model_parallel_region
    #         (identity forward, all-reduce backward) before its matmul, and keeps its output split?
    return ColumnParallelLinear(config.hidden_size, vocab_size, config=config, init_method=init_method_normal(0.02),
                                bias=False, gather_output=False, tp_group=tp_group)
    ### BUGGY
    # return nn.Linear(config.hidden_size, vocab_size // dist.get_world_size(tp_group), bias=False)
    ### END SOLUTION


def should_sync_grads(backward_index: int, num_microbatches: int, num_warmup: int) -> bool:
    """Should the data-parallel all-reduce run in the backward of micro-batch `backward_index` (0-based, in the
    order this pipeline stage runs its backwards)? Exactly once per step, after every micro-batch's gradient
    has been accumulated. 1F1B runs `num_warmup` forwards first, so its last `num_warmup` backwards form the
    cooldown phase (none on the last stage)."""
    # EXERCISE bugs.pp_grad_sync: enable the DP gradient all-reduce for the last backward of the step, in whichever 1F1B phase it falls
    ### BEGIN SOLUTION
    # HINT 1: The all-reduce must see the sum of all micro-batches' gradients: it belongs to the last backward of
    #         the step. On the last pipeline stage there are no warmup forwards, so there is no cooldown phase.
    # HINT 2: Megatron's forward_backward_pipelining_without_interleaving calls enable_grad_sync() in two places:
    #         in the cooldown loop, and in the steady-state loop when num_warmup_microbatches == 0. Which backward
    #         is last, counting all of them?
    return backward_index == num_microbatches - 1
    ### BUGGY
    # in_cooldown = backward_index >= num_microbatches - num_warmup
    # return in_cooldown and backward_index == num_microbatches - 1
    ### END SOLUTION


def cp_batch_from_documents(docs: list[torch.Tensor], seq_length: int) -> dict:
    """Training rows for context parallelism from documents of n + 1 tokens each (n <= seq_length):
    "tokens", "labels", "loss_mask", "position_ids" [b, seq_length]. Ring attention sees each row as ONE causal
    sequence (ContextParallelAttention refuses PackedSeqParams); seq_length must divide by 2·cp."""
    # EXERCISE bugs.cp_packed: ring attention takes one causal sequence per row: never two documents in one row
    ### BEGIN SOLUTION
    # HINT 1: Without cu_seqlens, attention inside a row is plain causal: a token of the second document in a row
    #         attends to every token of the first. The loss even looks better (free context), and it is wrong.
    # HINT 2: pack_batch (megalab.core.packed_seq_params) pads a row's unused tail with a masked padding document.
    #         Give every document a row of its own, and keep the loss_mask on the padding at 0.
    rows = [pack_batch([doc], seq_length) for doc in docs]  # one document per row, then masked padding
    return {key: torch.cat([row[key] for row in rows]) for key in ("tokens", "labels", "loss_mask", "position_ids")}
    ### BUGGY
    # batch = pack_batch(docs, seq_length)  # documents back to back in rows of seq_length
    # batch.pop("packed_seq_params")  # ContextParallelAttention refuses them
    # return batch
    ### END SOLUTION


BUGS = {
    "tp_dropout_seed": tensor_parallel_dropout_seed,
    "vocab_padding": vocab_partition,
    "output_layer": build_output_layer,
    "pp_grad_sync": should_sync_grads,
    "cp_packed": cp_batch_from_documents,
}


# ================================================================== showing a bug next to its fix
# The bug each region ships with: the lines after its `### BUGGY` (tests/test_bug_hunt.py checks they agree). The
# learner's copy starts with them in place of the region, so they are kept here too, for injected().
SHIPPED = {
    "tp_dropout_seed": "return base_seed",
    "vocab_padding": "per_partition = vocab_size // tp_size  # each rank's slice\n"
                     "return per_partition * tp_size, per_partition",
    "output_layer": "return nn.Linear(config.hidden_size, vocab_size // dist.get_world_size(tp_group), bias=False)",
    "pp_grad_sync": "in_cooldown = backward_index >= num_microbatches - num_warmup\n"
                    "return in_cooldown and backward_index == num_microbatches - 1",
    "cp_packed": "batch = pack_batch(docs, seq_length)  # documents back to back in rows of seq_length\n"
                 "batch.pop(\"packed_seq_params\")  # ContextParallelAttention refuses them\n"
                 "return batch",
}


def buggy_version(name: str):
    """BUGS[name] as shipped: its signature, docstring and exercise line, then the SHIPPED body (whatever the
    function's body is now: the fix in the reference, yours in your copy)."""
    fn = BUGS[name]
    lines = textwrap.dedent(inspect.getsource(fn)).splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("# EXERCISE "))
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    source = "\n".join(lines[: at + 1]) + "\n" + textwrap.indent(SHIPPED[name], indent) + "\n"
    namespace = dict(fn.__globals__)
    exec(compile(source, inspect.getsourcefile(fn), "exec"), namespace)
    return namespace[fn.__name__]


@contextlib.contextmanager
def injected(*names: str) -> Iterator[None]:
    """Inside, the trainers call the shipped (buggy) version of the named functions (BUGS keys)."""
    module = sys.modules[__name__]
    saved = {name: getattr(module, BUGS[name].__name__) for name in names}
    try:
        for name in names:
            setattr(module, BUGS[name].__name__, buggy_version(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, BUGS[name].__name__, fn)


# ================================================================== tools
def grad_norms(model: nn.Module) -> dict[str, float]:
    """name -> the L2 norm of this rank's gradient of that parameter (per-rank gradient norms)."""
    return {name: p.grad.norm().item() for name, p in model.named_parameters() if p.grad is not None}


def load_master(model: nn.Module, master: dict[str, torch.Tensor], tp_rank: int) -> None:
    """Copy this rank's slice of every single-process parameter into `model` (the same checkpoint in every layout)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full_shard_of(master[name], p, tp_rank).to(p.device))


def mask_agreement(mask: torch.Tensor, parts: int) -> float:
    """The fraction of entries where the `parts` equal slices of a mask's last dimension agree with the first
    slice: p² + (1-p)² for independent draws with drop rate p, 1.0 when every slice repeats the first."""
    slices = mask.chunk(parts, dim=-1)
    return sum((s == slices[0]).float().mean().item() for s in slices[1:]) / (parts - 1)


# ================================================================== trainer 1: tensor parallelism (bugs 1, 2, 4)
class ToyTPModel(nn.Module):
    """A one-block language model under tensor parallelism, Megatron's layers:

        ids ─ VocabParallelEmbedding ─┬─ LayerNorm ─ fc1 (column) ─ GeLU ─ dropout (TP region) ─ fc2 (row) ─ dropout ─(+)─
                                      └──────────────────────────────────────────────────────────────────────────────┘
            ─ final LayerNorm ─ output layer (build_output_layer) ─ logits [b, s, V/t] ─ vocab_parallel_cross_entropy

    The TP-region dropout draws from tensor_parallel_dropout_seed's stream; the residual dropout from the
    default stream (the same on every TP rank, so the replicated residual stream stays replicated)."""

    def __init__(self, config: TransformerConfig, padded_vocab_size: int, tp_group, seed: int = 1234):
        super().__init__()
        self.tp_group, self.p = tp_group, config.hidden_dropout
        init, tp_rank = init_method_normal(0.02), dist.get_rank(tp_group)
        h = config.hidden_size
        self.embedding = VocabParallelEmbedding(padded_vocab_size, h, init_method=init, tp_group=tp_group)
        self.norm = nn.LayerNorm(h)
        self.fc1 = ColumnParallelLinear(h, config.ffn_hidden_size, config=config, init_method=init, tp_group=tp_group)
        self.fc2 = RowParallelLinear(config.ffn_hidden_size, h, config=config, init_method=init, tp_group=tp_group)
        self.final_norm = nn.LayerNorm(h)
        self.output_layer = build_output_layer(config, padded_vocab_size, tp_group)
        self.tp_generator = torch.Generator().manual_seed(tensor_parallel_dropout_seed(seed, tp_rank))
        self.default_generator = torch.Generator().manual_seed(seed)
        self.last_tp_mask = None  # [b, s, ffn/t] the TP region's last dropout mask (True: kept)

    def _dropout(self, x: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        keep = torch.rand(x.shape, generator=generator) >= self.p
        return x * keep.to(x.device) / (1 - self.p), keep

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # [b, s] -> per-token loss [b, s]
        h = self.embedding(ids)  # [b, s, h]
        x = F.gelu(self.fc1(self.norm(h)))  # [b, s, ffn/t]
        if self.training and self.p > 0:
            x, self.last_tp_mask = self._dropout(x, self.tp_generator)
        y = self.fc2(x)  # [b, s, h], summed over TP
        if self.training and self.p > 0:
            y, _ = self._dropout(y, self.default_generator)
        logits = self.output_layer(self.final_norm(h + y))  # [b, s, V/t]
        return vocab_parallel_cross_entropy(logits, labels, group=self.tp_group)


def toy_tp_config(hidden_dropout: float = 0.0) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, ffn_hidden_size=32, vocab_size=67,
                             seq_length=16, hidden_dropout=hidden_dropout, attention_dropout=0.0)


def toy_tokens(vocab_size: int, batch: int = 4, seq_length: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, labels [batch, seq_length]: a noisy counting language (next = this + 1 mod V, one in four random),
    so a tiny model learns something and every id, the last ones included, appears."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (batch, 1), generator=g)
    seq = (start + torch.arange(seq_length + 1)) % vocab_size
    noise = torch.rand(seq.shape, generator=g) < 0.25
    seq = torch.where(noise, torch.randint(0, vocab_size, seq.shape, generator=g), seq)
    return seq[:, :-1], seq[:, 1:]


def train_tp(tp_size: int, *, steps: int = 8, vocab_size: int = 67, hidden_dropout: float = 0.0,
             padded_vocab_size: int | None = None, master: dict | None = None, lr: float = 1e-2) -> dict:
    """Train ToyTPModel at tensor-parallel size `tp_size` (every rank calls it; initializes and destroys the
    model-parallel state). `padded_vocab_size` None: vocab_partition's. `master`: the single-process parameters
    to start from (full_shard_of slices them). Returns, on every rank: "losses" (mean per step), "grad_norms"
    and "backward_all_reduces" (step 0: per-rank norms, and the all-reduces the backward issued), "master" (the
    initial full parameters when `master` is None), "tp_mask" (the last TP-region dropout mask) and
    "padded_vocab_size"."""
    state = ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    try:
        tp_group, tp_rank = state.get_tensor_model_parallel_group(), state.get_tensor_model_parallel_rank()
        config = toy_tp_config(hidden_dropout)
        padded = padded_vocab_size or vocab_partition(vocab_size, tp_size)[0]
        torch.manual_seed(0)
        model = ToyTPModel(config, padded, tp_group).to(mdist.device())
        out = {"padded_vocab_size": padded}
        if master is None:
            out["master"] = {name: p.detach().clone() for name, p in model.named_parameters()}
        else:
            load_master(model, master, tp_rank)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        ids, labels = (t.to(mdist.device()) for t in toy_tokens(vocab_size))
        losses = []
        for step in range(steps):
            loss = model(ids, labels).mean()
            optimizer.zero_grad()
            with CollectiveTracer() as trace:
                loss.backward()
            if step == 0:
                out["grad_norms"] = grad_norms(model)
                out["backward_all_reduces"] = trace.counts()["all_reduce"]
            optimizer.step()
            losses.append(loss.item())
        out.update(losses=losses, tp_mask=model.last_tp_mask)
        return out
    finally:
        ps.destroy_model_parallel()


REPLICATED = ("norm.weight", "norm.bias", "final_norm.weight", "final_norm.bias", "fc2.bias")  # whole on every TP rank


def replicated_grad_norms_agree(norms: dict[int, dict[str, float]]) -> bool:
    """Per-rank gradient norms {tp_rank: {name: norm}}: do the TP ranks agree on every REPLICATED parameter?
    Slices may differ; copies of one parameter must get one gradient, or they drift apart."""
    first = norms[min(norms)]
    return all(math.isclose(n[name], first[name], rel_tol=1e-5, abs_tol=1e-9) for n in norms.values() for name in REPLICATED)


# ================================================================== trainer 2: pipeline × data parallelism (bug 3)
class OverlappedGradSync:
    """Data-parallel gradient sync the way DDP overlaps it with backward: a hook on every parameter all-reduces
    (and averages) its gradient over the DP group in the backward that should_sync_grads marks, as soon as that
    backward has accumulated it (torch DDP: no_sync / require_backward_grad_sync; Megatron: the schedule's
    enable_grad_sync() before the last micro-batch's backward)."""

    def __init__(self, module: nn.Module, dp_group, num_microbatches: int, num_warmup: int):
        self.dp_group, self.m, self.num_warmup = dp_group, num_microbatches, num_warmup
        self.backwards: dict[int, int] = {}  # parameter -> backwards seen this step
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p: torch.Tensor) -> None:
        index = self.backwards[id(p)] = self.backwards.get(id(p), -1) + 1
        if should_sync_grads(index, self.m, self.num_warmup):
            p.grad.div_(dist.get_world_size(self.dp_group))
            dist.all_reduce(p.grad, group=self.dp_group)

    def start_step(self) -> None:
        self.backwards.clear()


def toy_pipeline(hidden: int = 8, num_stages: int = 2) -> list[nn.Module]:
    """The single-process model, cut into stages: Linear + Tanh each, the last one a plain Linear."""
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(num_stages - 1)]
    return stages + [nn.Sequential(nn.Linear(hidden, hidden))]


def toy_regression(num_samples: int, micro_batch: int = 4, hidden: int = 8, seed: int = 0):
    """inputs, targets [num_samples, micro_batch, hidden]: y = sin(x W) for a fixed W."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, micro_batch, hidden, generator=g)
    return x, torch.sin(x @ torch.randn(hidden, hidden, generator=g))


def train_pp_dp(pp_size: int = 2, *, num_microbatches: int = 4, steps: int = 6, lr: float = 0.1) -> dict:
    """Train toy_pipeline with 1F1B over `pp_size` stages, the rest of the world as data parallelism, DP gradient
    sync by OverlappedGradSync (every rank calls it). Returns, per rank: "losses" (DP-averaged mean loss per step,
    on the last stage), "grad_norms" (step 0, this stage, after the sync), "params" (this stage's final
    parameters), and "stage", "dp_rank"."""
    state = ps.initialize_model_parallel(pipeline_model_parallel_size=pp_size)
    try:
        pp_rank, dp_rank = state.get_pipeline_model_parallel_rank(), state.get_data_parallel_rank()
        dp_group, dp_size = state.get_data_parallel_group(), state.get_data_parallel_world_size()
        dev = mdist.device()
        stage = toy_pipeline(num_stages=pp_size)[pp_rank].to(dev)
        sync = OverlappedGradSync(stage, dp_group, num_microbatches,
                                  get_num_warmup_microbatches(pp_size, pp_rank, num_microbatches))
        optimizer = torch.optim.SGD(stage.parameters(), lr=lr)
        x, y = (t.to(dev) for t in toy_regression(num_microbatches * dp_size))
        mine = slice(dp_rank * num_microbatches, (dp_rank + 1) * num_microbatches)  # this replica's micro-batches
        out = {"stage": pp_rank, "dp_rank": dp_rank, "losses": []}
        for step in range(steps):
            optimizer.zero_grad()
            sync.start_step()
            result = forward_backward_pipelining([stage], list(x[mine]), list(y[mine]), F.mse_loss, x.shape[1:],
                                                 kind="1f1b", group=state.get_pipeline_model_parallel_group())
            if step == 0:
                out["grad_norms"] = grad_norms(stage)
            if state.is_pipeline_last_stage():
                loss = torch.tensor(sum(result.losses) / num_microbatches, device=dev)
                dist.all_reduce(loss, group=dp_group)
                out["losses"].append(loss.item() / dp_size)
            optimizer.step()
        out["params"] = [p.detach().clone() for p in stage.parameters()]
        return out
    finally:
        ps.destroy_model_parallel()


def train_pp_dp_reference(pp_size: int = 2, dp_size: int = 2, *, num_microbatches: int = 4, steps: int = 6,
                          lr: float = 0.1) -> dict:
    """The same training on one process: the whole model, every micro-batch of every replica, the mean loss."""
    stages = toy_pipeline(num_stages=pp_size)
    model = nn.Sequential(*stages)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = toy_regression(num_microbatches * dp_size)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.stack([F.mse_loss(model(xi), yi) for xi, yi in zip(x, y)]).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": [[p.detach().clone() for p in s.parameters()] for s in stages]}


# ================================================================== trainer 3: context parallelism (bug 5)
def toy_cp_config() -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                             hidden_dropout=0.0, attention_dropout=0.0)


def toy_documents(num_docs: int = 6, vocab_size: int = 64, seed: int = 1) -> list[torch.Tensor]:
    """Documents of 5 .. 12 tokens (inputs + the last label), each a counting run from its own start."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 13, (num_docs,), generator=g).tolist()
    starts = torch.randint(0, vocab_size, (num_docs,), generator=g).tolist()
    return [(s + torch.arange(n)) % vocab_size for s, n in zip(starts, lengths)]


def document_losses(model: GPTModel, docs: list[torch.Tensor]) -> torch.Tensor:
    """The definition: every document on its own, one process: the sum of its per-token losses, [num_docs]."""
    return torch.stack([model(d[None, :-1], labels=d[None, 1:]).sum() for d in docs])


def train_cp(cp_size: int, *, steps: int = 6, lr: float = 3e-3) -> dict:
    """Train the GPTModel with ring attention over `cp_size` ranks on toy_documents laid out by
    cp_batch_from_documents (every rank calls it), and the same model on one process, each document alone.
    Returns "losses" and "reference_losses": the mean loss per real token, per step."""
    state = ps.initialize_model_parallel(context_parallel_size=cp_size)
    try:
        cp_rank = state.get_context_parallel_rank()
        dev = mdist.device()
        config, docs = toy_cp_config(), [d.to(dev) for d in toy_documents()]
        torch.manual_seed(0)
        reference = GPTModel(config).to(dev)
        torch.manual_seed(0)
        model = GPTModel(config, context_parallel_layer_spec(cp_group=state.get_context_parallel_group())).to(dev)
        batch = cp_batch_from_documents(docs, config.seq_length)
        tokens = sum(d.numel() - 1 for d in docs)  # real labels of the whole batch
        local = get_batch_on_this_cp_rank(batch, cp_size, cp_rank)
        opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=lr) for m in (model, reference))
        out = {"losses": [], "reference_losses": []}
        for _ in range(steps):
            loss = model(local["tokens"], local["position_ids"], local["labels"])  # [b, s/cp]
            loss_sum = (loss * local["loss_mask"]).sum()
            opt.zero_grad()
            (loss_sum / tokens * cp_size).backward()  # finalize_model_grads averages over dp x cp
            finalize_model_grads([model], state)
            opt.step()
            total = loss_sum.detach().clone()
            dist.all_reduce(total, group=state.get_context_parallel_group())
            out["losses"].append(total.item() / tokens)
            ref_loss = document_losses(reference, docs).sum() / tokens
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            out["reference_losses"].append(ref_loss.item())
        out["rows"] = batch["tokens"].shape[0]
        return out
    finally:
        ps.destroy_model_parallel()


def same_curve(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    """Two loss curves equal within `tol` at every step."""
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))

