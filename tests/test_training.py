"""The training loop against a single-process reference; bit-exact resume; resharded resume.

One 4-rank launch runs every distributed case: an uninterrupted tp2·pp2 run, the same run
stopped at iteration 2 (checkpoint) and resumed, and resumes of that checkpoint at tp1·pp4
and dp4. The reference is plain PyTorch on one process: GPTModel, AdamW, clip_grad_norm_,
LambdaLR, and the loss averaged over every unmasked token of the global batch.
"""

import math
import tempfile

import pytest
import torch
import torch.nn.functional as F

from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.lab import launch

MODEL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16,
             hidden_dropout=0.0, attention_dropout=0.0, share_embeddings_and_output_weights=False)
TRAIN = dict(train_iters=4, micro_batch_size=2, global_batch_size=8, lr=3e-3, min_lr=3e-4, lr_warmup_iters=1,
             clip_grad=0.5, seed=7)


class SyntheticDataset(torch.utils.data.Dataset):
    """Items in the GPTDataset contract, with loss masks of varying size (so token-mean != mean of means)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.text = torch.randint(0, vocab_size, (num_samples, seq_length + 1), generator=g)
        keep = torch.randint(1, seq_length + 1, (num_samples, 1), generator=g)
        self.mask = (torch.arange(seq_length) < keep).float()  # sample i keeps its first keep[i] tokens

    def __len__(self):
        return len(self.text)

    def __getitem__(self, i):
        return {"tokens": self.text[i, :-1], "labels": self.text[i, 1:], "loss_mask": self.mask[i],
                "position_ids": torch.arange(self.text.shape[1] - 1)}


def training_config(model: dict | None = None, **overrides):
    """TRAIN with overrides; model: changes to MODEL."""
    from megalab.training.training import TrainingConfig

    return TrainingConfig(model=TransformerConfig(**{**MODEL, **(model or {})}), **{**TRAIN, **overrides})


def dataset():
    return SyntheticDataset(64, MODEL["seq_length"], MODEL["vocab_size"])


def reference_run(iters: int) -> list[tuple[float, float]]:
    """(loss, grad norm) per iteration of the same training on one process with PyTorch's own pieces."""
    return reference_training(iters)[0]


def reference_training(iters: int, **model_overrides) -> tuple[list[tuple[float, float]], torch.nn.Module,
                                                              torch.optim.Optimizer]:
    """reference_run's records, and the trained model and its AdamW (model_overrides: changes to MODEL)."""
    torch.manual_seed(TRAIN["seed"])
    model = GPTModel(TransformerConfig(**{**MODEL, **model_overrides}))
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if p.ndim == 1 or n.endswith(".bias")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=TRAIN["lr"], betas=(0.9, 0.95))
    lo, hi, warm, total = TRAIN["min_lr"], TRAIN["lr"], TRAIN["lr_warmup_iters"], TRAIN["train_iters"]

    def lr_at(step):  # linear warmup then cosine, written from the formula
        if step <= warm:
            return hi * step / warm
        return lo + (hi - lo) * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step) / hi)
    data, B, out = dataset(), TRAIN["global_batch_size"], []
    for it in range(iters):
        items = [data[i] for i in range(it * B, (it + 1) * B)]
        tokens, labels, mask = (torch.stack([x[k] for x in items]) for k in ("tokens", "labels", "loss_mask"))
        logits = model(tokens)  # [B, s, V]
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        loss = (losses * mask.reshape(-1)).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["clip_grad"])
        opt.step()
        sched.step()
        out.append((loss.item(), norm.item()))
    return out, model, opt


def _train_worker(root: str):
    from megalab.lab import dist as mdist
    from megalab.training.training import pretrain

    mdist.init()
    data = dataset()
    runs = {}
    runs["full"] = pretrain(training_config(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), data, None)
    runs["first_half"] = pretrain(training_config(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                                  save=f"{root}/ckpt", save_interval=2, exit_interval=2), data, None)
    for name, tp, pp in [("resume", 2, 2), ("tp1pp4", 1, 4), ("dp4", 1, 1)]:
        runs[name] = pretrain(training_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                              load=f"{root}/ckpt"), data, None)
    torch.distributed.barrier()
    return {k: [(r["iteration"], r["loss"], r["grad_norm"], r["lr"]) for r in v] for k, v in runs.items()}


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as root:
        return launch.run_function(_train_worker, 4, root, launch=dict(timeout=300)).returns


def test_tp2_pp2_matches_single_process(runs):
    ref = reference_run(4)
    full = runs[0]["full"]
    assert [r[0] for r in full] == [1, 2, 3, 4]
    for (_, loss, norm, _), (ref_loss, ref_norm) in zip(full, ref):
        assert loss == pytest.approx(ref_loss, rel=1e-5), (full, ref)
        assert norm == pytest.approx(ref_norm, rel=1e-4), (full, ref)
    assert all(runs[r]["full"] == full for r in runs)  # every rank reports the same loss


def test_resume_is_bit_exact(runs):
    full, resumed = runs[0]["full"], runs[0]["resume"]
    assert [r[0] for r in resumed] == [3, 4]
    assert resumed == full[2:]  # loss, grad norm and lr: exactly equal


@pytest.mark.parametrize("layout", ["tp1pp4", "dp4"])
def test_resharded_resume(runs, layout):
    full, other = runs[0]["full"], runs[0][layout]
    assert [r[0] for r in other] == [3, 4]
    for a, b in zip(other, full[2:]):
        assert a[1] == pytest.approx(b[1], rel=1e-5) and a[3] == b[3]


def test_config_errors():
    with pytest.raises(ValueError, match="global_batch_size=6 is not a multiple"):
        from megalab.training.training import num_microbatches

        num_microbatches(training_config(global_batch_size=6), dp=4)
