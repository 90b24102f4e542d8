"""The RL loop on tp·pp ranks: the trainer laid out for training, the engine for serving, a refit between them.

    every rank holds   a trainer chunk (TP slice of one pipeline stage) and an engine (TP slice of a whole model)
    trainer ranks      rank = pp_rank · tp + tp_rank (Megatron's order: TP fastest); no data parallelism
    engine replicas    world / engine_tp of them, each on engine_tp consecutive ranks

    step 0             refit: the trainer's initial weights into every engine (weights_version 1)
    for each step:
      1. rollouts      replica r generates rollouts i with i % replicas == r (each with its own seed), rewards
                       them; all_gather_object gives every rank the whole batch. A rank whose engine is not
                       at the expected weights_version (a refit failed, skipped) refuses, and every rank stops
      2. check         the trainer's log-probs (a forward-only pass through the stages, the last stage's
                       vocab-parallel log-softmax broadcast over the pipeline) against the engine's; on a
                       mismatch each replica's first rank runs logprob_check.diagnose on whole-model copies
                       (the trainer's weights and its replica's, gathered) and every rank raises naming the causes
      3. GRPO          num_updates steps of forward_backward_pipelining (chapter 03's 1F1B, micro-batches)
                       on the clipped loss, normalised per token over the whole batch; the tied word
                       embeddings' gradient summed between the first and last stage; Adam on each rank
      4. refit         swap_model_weights (plan built once, reused); then every engine parameter is checked
                       bit-equal to the trainer's, gathered: the bytes and the time of the refit recorded

    torchrun --nproc-per-node 4 -m megalab.train_rl --tp 2 --pp 2 --engine-tp 1

Megatron: train_rl.py with megatron/rl/rl_utils.py (the rollouts gathered over the data-parallel ranks,
compute_logprobs_batch through the pipeline's forward_backward_func with forward_only=True) and
megatron/core/resharding/ (swap_model_weights after each optimizer step).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalab.core.distributed.finalize_model_grads import allreduce_word_embedding_grads
from megalab.core.inference import InferenceEngine, PagedKVCache
from megalab.core.models.gpt.gpt_layer_specs import tensor_parallel_layer_spec
from megalab.core.models.gpt.gpt_model import GPTModel, build_gpt_stages
from megalab.core.pipeline_parallel import p2p_communication
from megalab.core.pipeline_parallel.schedules import forward_backward_pipelining
from megalab.core.resharding import swap_model_weights
from megalab.core.resharding.utils import named_resolved_params
from megalab.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalab.core.tensor_parallel.layers import full_shard_of
from megalab.rl.agent.arithmetic_agent import PROMPT_LENGTH, ArithmeticAgent
from megalab.rl.logprob_check import TrainServeMismatch, compare_logprobs, diagnose
from megalab.rl.rl_utils import calculate_grpo_advantages, calculate_grpo_loss
from megalab.rl.rollouts import GRPOConfig, Rollouts, assemble_rollouts, policy_config, rollout_sampling_params


class StaleWeightsError(RuntimeError):
    """An engine is not at the weights version the trainer expects (a refit failed or was skipped)."""


@dataclass
class RLLayout:
    """One rank's place in the trainer's tp·pp layout and in the engine's (engine_tp, replicas)."""
    tp: int
    pp: int
    engine_tp: int
    rank: int
    tp_rank: int
    pp_rank: int
    pp_ranks: list[int]  # the global ranks of this rank's pipeline, stage order
    tp_group: object
    pp_group: object
    embedding_group: object  # first and last stage of this pipeline (tied word embeddings); None if pp == 1
    engine_group: object  # None if engine_tp == 1
    engine_tp_rank: int
    engine_replica: int
    num_engine_replicas: int


