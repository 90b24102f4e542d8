"""Refit (megalab/core/resharding/): the plan's tiling, trainer tp2·pp2 -> engine tp1 / tp2 bit-equal on a threaded
world of 4 ranks (tests/threaded_world.py), the bytes moved, and the refusals (incompatible models, requests in flight)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalab.core.inference import InferenceEngine, PagedKVCache, SamplingParams, generate_by_recompute
from megalab.core.models.gpt.gpt_layer_specs import tensor_parallel_layer_spec
from megalab.core.models.gpt.gpt_model import GPTModel, build_gpt_stages
from megalab.core.resharding import ReshardError, build_plan_from_rosters, swap_model_weights
from megalab.core.resharding.planner import lcm_tiles
from megalab.core.resharding.utils import extract_param_metadata
from megalab.core.tensor_parallel.layers import full_shard_of
from megalab.core.transformer.transformer_config import TransformerConfig
from tests import threaded_world

CONFIG = dict(num_layers=4, hidden_size=16, num_attention_heads=4, vocab_size=32, seq_length=16,
              hidden_dropout=0.0, attention_dropout=0.0)


def shard(full: torch.Tensor, world: int, rank: int, stride: int, dim: int = 0) -> torch.Tensor:
    n = full.shape[dim] // stride // world
    return torch.cat([part.narrow(dim, rank * n, n) for part in full.chunk(stride, dim)], dim)


@pytest.mark.parametrize("src_tp,dst_tp,stride", [(2, 1, 1), (1, 2, 1), (2, 4, 1), (4, 2, 1), (2, 3, 1), (2, 1, 2),
                                                  (2, 4, 2), (4, 2, 2)])
def test_lcm_tiles_build_each_destination_shard(src_tp, dst_tp, stride):
    full = torch.arange(24 * stride, dtype=torch.float32)
    sources = [shard(full, src_tp, r, stride) for r in range(src_tp)]
    for d in range(dst_tp):
        got = torch.full_like(shard(full, dst_tp, d, stride), float("nan"))
        for src_rank, src_start, dst_start, n in lcm_tiles(len(full), src_tp, stride, dst_tp, stride, d, "w"):
            got[dst_start:dst_start + n] = sources[src_rank][src_start:src_start + n]
        assert torch.equal(got, shard(full, dst_tp, d, stride)), f"tp{src_tp} -> tp{dst_tp} (stride {stride}), rank {d}"


def _reference(seed: int) -> dict[str, torch.Tensor]:
    """The trainer's full model after some 'training': the seed-0 init plus seeded noise."""
    torch.manual_seed(0)
    state = GPTModel(TransformerConfig(**CONFIG)).state_dict()
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in state.items()}


