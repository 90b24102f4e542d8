"""A tiny, deterministic learning problem for the first training loops.

    x ~ N(0, 1)^features,   y = tanh(x · w / 3) + 0.05 noise        (w fixed by the seed)
    model: Linear(features, hidden) → tanh → Linear(hidden, 1), weights fixed by the seed

Every rank (and the notebook's own single process) builds exactly the same dataset and the same
initial weights from the same seeds, so distributed training can be compared number for number
with single-process training. float64 by default: then the only differences left are rounding
in a different order of additions, around 1e-16.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def regression_data(
    samples: int = 256, features: int = 8, seed: int = 0, dtype: torch.dtype = torch.float64
) -> TensorDataset:
    """(x [samples, features], y [samples, 1]) for y = tanh(x·w/3) plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g, dtype=dtype)
    w = torch.randn(features, 1, generator=g, dtype=dtype)
    y = torch.tanh(x @ w / 3) + 0.05 * torch.randn(samples, 1, generator=g, dtype=dtype)
    return TensorDataset(x, y)


def mlp(features: int = 8, hidden: int = 16, seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """Linear → tanh → Linear, initialised from `seed` (the same weights wherever it is built)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(features, hidden, dtype=dtype), nn.Tanh(), nn.Linear(hidden, 1, dtype=dtype))