def build_layout(tp: int, pp: int, engine_tp: int) -> RLLayout:
    """Collective: every group of both layouts (every rank creates every group, in the same order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp * pp != world:
        raise ValueError(f"the trainer's layout tp{tp}·pp{pp} needs {tp * pp} ranks, the world has {world}: launch "
                         f"{tp * pp} ranks (torchrun --nproc-per-node {tp * pp}) or change --tp/--pp")
    if engine_tp < 1 or world % engine_tp:
        raise ValueError(f"--engine-tp {engine_tp} does not divide the world of {world} ranks")
    tp_groups = [dist.new_group(list(range(p * tp, (p + 1) * tp))) for p in range(pp)]
    pp_ranks = [list(range(t, world, tp)) for t in range(tp)]
    pp_groups = [dist.new_group(r) for r in pp_ranks]
    emb_groups = [dist.new_group([r[0], r[-1]]) for r in pp_ranks] if pp > 1 else None
    engine_groups = ([dist.new_group(list(range(e * engine_tp, (e + 1) * engine_tp)))
                      for e in range(world // engine_tp)] if engine_tp > 1 else None)
    tp_rank, pp_rank = rank % tp, rank // tp
    return RLLayout(tp, pp, engine_tp, rank, tp_rank, pp_rank, pp_ranks[tp_rank],
                    tp_groups[pp_rank] if tp > 1 else None, pp_groups[tp_rank],
                    emb_groups[tp_rank] if emb_groups else None,
                    engine_groups[rank // engine_tp] if engine_groups else None,
                    rank % engine_tp, rank // engine_tp, world // engine_tp)


def build_trainer(layout: RLLayout, seed: int = 0, model_config=None) -> GPTModel:
    """This rank's pipeline stage of the TP model (every rank draws the same full model, keeps its slices).
    model_config: the policy's (train_rl.policy_config) unless given."""
    torch.manual_seed(seed)
    spec = tensor_parallel_layer_spec(layout.tp_group) if layout.tp_group is not None else None
    whole = GPTModel(model_config or policy_config(), spec)
    (chunk,) = build_gpt_stages(whole, layout.pp, layout.pp_rank)
    return chunk


