"""The RL loop on tp·pp ranks (megalab/rl/parallel.py): the trainer at tp2·pp2, the engine at tp1 / tp2, refit after
every GRPO step bit-equal; and the bad input the loop must stop on (threaded worlds, tests/threaded_world.py; one
real torchrun launch of the entry point, marked integration)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from megalab.core.inference import InferenceEngine, PagedKVCache
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.resharding import ReshardError, ReshardPlan, swap_model_weights
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.lab import launch
from megalab.rl import parallel
from megalab.rl.agent.arithmetic_agent import ArithmeticAgent
from megalab.rl.logprob_check import TrainServeMismatch, compare_logprobs
from megalab.rl.rl_utils import compute_logprobs
from megalab.train_rl import GRPOConfig, build_engine, build_policy, collect_rollouts, train_rl
from tests import threaded_world

SMALL = dict(num_prompts=8, group_size=4)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("engine_tp,normalization", [(1, "token"), (2, "sequence")])
def test_tp2pp2_loop_refits_bit_equal_and_matches_one_process(engine_tp, normalization):
    config = GRPOConfig(**SMALL, normalization=normalization)
    histories = threaded_world.run(4, lambda rank, group: parallel.train_rl_parallel(2, config, 2, 2, engine_tp))
    single = train_rl(1, GRPOConfig(**SMALL, normalization=normalization))
    strip = lambda history: [{k: v for k, v in h.items() if k != "seconds"} for h in history]  # noqa: E731
    assert all(strip(h) == strip(histories[0]) for h in histories.values()), "the ranks disagree about the steps"
    history = histories[0]
    assert [h["weights_version"] for h in history] == [2, 3]  # the initial refit, then one per step
    assert all(h["bit_equal"] and h["max_logprob_diff"] < 1e-4 for h in history)
    # the first rollouts come from the same initial weights, sampled with the same seeds: the same batch
    assert history[0]["reward"] == single[0]["reward"]
    assert history[0]["loss"] == pytest.approx(single[0]["loss"], abs=1e-5), "the pipeline's GRPO loss"
    model_bytes = sum(p.numel() * 4 for p in build_policy(0).parameters())
    # every engine rank receives its slice of the whole model, less what its own trainer stage already holds:
    # tp1: 4 whole copies less the trainer's 4 shards (the replicated norms and biases held twice) ~ 3 models
    low, high = (2 * model_bytes, 3 * model_bytes) if engine_tp == 1 else (model_bytes // 2, 2 * model_bytes)
    assert low < history[0]["refit_bytes"] < high


def _failed_refit_body(engine_tp: int):
    def body(rank, group):
        config = GRPOConfig(**SMALL)
        layout = parallel.build_layout(2, 2, engine_tp)
        chunk, engine = parallel.build_trainer(layout), parallel.build_engine_replica(layout, config)
        _, _, plan = parallel.refit(chunk, engine, layout)  # version 1
        with torch.no_grad():
            for p in chunk.parameters():  # the trainer moves on ...
                p.add_(0.01)
        before = {n: p.clone() for n, p in engine.model.named_parameters()}
        if rank == 1:  # ... and rank 1's plan lost a receive: its refit fails after the others' succeeded
            plan = ReshardPlan(plan.send_ops, plan.recv_ops[:-1], plan.rank)
        with pytest.raises(ReshardError, match="refit failed, no weight changed: rank 1: .*the plan fills"):
            swap_model_weights(chunk, engine, src_tp_group=layout.tp_group, dst_tp_group=layout.engine_group, plan=plan)
        unchanged = all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
        with pytest.raises(RuntimeError, match=f"rank {rank}: StaleWeightsError: the engine is at weights_version 1, "
                                               "the trainer expects 2 .*refusing to roll out on stale weights"):
            parallel.collect_rollouts_parallel(engine, ArithmeticAgent(), random.Random(0), config, 1, layout, 2)
        return unchanged, engine.weights_version

    return body


@pytest.mark.parametrize("engine_tp", [1, 2])
def test_refit_failing_on_one_rank_installs_nowhere_and_the_next_rollout_refuses(engine_tp):
    assert threaded_world.run(4, _failed_refit_body(engine_tp)) == {r: (True, 1) for r in range(4)}


def test_refit_between_incompatible_models_is_refused_before_any_weight_changes():
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, vocab_size=32, seq_length=8)

    def body(rank, group, **engine_changes):
        torch.manual_seed(0)
        trainer = GPTModel(TransformerConfig(**base)) if rank == 0 else None
        engine = None
        if rank == 1:
            config = TransformerConfig(**{**base, **engine_changes})
            engine = InferenceEngine(GPTModel(config), PagedKVCache(config, 4, 4))
            before = {n: p.clone() for n, p in engine.model.named_parameters()}
        try:
            swap_model_weights(trainer, engine)
        except ReshardError as exc:
            error = str(exc)
        if rank == 1:
            return error, engine.weights_version, all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())

    error, version, unchanged = threaded_world.run(2, lambda r, g: body(r, g, vocab_size=48))[1]
    assert "vocab_size 32 (trainer) vs 48 (engine): padded vocabularies differ" in error and (version, unchanged) == (0, True)
    error, version, unchanged = threaded_world.run(2, lambda r, g: body(r, g, num_attention_heads=2))[1]
    assert "num_attention_heads 4 (trainer) vs 2 (engine): attention heads differ" in error and (version, unchanged) == (0, True)


def test_engine_out_of_kv_memory_and_prompt_longer_than_the_context():
    """A request that can never fit is refused with the cause; a pool too small for the batch only pauses."""
    config = GRPOConfig(num_prompts=2, group_size=2)
    model = build_policy(0)
    engine = InferenceEngine(model, PagedKVCache(model.config, num_blocks=2, block_size=2))  # 4 tokens of K/V
    with pytest.raises(ValueError, match="a request of 7 tokens can never fit in the KV cache .out of KV memory even "
                                         "alone: 2 blocks of 2 tokens.: make the cache larger"):
        collect_rollouts(engine, ArithmeticAgent(), random.Random(0), config, 0)
    assert not engine.has_unfinished_requests()  # nothing left half-admitted: the next refit can go ahead
    # a pool far smaller than the step's rollouts: requests paused, evicted and resumed; the same batch
    config, ample = GRPOConfig(**SMALL), build_engine(model, GRPOConfig(**SMALL))
    tight = InferenceEngine(copy.deepcopy(model), PagedKVCache(model.config, num_blocks=6, block_size=4),
                            max_batch_size=32, max_tokens=256)
    a, b = (collect_rollouts(e, ArithmeticAgent(), random.Random(0), config, 0) for e in (ample, tight))
    assert tight.pause_count > 0 and tight.evicted_request_count > 0, "no memory pressure: make the pool smaller"
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.rewards, b.rewards)
    with torch.no_grad():
        trainer = compute_logprobs(model, b.tokens)[b.loss_mask.bool()]
    assert compare_logprobs(trainer, b.engine_logprobs).ok  # other batches, other rounding: within TOLERANCE
    long = GRPOConfig(num_prompts=2, group_size=2, num_tokens_to_generate=5)
    with pytest.raises(ValueError, match="prompt .4 tokens. \\+ num_tokens_to_generate .5. = 9 exceeds the model's "
                                         "seq_length 8: shorten the prompt or generate fewer tokens"):
        collect_rollouts(build_engine(model, config), ArithmeticAgent(), random.Random(0), long, 0)


def test_a_raising_reward_stops_every_rank_naming_the_agent_and_prompt():
    def body(rank, group):
        config = GRPOConfig(**SMALL)
        layout = parallel.build_layout(2, 2, 1)
        chunk, engine = parallel.build_trainer(layout), parallel.build_engine_replica(layout, config)
        parallel.refit(chunk, engine, layout)
        before = {n: p.clone() for n, p in chunk.named_parameters()}
        bad = ArithmeticAgent(reward_fn=lambda prompt, response: 1 / 0 if rank == 2 else 0.0)
        with pytest.raises(RuntimeError, match=r"step 0: rollouts stopped, no weight was updated: rank 2: RuntimeError: "
                                               r"agent 'arithmetic': the reward function raised on prompt '\d\+\d='"):
            parallel.collect_rollouts_parallel(engine, bad, random.Random(0), config, 0, layout, 1)
        return all(torch.equal(p, before[n]) for n, p in chunk.named_parameters()), engine.has_unfinished_requests()

    assert threaded_world.run(4, body) == {r: (True, False) for r in range(4)}


def test_a_stale_engine_replica_stops_every_rank_naming_the_cause(monkeypatch):
    """Replica 1's engine keeps its old weights through the first step's refit (its weights_version still goes
    up, as in trl #5312): the log-prob check fails and every rank's error names stale weights on replica 1."""
    real_refit = parallel.refit

    def refit_dropped_on_replica_1(chunk, engine, layout, plan=None):
        before = {n: p.clone() for n, p in engine.model.named_parameters()}
        result = real_refit(chunk, engine, layout, plan)
        if plan is not None and layout.engine_replica == 1:  # the refit after step 0 installs nothing
            with torch.no_grad():
                for n, p in engine.model.named_parameters():
                    p.copy_(before[n])
        return result

    monkeypatch.setattr(parallel, "refit", refit_dropped_on_replica_1)

    def body(rank, group):
        with pytest.raises(TrainServeMismatch, match="step 1: .*causes: ") as caught:
            parallel.train_rl_parallel(2, GRPOConfig(**SMALL), 2, 2, engine_tp=2)
        return str(caught.value).split("causes: ")[1]

    causes = threaded_world.run(4, body)
    assert all(c == causes[0] for c in causes.values()), "the ranks disagree about the causes"
    assert causes[0].startswith("replica 1: stale weights (trl #5312): ") and "replica 0" not in causes[0], causes[0]


@pytest.mark.integration
def test_torchrun_entry_point_tp2pp2_to_engine_tp1():
    """The real thing: 4 processes on gloo, `python -m megalab.train_rl --tp 2 --pp 2 --engine-tp 1`, 2 steps."""
    code = "from megalab.train_rl import main\nmain(['--tp', '2', '--pp', '2', '--engine-tp', '1', '--steps', '2'])\n"
    result = launch.run(code, 4, backend="gloo", timeout=300)
    lines = [line for line in result.stdout[0].splitlines() if line.startswith("step")]
    assert len(lines) == 2 and all("(bit-equal)" in line and " kB " in line for line in lines), lines
