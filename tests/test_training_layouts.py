"""pretrain with context parallelism, sequence parallelism, tied embeddings across pipeline
stages, and a SwiGLU MLP under TP through resharded checkpoints.

One 4-rank launch runs each layout for 4 iterations; every one must give the losses and grad
norms of test_training's single-process reference (GPTModel, torch AdamW, clip_grad_norm_, the
token-mean loss) with the same model options. The SwiGLU run saves at tp2·pp2 after 2
iterations (each rank's linear_fc1 holds [gate_r; up_r]) and resumes at tp2·pp2, tp1·pp4 and tp4;
the tied run saves at pp4 and resumes at tp2·pp2 with the distributed optimizer.
"""

import tempfile

import pytest
import torch

from megalab.lab import launch
from tests.test_training import MODEL, TRAIN, reference_training, training_config

TIED = dict(share_embeddings_and_output_weights=True)
SWIGLU = dict(gated_linear_unit=True, activation_func="silu")  # linear_fc1 is [gate; up]
LAYOUTS = {  # name: (tp, pp, cp, model changes, other TrainingConfig fields)
    "tp1·cp2·dp2": (1, 1, 2, {}, {}),
    "cp2·pp2": (1, 2, 2, {}, {}),
    "tp2·cp2, distributed optimizer": (2, 1, 2, {}, dict(use_distributed_optimizer=True)),
    "tp2·pp2 sequence parallel": (2, 2, 1, dict(sequence_parallel=True), {}),
    "tp2·cp2 sequence parallel": (2, 1, 2, dict(sequence_parallel=True), {}),
    "tied pp2·dp2": (1, 2, 1, TIED, {}),
    "tied tp2·pp2, distributed optimizer": (2, 2, 1, TIED, dict(use_distributed_optimizer=True)),
    "tied pp4": (1, 4, 1, TIED, {}),
    "swiglu tp2·pp2": (2, 2, 1, SWIGLU, {}),
}
SWIGLU_RESUMES = {"swiglu resume tp2·pp2": (2, 2), "swiglu resume tp1·pp4": (1, 4), "swiglu resume tp4": (4, 1)}


def _layouts_worker(root: str):
    from megalab.lab import dist as mdist
    from megalab.training.training import pretrain
    from tests.test_training import dataset

    mdist.init()
    out = {}

    def run(name, model, tp, pp, cp=1, **fields):
        config = training_config(model, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, **fields)
        out[name] = [(r["loss"], r["grad_norm"]) for r in pretrain(config, dataset(), None)]

    for name, (tp, pp, cp, model, fields) in LAYOUTS.items():
        run(name, model, tp, pp, cp, **fields)
    run("swiglu first half", SWIGLU, 2, 2, save=f"{root}/swiglu", save_interval=2, exit_interval=2)
    for name, (tp, pp) in SWIGLU_RESUMES.items():
        run(name, SWIGLU, tp, pp, load=f"{root}/swiglu")
    run("tied first half", TIED, 1, 4, save=f"{root}/tied", save_interval=2, exit_interval=2)
    run("tied resume tp2·pp2", TIED, 2, 2, load=f"{root}/tied", use_distributed_optimizer=True)
    torch.distributed.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as root:
        return launch.run_function(_layouts_worker, 4, root, launch=dict(timeout=300)).returns


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_process(runs, name):
    ref = reference_training(TRAIN["train_iters"], **LAYOUTS[name][3])[0]
    ours = runs[0][name]
    assert len(ours) == len(ref)
    for (loss, norm), (ref_loss, ref_norm) in zip(ours, ref):
        assert loss == pytest.approx(ref_loss, rel=1e-5), (name, ours, ref)
        assert norm == pytest.approx(ref_norm, rel=1e-4), (name, ours, ref)
    assert all(r[name] == ours for r in runs.values())  # every rank reports the same


def test_swiglu_checkpoint_reshards(runs):
    full = runs[0]["swiglu tp2·pp2"]
    assert runs[0]["swiglu resume tp2·pp2"] == full[2:]  # bit-exact
    for name in SWIGLU_RESUMES:  # [gate_r; up_r] shards reassembled to [gate; up], then cut for tp1 / tp4
        ours = [x for record in runs[0][name] for x in record]
        assert ours == pytest.approx([x for record in full[2:] for x in record], rel=1e-5), (name, ours, full)


def test_tied_embeddings_checkpoint_reshards(runs):
    resumed, full = runs[0]["tied resume tp2·pp2"], runs[0]["tied pp4"]
    assert [x for r in resumed for x in r] == pytest.approx([x for r in full[2:] for x in r], rel=1e-5)


def test_bad_layouts_say_what_to_do():
    with pytest.raises(ValueError, match="not divisible by 2 \\* context_parallel_size = 4"):
        training_config(dict(seq_length=18), context_parallel_size=2)
    with pytest.raises(ValueError, match="divisible by context_parallel_size x tensor_model_parallel_size"):
        training_config(dict(seq_length=MODEL["seq_length"] + 4, sequence_parallel=True), context_parallel_size=2,
                        tensor_model_parallel_size=4)
