"""A tiny GPT trained on the course corpus, shipped as data/tiny_gpt.pt so the server has something to say.

    python -m megalab.extras.tiny_gpt          # ~1 min on a quiet CPU core; rewrites data/tiny_gpt.pt

2 layers, hidden 64, the chapter-05 BPE tokenizer (vocab 8192, tied embeddings), 128 positions,
trained with AdamW on random windows of the Shakespeare + Milton corpus (data/). The weights are
stored in bfloat16 (~1 MB) and loaded back to float32. Seeded: the same steps give the same file.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from megalab.core.datasets import DATA_DIR
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.training.tokenizer.tokenizer import Tokenizer, iter_jsonl_texts

CHECKPOINT = DATA_DIR / "tiny_gpt.pt"
TINY_CONFIG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=8192, seq_length=128,
                   hidden_dropout=0.0, attention_dropout=0.0)


def corpus_tokens(tokenizer: Tokenizer) -> torch.Tensor:
    docs = tokenizer.tokenize_batch(list(iter_jsonl_texts(sorted(DATA_DIR.glob("*.jsonl")))))
    return torch.tensor([t for doc in docs for t in (*doc, tokenizer.eod)])  # documents end with <|endoftext|>


def train(steps: int, batch_size: int = 8, lr: float = 3e-3, seed: int = 0) -> tuple[GPTModel, list[float]]:
    torch.manual_seed(seed)
    config = TransformerConfig(**TINY_CONFIG)
    model, tokens = GPTModel(config), corpus_tokens(Tokenizer.from_file())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps, pct_start=0.1)
    s, losses = config.seq_length, []
    for step in range(steps):
        starts = torch.randint(0, len(tokens) - s - 1, (batch_size,))
        window = torch.stack([tokens[i:i + s + 1] for i in starts.tolist()])  # [b, s + 1]
        loss = model(window[:, :-1], labels=window[:, 1:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % 25 == 0:
            print(f"step {step + 1}/{steps}: loss {loss.item():.2f}", flush=True)
    return model.eval(), losses


def load_tiny_gpt(path: str | Path = CHECKPOINT) -> GPTModel:
    """The shipped tiny GPT (float32, eval mode)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no checkpoint there; make it with `python -m megalab.extras.tiny_gpt`")
    saved = torch.load(path, weights_only=True)
    model = GPTModel(TransformerConfig(**saved["config"]))
    model.load_state_dict({k: v.float() for k, v in saved["state_dict"].items()})
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megalab.extras.tiny_gpt", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("-o", "--output", default=str(CHECKPOINT))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # also the fastest on a busy 2-core machine
    start = time.perf_counter()
    model, losses = train(args.steps)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    torch.save({"config": TINY_CONFIG, "state_dict": state, "final_loss": sum(losses[-20:]) / 20}, args.output)
    print(f"{args.steps} steps in {time.perf_counter() - start:.0f} s: loss {losses[0]:.2f} -> "
          f"{sum(losses[-20:]) / 20:.2f} (mean of the last 20); wrote {args.output}")


if __name__ == "__main__":
    main()
