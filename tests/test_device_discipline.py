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


# ------------------------------------------------------------------ on a GPU (make gpu-test runs these)
@pytest.mark.gpu
def test_clip_grad_norm_on_one_gpu():
    from megalab.core.optimizer.clip_grads import clip_grad_norm

    p = nn.Parameter(torch.ones(3, device="cuda"))
    p.grad = torch.full((3,), 2.0, device="cuda")
    assert abs(clip_grad_norm([p], 1.0) - 12**0.5) < 1e-5 and p.grad.device.type == "cuda"


@pytest.mark.gpu
def test_fp32_triton_attention_is_ieee_exact_on_gpu():
    """TF32 dots would be ~1e-3 off; IEEE fp32 is ~1e-6 from the fp64 reference."""
    import torch.nn.functional as F

    from megalab.kernels.flash_attention import flash_attention

    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
               for i in range(3))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True).float()
    assert (flash_attention(q, k, v, causal=True) - ref).abs().max().item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("d, dtype", [(128, torch.float32), (256, torch.float32), (256, torch.bfloat16)])
def test_triton_backward_fits_shared_memory_at_large_head_dims(d, dtype):
    import torch.nn.functional as F

    from megalab.kernels.flash_attention import flash_attention

    q, k, v = (torch.randn(1, 2, 300, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    ours = torch.autograd.grad(flash_attention(q, k, v, causal=True).float().sum(), (q, k, v))
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum(), (q, k, v))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def _one_rank_training(root):
    from megalab.training.training import TrainingConfig, build_train_dataset, pretrain, small_gpt_config

    dataset, tokenizer = build_train_dataset(num_samples=4, seq_length=64)
    config = TrainingConfig(model=small_gpt_config(tokenizer.vocab_size), train_iters=2, micro_batch_size=2,
                            global_batch_size=2, lr_warmup_iters=0)
    return [r["loss"] for r in pretrain(config, dataset, on_log=None)], torch.distributed.get_backend()


@pytest.mark.gpu
def test_training_runs_on_nccl_at_world_size_one(tmp_path):
    """NCCL maps to CUDA only: any CPU tensor in a collective fails even with one rank."""
    from megalab.lab import launch

    losses, backend = launch.run_function(_one_rank_training, 1, str(tmp_path), launch=dict(timeout=300)).returns[0]
    assert backend == "nccl" and len(losses) == 2 and all(x == x for x in losses)


def test_training_device_says_what_to_use(monkeypatch):
    from megalab.training.training import TrainingConfig, small_gpt_config, training_device

    def config(device):
        return TrainingConfig(model=small_gpt_config(64), train_iters=1, device=device)

    assert training_device(config("meta")) == torch.device("meta")
    assert training_device(config(None)) == torch.device("cpu")  # no process group: the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU: leave device=None"):
        training_device(config("cuda"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="under NCCL"):
        training_device(config("cpu"))


def test_published_values_arrive_on_the_cpu_detached_even_when_nested(monkeypatch, tmp_path):
    """A rank's CUDA tensors inside a dict would unpickle onto that rank's GPU in the notebook: move them all."""
    import pickle

    from megalab.lab import dist as mdist

    (tmp_path / "publish").mkdir()
    monkeypatch.setenv("MEGALAB_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    w = torch.ones(2, dtype=torch.float64, requires_grad=True) * 2
    mdist.publish("results", {"w": w, "runs": [(1, w)], "n": 3})
    got = pickle.loads((tmp_path / "publish" / "results.rank0.pkl").read_bytes())
    assert not got["w"].requires_grad and not got["runs"][0][1].requires_grad and got["n"] == 3
    assert got["w"].dtype == torch.float64 and got["runs"][0][1].device.type == "cpu"