@torch.no_grad()
def _load_shards(model: GPTModel, full: dict[str, torch.Tensor], tp_rank: int) -> None:
    for name, p in model.named_parameters():
        p.copy_(full_shard_of(full[name], p, tp_rank, getattr(p, "partition_stride", 1)))


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _refit_body(engine_tp: int):
    refs = [_reference(1), _reference(2)]  # two training steps' weights

    def body(rank, world_group):
        tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        engine_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        tp_group, tp_rank, pp_rank = tp_groups[rank // 2], rank % 2, rank // 2
        torch.manual_seed(0)
        config = TransformerConfig(**CONFIG)
        whole = GPTModel(config, tensor_parallel_layer_spec(tp_group))  # trainer: tp2 (built whole) ...
        (chunk,) = build_gpt_stages(whole, 2, pp_rank)  # ... pp2: this rank's stage
        engine_group = engine_groups[rank // 2] if engine_tp == 2 else None
        spec = tensor_parallel_layer_spec(engine_group) if engine_tp == 2 else None
        engine_model = GPTModel(config, spec)
        engine = InferenceEngine(engine_model, PagedKVCache(config, 8, 4, tp_size=engine_tp))
        out, plan = [], None
        for ref in refs:
            _load_shards(whole, ref, tp_rank)  # the optimizer step (the same modules the chunk holds)
            stats, plan = swap_model_weights(chunk, engine, src_tp_group=tp_group, dst_tp_group=engine_group,
                                             plan=plan)
            equal = sorted(n for n, p in engine_model.named_parameters()
                     if torch.equal(p, full_shard_of(ref[n], p, rank % 2 if engine_tp == 2 else 0,
                                                     getattr(p, "partition_stride", 1))))
            out.append((stats, equal, engine.weights_version))
        greedy = SamplingParams(num_tokens_to_generate=4, top_k=1)
        generated = engine.generate([[1, 2, 3]], greedy)[0].generated_tokens  # the engine runs on what it received
        # what this rank's trainer stage holds is copied locally (its share of each TP split, whole replicated
        # tensors; not the last stage's copy of the tied embeddings); the rest of the engine's weights comes over gloo
        held = _bytes(p for n, p in chunk.named_parameters() if n != "word_embeddings.weight")
        engine_params = dict(engine_model.named_parameters())
        expected_received = _bytes(engine_params.values()) - held
        return out, sorted(engine_params), expected_received, generated

    reference = GPTModel(TransformerConfig(**CONFIG))
    reference.load_state_dict(refs[-1])
    expected = generate_by_recompute(reference, [1, 2, 3], SamplingParams(num_tokens_to_generate=4, top_k=1))
    return threaded_world.run(4, body), expected


@pytest.mark.parametrize("engine_tp", [1, 2])
def test_refit_tp2pp2_to_engine_is_bit_equal(engine_tp):
    results, expected_tokens = _refit_body(engine_tp)
    for rank, (out, names, expected_received, generated) in results.items():
        assert generated == expected_tokens, f"rank {rank}: the engine generated {generated}, the trainer's model {expected_tokens}"
        for step, (stats, equal, version) in enumerate(out):
            assert equal == names, f"rank {rank}, refit {step + 1}: not bit-equal: {sorted(set(names) - set(equal))}"
            assert version == step + 1, f"rank {rank}: weights_version {version} after {step + 1} refits"
            assert stats.bytes_received == expected_received, (
                f"rank {rank}: received {stats.bytes_received} bytes, expected {expected_received} "
                "(the engine's weights minus what this rank's trainer stage already holds)")
    sent = sum(stats.bytes_sent for out, *_ in results.values() for stats, _, _ in out)
    received = sum(stats.bytes_received for out, *_ in results.values() for stats, _, _ in out)
    assert sent == received > 0


def _metadata(**changes):
    torch.manual_seed(0)
    config = TransformerConfig(**{**CONFIG, **changes})
    return {0: extract_param_metadata(GPTModel(config), 0)}


def test_refit_refuses_incompatible_models():
    from megalab.core.resharding.utils import model_signature

    def plan(**changes):
        src, dst = _metadata(), _metadata(**changes)
        sig = lambda **c: [model_signature(TransformerConfig(**{**CONFIG, **c}))]  # noqa: E731
        return build_plan_from_rosters(src, dst, 0, sig(), sig(**changes))

    assert len(plan().recv_ops) == len(_metadata()[0])  # the same model: one full copy per parameter
    with pytest.raises(ReshardError, match="vocab_size 32 .* 48 .*padded vocabularies"):
        plan(vocab_size=48)
    with pytest.raises(ReshardError, match="num_attention_heads 4 .* 2 .*attention heads differ"):
        plan(num_attention_heads=2)  # same matrix shapes: only the signature catches it
    src, dst = _metadata(), _metadata(vocab_size=48)
    with pytest.raises(ReshardError, match="embedding.word_embeddings.weight: full shape \\(32, 16\\)"):
        build_plan_from_rosters(src, dst, 0)  # without signatures the shapes still refuse it


def test_refit_refused_with_requests_in_flight_changes_nothing():
    def body(rank, world_group):
        torch.manual_seed(0)
        config = TransformerConfig(**CONFIG)
        trainer = GPTModel(config) if rank == 0 else None
        engine = InferenceEngine(GPTModel(config), PagedKVCache(config, 8, 4)) if rank == 1 else None
        if rank == 1:
            engine.add_request([1, 2, 3], SamplingParams(num_tokens_to_generate=2, top_k=1))
            before = {n: p.clone() for n, p in engine.model.named_parameters()}
        with pytest.raises(RuntimeError, match="rank 1: the engine has requests in flight"):
            swap_model_weights(trainer, engine)
        if rank == 1:
            return engine.weights_version, all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())

    assert threaded_world.run(2, body)[1] == (0, True)
