"""pretrain with context parallelism, sequence parallelism and tied embeddings across pipeline stages.

One 4-rank launch runs each layout for 4 iterations; every one must give the losses and grad
norms of test_training's single-process reference (GPTModel, torch AdamW, clip_grad_norm_, the
token-mean loss), the tied layouts against the reference with tied embeddings.
"""

import pytest
import torch

from megalab import launch
from tests.test_training import MODEL, TRAIN, reference_training, training_config

TIED = dict(share_embeddings_and_output_weights=True)
LAYOUTS = {  # name: (tp, pp, cp, model changes, other TrainingConfig fields)
    "tp1·cp2·dp2": (1, 1, 2, {}, {}),
    "cp2·pp2": (1, 2, 2, {}, {}),
    "tp2·cp2, distributed optimizer": (2, 1, 2, {}, dict(use_distributed_optimizer=True)),
    "tp2·pp2 sequence parallel": (2, 2, 1, dict(sequence_parallel=True), {}),
    "tp2·cp2 sequence parallel": (2, 1, 2, dict(sequence_parallel=True), {}),
    "tied pp2·dp2": (1, 2, 1, TIED, {}),
    "tied tp2·pp2, distributed optimizer": (2, 2, 1, TIED, dict(use_distributed_optimizer=True)),
    "tied pp4": (1, 4, 1, TIED, {}),
}


def _layouts_worker():
    from megalab import dist as mdist
    from megalab.training import pretrain
    from tests.test_training import dataset

    mdist.init()
    out = {}
    for name, (tp, pp, cp, model, fields) in LAYOUTS.items():
        config = training_config(model, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, **fields)
        out[name] = [(r["loss"], r["grad_norm"]) for r in pretrain(config, dataset(), None)]
    torch.distributed.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    return launch.run_function(_layouts_worker, 4, launch=dict(timeout=300)).returns


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_process(runs, name):
    ref = reference_training(TRAIN["train_iters"], **LAYOUTS[name][3])[0]
    ours = runs[0][name]
    assert len(ours) == len(ref)
    for (loss, norm), (ref_loss, ref_norm) in zip(ours, ref):
        assert loss == pytest.approx(ref_loss, rel=1e-5), (name, ours, ref)
        assert norm == pytest.approx(ref_norm, rel=1e-4), (name, ours, ref)
    assert all(r[name] == ours for r in runs.values())  # every rank reports the same


def test_bad_layouts_say_what_to_do():
    with pytest.raises(ValueError, match="not divisible by 2 \\* context_parallel_size = 4"):
        training_config(dict(seq_length=18), context_parallel_size=2)
    with pytest.raises(ValueError, match="divisible by context_parallel_size x tensor_model_parallel_size"):
        training_config(dict(seq_length=MODEL["seq_length"] + 4, sequence_parallel=True), context_parallel_size=2,
                        tensor_model_parallel_size=4)
