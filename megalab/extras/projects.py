"""Chapter 07 · projects 1 and 4: train a small GPT in 3D parallel, kill it, resume it; then serve it.

    project 1 (01_train_3d_parallel)                          project 4 (04_serve_and_load_test)

    recipe(tp=2, pp=2) on 8 ranks (dp = 8 / (tp·pp) = 2)
      reference run ── saves iter 4, 8, 12 ──> TRAINED/ ──load_inference_model──> GPTModel (tp1·pp1)
      same run, killed at iteration 10                                               │
      resume from iter 8 ── losses 9..12 == reference's (curves_match)        engine ─> server ─> load test

One recipe (model, data, batch, schedule) is shared by both notebooks, so project 4 serves exactly
what project 1 trained; if project 1 has not run, trained_checkpoint() trains the same recipe.
A training checkpoint stores every tensor under its global name at full shape (megalab/training/checkpointing.py),
so turning the tp2·pp2 shards into one inference model is a DCP load at tp1·pp1 into GPTModel.
"""

from __future__ import annotations

import json
import uuid
import warnings
from pathlib import Path

import httpx
import torch

from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.lab import dist as mdist
from megalab.lab import launch
from megalab.training.checkpointing import CheckpointError, find_checkpoint, read_common, read_state, read_tracker
from megalab.training.training import TrainingConfig, build_train_dataset, pretrain, small_gpt_config

TRAIN_ITERS, SAVE_INTERVAL = 12, 4
GLOBAL_BATCH, MICRO_BATCH, SEQ_LENGTH = 16, 2, 64
TRAINED = mdist.cache_dir("07-trained")  # project 1's reference run, the model project 4 serves (published whole)
CURVE = "loss_curve.json"  # next to the checkpoints: the run's (iteration, loss) pairs


# ------------------------------------------------------------------ project 1: the recipe
def build_dataset():
    """The recipe's data: TRAIN_ITERS global batches of the shipped corpus, and its tokenizer."""
    return build_train_dataset(num_samples=TRAIN_ITERS * GLOBAL_BATCH, seq_length=SEQ_LENGTH)


def recipe(vocab_size: int, tp: int = 2, pp: int = 2, **overrides) -> TrainingConfig:
    """The project's run: chapter 05's small GPT (4 layers, hidden 64), 12 iterations of 16 sequences of 64 tokens,
    Adam's state sharded over DP by the distributed optimizer (Megatron's --use-distributed-optimizer).

    The data-parallel size is whatever the world size leaves: dp = world / (tp·pp).
    overrides: any TrainingConfig field (save, save_interval, load, train_iters, ...).
    """
    fields = dict(model=small_gpt_config(vocab_size, SEQ_LENGTH), train_iters=TRAIN_ITERS, micro_batch_size=MICRO_BATCH,
                  global_batch_size=GLOBAL_BATCH, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                  lr=1e-2, lr_warmup_iters=2, use_distributed_optimizer=True)
    return TrainingConfig(**{**fields, **overrides})


def loss_curve(records: list[dict]) -> list[tuple[int, float]]:
    """pretrain's records as (iteration, loss) pairs."""
    return [(r["iteration"], r["loss"]) for r in records]


def curves_match(reference: list[tuple[int, float]], resumed: list[tuple[int, float]], rtol: float = 0.0) -> bool:
    """True if `resumed` continues `reference`: it covers exactly reference's last iterations, in order, and every
    loss equals reference's at that iteration (rtol=0: bit for bit; otherwise |loss - ref| <= rtol·|ref|)."""
    if rtol < 0:
        raise ValueError(f"rtol must be >= 0 (0: bit-exact), got {rtol}")
    # EXERCISE projects.curves_match: same iterations as reference's tail (none missing, none extra), losses within rtol
    ### BEGIN SOLUTION
    # HINT 1: A resumed run continues the reference: its iterations must be exactly the LAST
    #         len(resumed) iterations of the reference, in order, and each loss must match at that iteration.
    # HINT 2: Turn the reference into a dict iteration -> loss; reject an empty curve or iterations
    #         that differ from the sorted reference iterations' tail; then compare every loss with
    #         |loss - ref| <= rtol * |ref|.
    # HINT 3: The tolerance is relative (rtol times |ref|), and rtol=0 must accept identical losses (<=, not <).
    expected = dict(reference)
    iterations = [it for it, _ in resumed]
    if not resumed or iterations != sorted(expected)[-len(resumed):]:
        return False
    return all(abs(loss - expected[it]) <= rtol * abs(expected[it]) for it, loss in resumed)
    ### END SOLUTION


