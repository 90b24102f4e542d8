"""Library code follows its inputs' device and dtype (issue 23): what reaches a collective lives where the
model lives. No GPU here: the model lives on the "meta" device and the collectives are intercepted, so a
tensor made on the CPU by default (an NCCL error on a GPU) shows up as a CPU tensor in the collective."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn


class _Reached(Exception):
    pass


@pytest.fixture
def collectives(monkeypatch):
    """Every tensor handed to dist.all_reduce/broadcast is recorded as (op, device, dtype); the call raises _Reached."""
    seen = []

    def fake(op):
        def call(tensor, *args, **kwargs):
            seen.append((op, tensor.device.type, tensor.dtype))
            raise _Reached
        return call

    for op in ("all_reduce", "broadcast"):
        monkeypatch.setattr(dist, op, fake(op))
    return seen


def test_grad_norm_is_reduced_on_the_grads_device(collectives):
    from megalab.core.optimizer.clip_grads import clip_grad_norm

    p = nn.Parameter(torch.ones(3, device="meta"))
    p.grad = torch.ones(3, device="meta")
    with pytest.raises(_Reached):
        clip_grad_norm([p], 1.0, model_parallel_group=object())
    assert collectives == [("all_reduce", "meta", torch.float32)]


def test_found_inf_flag_is_reduced_on_the_params_device(collectives, monkeypatch):
    from megalab.core.optimizer import optimizer as mp
    from megalab.core.optimizer.grad_scaler import DynamicGradScaler

    p = nn.Parameter(torch.ones(3, dtype=torch.float16, device="meta"))
    opt = mp.Float16OptimizerWithFloat16Params(torch.optim.SGD([p], lr=0.1), DynamicGradScaler(),
                                               found_inf_group=object())
    p.grad = torch.ones(3, dtype=torch.float16, device="meta")
    monkeypatch.setattr(mp, "unscale_and_check_for_nan", lambda grads, inv_scale: False)  # meta holds no values
    with pytest.raises(_Reached):
        opt.step()
    assert collectives == [("all_reduce", "meta", torch.float32)]


def test_train_step_moves_the_data_to_the_model_and_counts_tokens_there(collectives):
    from megalab.training import training

    model = nn.Linear(2, 2, device="meta")
    ps = SimpleNamespace(get_data_parallel_world_size=lambda: 1, get_data_parallel_rank=lambda: 0,
                         get_context_parallel_world_size=lambda: 1, get_context_parallel_rank=lambda: 0,
                         get_data_parallel_group=lambda with_context_parallel=False: object())
    state = SimpleNamespace(ps=ps, params=list(model.parameters()), consumed_samples=0)
    item = {"tokens": torch.zeros(4, dtype=torch.long), "labels": torch.zeros(4, dtype=torch.long),
            "loss_mask": torch.ones(4)}
    config = SimpleNamespace(micro_batch_size=2, global_batch_size=4)
    with pytest.raises(_Reached):
        training.train_step(state, config, [item] * 4)
    assert collectives == [("all_reduce", "meta", torch.float32)]


def test_top_ops_reports_cpu_time_for_a_cpu_model_on_a_gpu_machine(monkeypatch):
    from megalab.extras.profiling import profile_step, top_ops

    model, x = nn.Linear(64, 64), torch.randn(32, 64)
    prof = profile_step(lambda: model(x).sum().backward(), steps=1, device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine profiling a CPU model
    rows = top_ops(prof, n=3)
    assert rows[0]["self_ms"] > 0 and abs(sum(r["share"] for r in top_ops(prof, n=1000)) - 1) < 1e-6, rows
