"""pretrain with use_distributed_optimizer=True (ZeRO-1: AdamW state sharded over DP).

One 4-rank launch: tp2·dp2 and pp2·dp2 runs with the distributed optimizer, tp2·dp2 without it,
a pp2·dp2 run stopped at iteration 2 (checkpoint) and resumed at pp2·dp2, dp4 and tp1·pp4 (that
one with a plain AdamW), and the optimizer-state bytes per rank at dp4 with and without sharding.
The reference is test_training's single process (GPTModel, torch AdamW, clip_grad_norm_); the
final parameters and Adam moments come from each run's last checkpoint, read here without ranks.
"""

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megalab.lab import launch
from megalab.training.checkpointing import checkpoint_dir
from tests.test_training import TRAIN, dataset, reference_training, training_config

FINAL = TRAIN["train_iters"]


def _distopt_worker(root: str):
    from megalab.core import parallel_state
    from megalab.core.optimizer.distrib_optimizer import optimizer_state_bytes
    from megalab.lab import dist as mdist
    from megalab.training.training import pretrain, setup_model_and_optimizer, train_step

    mdist.init()
    data = dataset()
    runs = {}

    def run(name, tp, pp, distopt=True, **kw):
        config = training_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 use_distributed_optimizer=distopt, **kw)
        runs[name] = [(r["iteration"], r["loss"], r["grad_norm"], r["lr"]) for r in pretrain(config, data, None)]

    run("tp2dp2", 2, 1, save=f"{root}/tp2dp2", save_interval=FINAL)
    run("tp2dp2_ddp", 2, 1, distopt=False, save=f"{root}/tp2dp2_ddp", save_interval=FINAL)
    run("pp2dp2", 1, 2)
    run("first_half", 1, 2, save=f"{root}/half", save_interval=2, exit_interval=2)
    run("resume", 1, 2, load=f"{root}/half")
    run("dp4", 1, 1, load=f"{root}/half")
    run("tp1pp4_adamw", 1, 4, distopt=False, load=f"{root}/half")

    from torch import nn

    from megalab.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megalab.core.optimizer.distrib_optimizer import DistributedOptimizer

    ddp = DistributedDataParallel(nn.Linear(4, 4, device=mdist.device()), zero_stage=1)
    try:
        DistributedOptimizer(ddp, torch.optim.SGD, param_groups=[{"params": [ddp.module.weight]}], lr=0.1)
        runs["missing_group"] = "no error"
    except ValueError as e:
        runs["missing_group"] = str(e)

    memory = {}
    for distopt in (False, True):
        config = training_config(use_distributed_optimizer=distopt)
        state = setup_model_and_optimizer(config)
        try:
            train_step(state, config, data)
            memory[distopt] = optimizer_state_bytes(state.optimizer.optimizer if distopt else state.optimizer)
        finally:
            parallel_state.destroy_model_parallel()
    torch.distributed.barrier()
    return runs, memory


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        res = launch.run_function(_distopt_worker, 4, root, launch=dict(timeout=300)).returns
        _, model, opt = reference_training(FINAL)
        final = {}
        for name in ("tp2dp2", "tp2dp2_ddp"):  # the full tensors as saved, read on one process
            state = {f"model.{n}": torch.empty_like(p) for n, p in model.named_parameters()}
            state.update({f"optimizer.{n}.{k}": torch.empty_like(p) for n, p in model.named_parameters()
                          for k in ("exp_avg", "exp_avg_sq")})
            dcp.load(state, checkpoint_id=checkpoint_dir(Path(root) / name, FINAL), no_dist=True)
            final[name] = state
        reference = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
        reference.update({f"optimizer.{n}.{k}": opt.state[p][k] for n, p in model.named_parameters()
                          for k in ("exp_avg", "exp_avg_sq")})
        return res, final, reference


def test_losses_and_grad_norms_match_single_process(results):
    runs, _ = results[0][0]
    ref = reference_training(FINAL)[0]
    for name in ("tp2dp2", "pp2dp2"):
        assert [r[0] for r in runs[name]] == [1, 2, 3, 4]
        for (_, loss, norm, _), (ref_loss, ref_norm) in zip(runs[name], ref):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (name, runs[name], ref)
            assert norm == pytest.approx(ref_norm, rel=1e-4), (name, runs[name], ref)
    for a, b in zip(runs["tp2dp2"], runs["tp2dp2_ddp"]):  # sharded or not: the same training
        assert a[1:] == pytest.approx(b[1:], rel=1e-6)


def test_params_and_adam_state_match_single_process(results):
    _, final, reference = results
    for name in ("tp2dp2", "tp2dp2_ddp"):
        for key, ref in reference.items():
            torch.testing.assert_close(final[name][key], ref, rtol=1e-4, atol=1e-6, msg=f"{name} {key}")
    for key in reference:
        torch.testing.assert_close(final["tp2dp2"][key], final["tp2dp2_ddp"][key], rtol=1e-5, atol=1e-7)


def test_resume_with_sharded_state(results):
    runs, _ = results[0][0]
    assert runs["resume"] == runs["pp2dp2"][2:]  # same layout: bit-exact
    for layout in ("dp4", "tp1pp4_adamw"):  # another DP size, or a plain AdamW, loads the gathered state
        assert [r[0] for r in runs[layout]] == [3, 4]
        for a, b in zip(runs[layout], runs["pp2dp2"][2:]):
            assert a[1] == pytest.approx(b[1], rel=1e-5) and a[3] == b[3], (layout, runs[layout])


def test_optimizer_state_per_rank_is_one_over_dp(results):
    _, memory = results[0][0]
    assert memory[True] == pytest.approx(memory[False] / 4, rel=0.01), memory


def test_param_groups_must_cover_the_model(results):
    runs, _ = results[0][0]
    assert "param_groups must hold every parameter of ddp.module" in runs["missing_group"]