def build_engine_replica(layout: RLLayout, config: GRPOConfig, model_config=None) -> InferenceEngine:
    """This rank's slice of an engine replica, room for its share of one step's rollouts. Its weights are
    random (another seed) until the first refit."""
    torch.manual_seed(10_000 + layout.engine_replica)
    model_config = model_config or policy_config()
    spec = tensor_parallel_layer_spec(layout.engine_group) if layout.engine_group is not None else None
    n = -(-config.num_prompts * config.group_size // layout.num_engine_replicas)
    length = PROMPT_LENGTH + config.num_tokens_to_generate
    cache = PagedKVCache(model_config, num_blocks=n * -(-length // 4), block_size=4, tp_size=layout.engine_tp)
    return InferenceEngine(GPTModel(model_config, spec).eval(), cache, max_batch_size=n, max_tokens=n * length)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, tp_group) -> torch.Tensor:
    """logits [b, s, V] (V/t under TP) -> log p(labels) [b, s], in fp32 from the raw logits."""
    if tp_group is None:
        return F.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    return -vocab_parallel_cross_entropy(logits.float(), labels, group=tp_group)


def _all_agree(error: str | None, what: str) -> None:
    """Every rank learns every rank's error; if any, every rank raises (none is left waiting)."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if any(errors):
        raise RuntimeError(f"{what}: " + "; ".join(e for e in errors if e))


def collect_rollouts_parallel(engine: InferenceEngine, agent: ArithmeticAgent, rng: random.Random,
                              config: GRPOConfig, step: int, layout: RLLayout, expected_version: int) -> Rollouts:
    """The whole step's rollouts on every rank, each generated by one engine replica (see the module doc)."""
    prompts = [agent.get_prompt(rng) for _ in range(config.num_prompts)]  # the same on every rank
    n, g = config.num_prompts * config.group_size, config.group_size
    mine = [i for i in range(n) if i % layout.num_engine_replicas == layout.engine_replica]
    results, error = [], None
    try:
        if engine.weights_version != expected_version:
            raise StaleWeightsError(
                f"the engine is at weights_version {engine.weights_version}, the trainer expects {expected_version} "
                f"(a refit failed or was skipped): refusing to roll out on stale weights")
        requests = engine.generate([prompts[i // g].tokens for i in mine],
                                   [rollout_sampling_params(config, step, i) for i in mine])
        failed = [r for r in requests if r.finish_reason not in ("stop", "length")]
        if failed:
            raise RuntimeError(f"{len(failed)} rollouts failed in the engine (first: {failed[0].error})")
        for i, r in zip(mine, requests):
            results.append((i, r.generated_tokens, r.generated_log_probs,
                            agent.get_reward(prompts[i // g], r.generated_tokens)))
    except Exception as exc:
        engine.abort_all()
        error = f"rank {layout.rank}: {type(exc).__name__}: {exc}"
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (results if layout.engine_tp_rank == 0 else [], error))
    errors = [e for _, e in gathered if e]
    if errors:
        raise RuntimeError(f"step {step}: rollouts stopped, no weight was updated: " + "; ".join(errors))
    rows = sorted(row for rs, _ in gathered for row in rs)
    assert [row[0] for row in rows] == list(range(n)), "every rollout generated exactly once"
    rewards = [[rows[p * g + j][3] for j in range(g)] for p in range(config.num_prompts)]
    return assemble_rollouts([prompts[i // g].tokens for i in range(n)], [r[1] for r in rows],
                             [r[2] for r in rows], rewards)


@torch.no_grad()
def pipeline_logprobs(chunk: GPTModel, tokens: torch.Tensor, layout: RLLayout) -> torch.Tensor:
    """tokens [b, s] -> the trainer's log p(tokens[:, t + 1] | ...) [b, s - 1] on every rank of the pipeline:
    a forward-only pass through the stages (hidden states [s - 1, b, h] sent on), the last stage's log-probs
    broadcast back."""
    chunk.eval()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    b, s = inputs.shape
    p2p = dict(group=layout.pp_group, device=tokens.device)
    x = inputs if layout.pp_rank == 0 else p2p_communication.recv_forward((s, b, chunk.config.hidden_size), **p2p)
    out = chunk(x)
    if layout.pp_rank < layout.pp - 1:
        p2p_communication.send_forward(out.contiguous(), **p2p)
        logprobs = torch.empty(b, s, device=tokens.device)
    else:
        logprobs = token_logprobs(out, labels, layout.tp_group)
    if layout.pp > 1:
        dist.broadcast(logprobs, layout.pp_ranks[-1], group=layout.pp_group)
    return logprobs


def train_on_rollouts(chunk: GPTModel, optimizer, batch: Rollouts, old_logprobs: torch.Tensor,
                      advantages: torch.Tensor, layout: RLLayout, config: GRPOConfig,
                      num_microbatches: int = 2) -> float:
    """config.num_updates optimizer steps on the GRPO loss through the pipeline; returns the last step's loss.

    Each micro-batch's loss is its masked token SUM over the batch's token count, times m (the schedule
    divides by m): the batch's per-token mean, as Megatron's --calculate-per-token-loss."""
    if config.normalization not in ("token", "sequence"):
        raise ValueError(f"normalization must be 'token' or 'sequence', got {config.normalization!r}")
    m = num_microbatches
    inputs, labels = batch.tokens[:, :-1], batch.tokens[:, 1:]
    num_tokens, num_rows = batch.loss_mask.sum(), batch.loss_mask.shape[0]
    split = lambda t: list(t.chunk(m))  # noqa: E731  micro-batches of rows
    targets = list(zip(split(labels), split(batch.loss_mask), split(old_logprobs), split(advantages)))

    def loss_func(output, target):
        labels, mask, old, adv = target
        per_token, _, _ = calculate_grpo_loss(token_logprobs(output, labels, layout.tp_group), old, adv,
                                              config.clamp_eps, config.clamp_eps, config.kl_beta)
        if config.normalization == "token":
            return (per_token * mask).sum() / num_tokens * m
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_rows * m

    chunk.train()
    dev = next(chunk.parameters()).device
    loss = torch.zeros((), dtype=torch.float64, device=dev)
    for _ in range(config.num_updates):
        optimizer.zero_grad()
        microbatches = split(inputs)
        result = forward_backward_pipelining(
            [chunk], microbatches, targets, loss_func,
            tensor_shape=(inputs.shape[1], microbatches[0].shape[0], chunk.config.hidden_size),
            kind="1f1b" if layout.pp > 1 else "none", group=layout.pp_group)
        if layout.embedding_group is not None and chunk.config.share_embeddings_and_output_weights:
            allreduce_word_embedding_grads(chunk, layout.embedding_group)
        optimizer.step()
        loss = torch.tensor(sum(result.losses) / m if layout.pp_rank == layout.pp - 1 else 0.0, dtype=torch.float64,
                            device=dev)
    if layout.pp > 1:
        dist.broadcast(loss, layout.pp_ranks[-1], group=layout.pp_group)
    chunk.eval()
    return float(loss)


def unshard(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The full tensor from its TP shards (TP order); with stride k each shard holds its slice of k parts."""
    parts = [s.chunk(stride, dim) for s in shards]
    return torch.cat([torch.cat([p[k] for p in parts], dim) for k in range(stride)], dim)


def gather_trainer_weights(chunk: GPTModel, layout: RLLayout) -> dict[str, torch.Tensor]:
    """Collective: the trainer's full weights (resolved name -> tensor), from every rank's shards."""
    mine = {resolved: (p.detach().clone(), bool(getattr(p, "tensor_model_parallel", False)) and layout.tp > 1,
                       getattr(p, "partition_dim", 0), getattr(p, "partition_stride", 1))
            for resolved, _, p in named_resolved_params(chunk)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (layout.tp_rank, mine))
    shards: dict[str, dict[int, tuple]] = {}
    for tp_rank, params in everyone:
        for name, entry in params.items():
            shards.setdefault(name, {})[tp_rank] = entry
    full = {}
    for name, by_rank in shards.items():
        tensor, is_tp, dim, stride = by_rank[0]
        full[name] = unshard([by_rank[r][0] for r in sorted(by_rank)], dim, stride) if is_tp else tensor
    return full


def engine_matches_trainer(engine: InferenceEngine, full: dict[str, torch.Tensor], layout: RLLayout) -> list[str]:
    """The engine parameters on this rank that are NOT bit-equal to the trainer's slice ([] if all are)."""
    return [n for n, p in engine.model.named_parameters()
            if not torch.equal(p, full_shard_of(full[n], p, layout.engine_tp_rank, getattr(p, "partition_stride", 1)))]


def refit(chunk, engine, layout: RLLayout, plan=None):
    """swap_model_weights, then the check: every engine weight bit-equal to the trainer's (gathered).
    Returns (bytes over the wire summed over ranks, the slowest rank's seconds, the plan)."""
    stats, plan = swap_model_weights(chunk, engine, src_tp_group=layout.tp_group, dst_tp_group=layout.engine_group,
                                     plan=plan)
    moved = torch.tensor([float(stats.bytes_sent), stats.seconds], dtype=torch.float64, device=next(chunk.parameters()).device)
    totals = moved.clone()
    dist.all_reduce(totals[:1])
    dist.all_reduce(totals[1:], op=dist.ReduceOp.MAX)
    wrong = engine_matches_trainer(engine, gather_trainer_weights(chunk, layout), layout)
    _all_agree(f"rank {layout.rank}: {wrong[:3]}" if wrong else None,
               "after the refit the engine's weights are not the trainer's")
    return int(totals[0]), float(totals[1]), plan


def gather_engine_weights(engine: InferenceEngine, layout: RLLayout) -> dict[str, torch.Tensor]:
    """Collective over the engine group: this rank's engine replica's full weights (name -> tensor)."""
    mine = {n: (p.detach().clone(), bool(getattr(p, "tensor_model_parallel", False)) and layout.engine_tp > 1,
                getattr(p, "partition_dim", 0), getattr(p, "partition_stride", 1))
            for n, p in engine.model.named_parameters()}
    if layout.engine_group is None:
        return {n: tensor for n, (tensor, *_) in mine.items()}
    everyone = [None] * layout.engine_tp
    dist.all_gather_object(everyone, mine, group=layout.engine_group)  # engine-TP order
    return {n: unshard([shards[n][0] for shards in everyone], dim, stride) if is_tp else tensor
            for n, (tensor, is_tp, dim, stride) in mine.items()}


def _whole_model(weights: dict[str, torch.Tensor], model_config) -> GPTModel:
    """A one-process GPTModel holding `weights` (their dtypes kept), for diagnose."""
    with torch.random.fork_rng(devices=[]):  # building draws random weights: leave the loop's RNG alone
        model = GPTModel(model_config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.data = weights[n].clone()
    return model.to(next(iter(weights.values())).device)


class _EngineView:
    """What diagnose reads of an engine: its (whole) model and its refit count."""

    def __init__(self, model: GPTModel, weights_version: int):
        self.model, self.weights_version = model, weights_version


def diagnose_parallel(chunk: GPTModel, engine: InferenceEngine, batch: Rollouts, trainer_logprobs: torch.Tensor,
                      temperature: float, trainer_version: int, layout: RLLayout, model_config=None) -> list[str]:
    """Collective: logprob_check.diagnose for every engine replica, the same list of causes on every rank
    ("replica r: cause (report): evidence"). Each replica's first rank tests the trainer's weights (gathered)
    against its replica's (gathered) on the rollouts that replica generated.
    trainer_logprobs: flat [n] over batch.loss_mask, as batch.engine_logprobs."""
    trainer_full = gather_trainer_weights(chunk, layout)
    engine_full = gather_engine_weights(engine, layout)
    causes = []
    if layout.engine_tp_rank == 0:
        config = model_config or policy_config()
        mask = batch.loss_mask.bool()  # [b, s - 1]
        rows = torch.arange(mask.shape[0], device=mask.device) % layout.num_engine_replicas == layout.engine_replica
        flat = rows[:, None].expand_as(mask)[mask]  # [n]: is this response token from this replica's rollouts
        found = diagnose(_whole_model(trainer_full, config),
                         _EngineView(_whole_model(engine_full, config), engine.weights_version),
                         batch.tokens[rows], batch.loss_mask[rows], trainer_logprobs[flat],
                         batch.engine_logprobs[flat], temperature, trainer_version)
        causes = [f"replica {layout.engine_replica}: {c} ({r}): {e}" for c, r, e in found]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, causes)
    return [c for rank_causes in everyone for c in rank_causes]


def train_rl_parallel(steps: int, config: GRPOConfig | None = None, tp: int = 2, pp: int = 2, engine_tp: int = 1,
                      log=None) -> list[dict]:
    """Collective (every rank of a world of tp·pp ranks): the loop from a fresh policy; one dict per step
    (the same on every rank)."""
    config = config or GRPOConfig()
    layout = build_layout(tp, pp, engine_tp)
    chunk = build_trainer(layout, config.seed)
    engine = build_engine_replica(layout, config)
    optimizer = torch.optim.Adam(chunk.parameters(), lr=config.lr)
    agent, rng = ArithmeticAgent(), random.Random(config.seed)
    refit_bytes, refit_seconds, plan = refit(chunk, engine, layout)  # the initial weights: version 1
    version, history = 1, []
    for step in range(steps):
        start = time.perf_counter()
        batch = collect_rollouts_parallel(engine, agent, rng, config, step, layout, version)
        old_logprobs = pipeline_logprobs(chunk, batch.tokens, layout)  # [b, s - 1]
        comparison = compare_logprobs(old_logprobs[batch.loss_mask.bool()], batch.engine_logprobs, config.tolerance)
        if not comparison.ok:
            causes = diagnose_parallel(chunk, engine, batch, old_logprobs[batch.loss_mask.bool()],
                                       config.temperature, version, layout)
            raise TrainServeMismatch(f"step {step}: trainer (tp{tp}·pp{pp}) and engine (tp{engine_tp}) log-probs "
                                     f"differ by up to {comparison.max_abs_diff:.3g} (tolerance {config.tolerance:g}); "
                                     "causes: " + ("; ".join(causes) or "none identified"))
        advantages = calculate_grpo_advantages(batch.rewards).flatten()
        loss = train_on_rollouts(chunk, optimizer, batch, old_logprobs, advantages, layout, config)
        refit_bytes, refit_seconds, plan = refit(chunk, engine, layout, plan)
        version += 1
        history.append(dict(step=step, reward=float(batch.rewards.mean()),
                            accuracy=float((batch.rewards == 1).float().mean()),
                            response_length=float(batch.response_lengths.float().mean()), loss=loss,
                            max_logprob_diff=comparison.max_abs_diff, refit_bytes=refit_bytes,
                            refit_seconds=refit_seconds, weights_version=engine.weights_version, bit_equal=True,
                            seconds=time.perf_counter() - start))
        if log:
            log(history[-1])
    return history


def run(steps: int, tp: int, pp: int, engine_tp: int, config: GRPOConfig | None = None, verbose: bool = False):
    """For launch.run_function and the command line: this rank's history (gloo on CPU)."""
    from megalab.lab import dist as mdist

    mdist.init("gloo")
    torch.set_num_threads(1)
    log = None
    if verbose and dist.get_rank() == 0:
        log = lambda h: print(  # noqa: E731
            f"step {h['step']:3d}  reward {h['reward']:.3f}  exact {h['accuracy']:.3f}  loss {h['loss']:+.4f}  "
            f"max |logp diff| {h['max_logprob_diff']:.1e}  refit {h['refit_bytes'] / 1e3:.1f} kB "
            f"{h['refit_seconds'] * 1e3:.1f} ms (bit-equal)  {h['seconds']:.2f} s", flush=True)
    return train_rl_parallel(steps, config, tp, pp, engine_tp, log)
