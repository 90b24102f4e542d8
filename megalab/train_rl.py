"""The RL systems loop on one process: rollouts from the engine, the train/serve check, GRPO, refit.

    for each step:
      1. rollouts     P prompts x G samples from the InferenceEngine (temperature sampling, log-probs returned)
      2. rewards      the agent grades each response (ArithmeticAgent: a + b of two digits, answered in 1-2
                      digit tokens and an end-of-answer token: ragged responses, 1 to 3 tokens)
      3. check        the trainer recomputes the sampled tokens' log-probs: they must equal the engine's
                      (logprob_check.TOLERANCE) or the step stops with a TrainServeMismatch naming the cause
      4. GRPO         group-relative advantages; num_updates optimizer steps on the clipped objective,
                      the loss normalised per token as Megatron's (rl_utils.py)
      5. refit        the trainer's weights into the engine (engine.update_weights; across layouts and
                      ranks: megalab.core.resharding.swap_model_weights)

The policy is the course's tiny GPT (megalab/extras/tiny_gpt.py: 2 layers, hidden 64, 4 heads) with the task's
16-token vocabulary, trained from scratch by RL alone. Megatron: train_rl.py and megatron/rl/rl_utils.py
(collect rollouts, compute_logprobs_batch, calculate_grpo_advantages, calculate_grpo_loss, the refit through
megatron/core/resharding/).

    python -m megalab.train_rl --steps 24      # ~0.2-0.4 s a step on one core: mean reward (first 6 -> last 6
                                               # steps) 0.12/0.11/0.14 -> 0.40/0.42/0.43 for seeds 0/1/2

On several ranks (megalab/rl/parallel.py): the trainer at tp·pp, engine replicas at --engine-tp, a refit through
the resharding plan after every step, checked bit-equal:

    torchrun --nproc-per-node 4 -m megalab.train_rl --tp 2 --pp 2 --engine-tp 1   # refit ~1.2 MB, ~20-60 ms
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import time

import torch

from megalab.core.inference import InferenceEngine, PagedKVCache
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.rl.agent.arithmetic_agent import PROMPT_LENGTH, ArithmeticAgent
from megalab.rl.logprob_check import TrainServeMismatch, compare_logprobs, diagnose
from megalab.rl.rl_utils import calculate_grpo_advantages, calculate_grpo_loss, compute_logprobs, reduce_loss
from megalab.rl.rollouts import (  # noqa: F401 (part of train_rl's API)
    GRPOConfig,
    Rollouts,
    assemble_rollouts,
    policy_config,
    rollout_sampling_params,
)


def build_policy(seed: int = 0) -> GPTModel:
    """The tiny GPT's architecture over the task's vocabulary."""
    torch.manual_seed(seed)
    return GPTModel(policy_config())


def build_engine(model: GPTModel, config: GRPOConfig) -> InferenceEngine:
    """An engine with its own copy of the weights (refit keeps it in step), room for one step's rollouts."""
    n = config.num_prompts * config.group_size
    length = PROMPT_LENGTH + config.num_tokens_to_generate
    cache = PagedKVCache(model.config, num_blocks=n * -(-length // 4), block_size=4)
    return InferenceEngine(copy.deepcopy(model).eval(), cache, max_batch_size=n, max_tokens=n * length)


def collect_rollouts(engine: InferenceEngine, agent: ArithmeticAgent, rng: random.Random, config: GRPOConfig,
                     step: int) -> Rollouts:
    """P prompts x G samples; a response ends at END_OF_ANSWER (included, it is a sampled token) or at
    num_tokens_to_generate tokens. Ragged rows are padded; the loss mask keeps exactly the response tokens."""
    prompts = [agent.get_prompt(rng) for _ in range(config.num_prompts)]
    params = [rollout_sampling_params(config, step, i) for i in range(config.num_prompts * config.group_size)]
    try:
        requests = engine.generate([p.tokens for p in prompts for _ in range(config.group_size)], params)
    except Exception:  # a refused request (too long, out of KV memory): leave no request half-admitted
        engine.abort_all()
        raise
    failed = [r for r in requests if r.finish_reason not in ("stop", "length")]
    if failed:
        raise RuntimeError(f"step {step}: {len(failed)} rollouts failed in the engine (first: {failed[0].error}): "
                           f"no weight was updated")
    rewards = [[agent.get_reward(p, requests[i * config.group_size + j].generated_tokens)
                for j in range(config.group_size)] for i, p in enumerate(prompts)]
    return assemble_rollouts([p.tokens for p in prompts for _ in range(config.group_size)],
                             [r.generated_tokens for r in requests], [r.generated_log_probs for r in requests],
                             rewards)


def grpo_step(model, optimizer, engine, agent, rng, config: GRPOConfig, step: int, refit: bool = True) -> dict:
    """One step of the loop; returns its measurements."""
    start = time.perf_counter()
    batch = collect_rollouts(engine, agent, rng, config, step)
    model.eval()
    with torch.no_grad():
        old_logprobs = compute_logprobs(model, batch.tokens)  # [b, s - 1]
    comparison = compare_logprobs(old_logprobs[batch.loss_mask.bool()], batch.engine_logprobs, config.tolerance)
    if not comparison.ok:
        causes = diagnose(model, engine, batch.tokens, batch.loss_mask, old_logprobs[batch.loss_mask.bool()],
                          batch.engine_logprobs, config.temperature, trainer_version=step)
        raise TrainServeMismatch(f"step {step}: trainer and engine log-probs differ by up to "
                                 f"{comparison.max_abs_diff:.3g} (tolerance {config.tolerance:g}); causes: "
                                 + ("; ".join(f"{c} ({r}): {e}" for c, r, e in causes) or "none identified"))
    advantages = calculate_grpo_advantages(batch.rewards).flatten()  # [P * G]
    model.train()
    for _ in range(config.num_updates):
        current = compute_logprobs(model, batch.tokens)
        per_token, _, _ = calculate_grpo_loss(current, old_logprobs, advantages, config.clamp_eps, config.clamp_eps,
                                              config.kl_beta)
        loss = reduce_loss(per_token, batch.loss_mask, config.normalization)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    if refit:
        engine.update_weights(model.state_dict())
    return dict(step=step, reward=float(batch.rewards.mean()), accuracy=float((batch.rewards == 1).float().mean()),
                response_length=float(batch.response_lengths.float().mean()), loss=float(loss.detach()),
                max_logprob_diff=comparison.max_abs_diff, seconds=time.perf_counter() - start)


def train_rl(steps: int, config: GRPOConfig | None = None, log=None) -> list[dict]:
    """Run the loop from a fresh policy; one dict of measurements per step."""
    config = config or GRPOConfig()
    model = build_policy(config.seed)
    engine = build_engine(model, config)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    agent, rng = ArithmeticAgent(), random.Random(config.seed)
    history = []
    for step in range(steps):
        history.append(grpo_step(model, optimizer, engine, agent, rng, config, step))
        if log:
            log(history[-1])
    return history


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megalab.train_rl", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--tp", type=int, default=1, help="the trainer's tensor parallel size")
    parser.add_argument("--pp", type=int, default=1, help="the trainer's pipeline parallel size")
    parser.add_argument("--engine-tp", type=int, default=1, help="the engine's tensor parallel size")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.tp * args.pp > 1 or "WORLD_SIZE" in os.environ:  # under torchrun: megalab/rl/parallel.py
        from megalab.rl.parallel import run
        history = run(args.steps, args.tp, args.pp, args.engine_tp, verbose=True)
        if torch.distributed.get_rank() != 0:
            return
    else:
        history = train_rl(args.steps, log=lambda h: print(
            f"step {h['step']:3d}  reward {h['reward']:.3f}  exact {h['accuracy']:.3f}  "
            f"length {h['response_length']:.2f}  loss {h['loss']:+.4f}  "
            f"max |logp diff| {h['max_logprob_diff']:.1e}  {h['seconds']:.2f} s", flush=True))
    first, last = history[: len(history) // 4 or 1], history[-(len(history) // 4 or 1):]
    print(f"mean reward: first quarter {sum(h['reward'] for h in first) / len(first):.3f}, "
          f"last quarter {sum(h['reward'] for h in last) / len(last):.3f}")


if __name__ == "__main__":
    main()