def save_curve(save_dir: str | Path, curve: list[tuple[int, float]]) -> None:
    (Path(save_dir) / CURVE).write_text(json.dumps(curve))  # JSON floats round-trip exactly


def load_curve(save_dir: str | Path) -> list[tuple[int, float]]:
    return [(it, loss) for it, loss in json.loads((Path(save_dir) / CURVE).read_text())]


def train_reference(save: str | Path) -> list[tuple[int, float]]:
    """Collective (8 ranks): the uninterrupted tp2·pp2·dp2 run, saving every SAVE_INTERVAL iterations and,
    on rank 0, its loss curve."""
    rank, _ = mdist.init()
    dataset, tokenizer = build_dataset()
    config = recipe(tokenizer.vocab_size, save=str(save), save_interval=SAVE_INTERVAL)
    curve = loss_curve(pretrain(config, dataset, on_log=None))
    if rank == 0:
        save_curve(save, curve)
    return curve


def publish_trained(run: str | Path, trained: str | Path = TRAINED) -> Path:
    """Make a finished reference run (its checkpoints and loss curve) the one project 4 serves, in one rename."""
    if read_tracker(run) != TRAIN_ITERS or not (Path(run) / CURVE).exists():
        raise CheckpointError(f"{run} is not a finished reference run (iteration {TRAIN_ITERS} and {CURVE})")
    return mdist.publish_dir(Path(run), Path(trained))


def trained_checkpoint(trained: str | Path = TRAINED) -> Path:
    """Project 1's checkpoint folder, complete (final iteration and loss curve); trains the recipe on 8 ranks
    first if it is not (in this run's scratch folder, then published whole)."""
    if read_tracker(trained) != TRAIN_ITERS or not (Path(trained) / CURVE).exists():
        run = mdist.scratch_dir("07-reference") / uuid.uuid4().hex[:8]
        launch.run_function(train_reference, 8, str(run))
        publish_trained(run, trained)
    return Path(trained)


# ------------------------------------------------------------------ project 4: serve it
def load_inference_model(load_dir: str | Path, iteration: int | None = None) -> GPTModel:
    """One GPTModel (eval mode) from a training checkpoint of any tp/pp/dp layout: its tp1·pp1 resharding.

    No process group needed: DCP reads every shard it is asked for in this one process.
    """
    if iteration is None and read_tracker(load_dir) is None:
        raise CheckpointError(f"no checkpoint in {load_dir}: run project 1 (or projects.trained_checkpoint()) first")
    path = find_checkpoint(load_dir, iteration)
    model = GPTModel(TransformerConfig(**read_common(path)["model_config"]))
    # EXERCISE projects.load_inference_model: read every model.<name> tensor (full shape) with read_state (DCP), copy it in
    ### BEGIN SOLUTION
    # HINT 1: The checkpoint stores every tensor under its global name model.<parameter name> at full
    #         shape, so an unsharded GPTModel can ask for exactly its own parameters by name.
    # HINT 2: Build a dict model.<name> -> an empty tensor shaped like each parameter, fill it
    #         with read_state in its single-process mode (no_dist: no process group), then copy each tensor into its
    #         parameter under torch.no_grad().
    # HINT 3: Every parameter (weights, biases, norms, embeddings) must be copied in; reading is not
    #         loading.
    state = {f"model.{name}": torch.empty_like(p) for name, p in model.named_parameters()}  # full shapes
    with warnings.catch_warnings():  # DCP warns that it loads in a single process: that is the point here
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        read_state(path, state, no_dist=True)  # picks each tensor out of whichever rank's file holds it
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[f"model.{name}"])
    ### END SOLUTION
    return model.eval()


BAD_REQUESTS = {  # name -> raw body; each must get a 4xx with a message, and the server must keep serving
    "malformed JSON": '{"prompt": "hi", "max_tokens": ',
    "no prompt": '{"max_tokens": 5}',
    "max_tokens 0": '{"prompt": "hi", "max_tokens": 0}',
    "temperature -1": '{"prompt": "hi", "temperature": -1}',
    "prompt too long": '{"prompt": "' + "word " * 80 + '", "max_tokens": 10}',
    "unknown model": '{"model": "gpt-5", "prompt": "hi"}',
    "max_tokens text": '{"prompt": "hi", "max_tokens": "3"}',
    "not UTF-8": b'{"prompt": "\xff"}',
}


def bad_request_replies(url: str) -> dict[str, tuple[int, str]]:
    """POST each of BAD_REQUESTS to url's /v1/completions: name -> (status code, error message or '')."""
    replies = {}
    for name, content in BAD_REQUESTS.items():
        r = httpx.post(url + "/v1/completions", content=content, headers={"content-type": "application/json"})
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = ""
        replies[name] = (r.status_code, message)
    return replies
