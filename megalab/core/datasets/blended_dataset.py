"""Megatron's blended dataset: a mix of datasets in given proportions, sample by sample.

Training on "70% Shakespeare, 30% Milton" means that in every prefix of the sample stream each dataset has had its
share. Megatron's greedy rule: sample i goes to the dataset that is furthest behind its target, the one with the
largest error  weights[d] * i - taken[d].

    weights = [0.7, 0.3]
    i:             0    1    2    3    4    5    6    7    8    9
    dataset_index  0    1    0    0    1    0    0    1    0    0      (0.7 i - taken0, 0.3 i - taken1: pick max)
    sample_index   0    0    1    2    1    3    4    2    5    6      (the k-th sample taken from that dataset)

So after n samples each dataset has had its share to within one sample, with no randomness at all (the datasets
shuffle their own samples). Item i of the blend is item `dataset_sample_index[i]` of dataset `dataset_index[i]`.

Megatron-LM: `megatron/core/datasets/blended_dataset.py` (`BlendedDataset._build_indices`) calling
`helpers.cpp` `build_blending_indices`; per-dataset sizes with a 0.5% margin as in
`blended_megatron_dataset_builder.py` (`_get_size_per_split_per_dataset`).
"""

import math

import numpy as np
import torch

from megalab.core.datasets.gpt_dataset import GPTDataset
from megalab.core.datasets.indexed_dataset import IndexedDataset


def normalize(weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"blend weights {list(weights)}: give one non-negative weight per dataset, not all zero")
    return w / w.sum()


def build_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index [size] int16, dataset_sample_index [size] int64) by Megatron's greedy largest-error rule."""
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    # EXERCISE data.build_blending_indices: give sample i to the dataset with the largest weights[d] * i - taken[d]
    ### BEGIN SOLUTION
    # HINT 1: The idea. Before sample i, dataset d should have had weights[d] * i samples; the dataset furthest
    #         behind its target (the largest error) gets sample i. No rounding and no randomness: a greedy walk.
    # HINT 2: The approach. Keep a counter of the samples taken from each dataset. For each i compute every error,
    #         with Megatron's max(i, 1) in place of i; np.argmax picks the dataset (ties go to the first); record the
    #         dataset and its counter, then bump that counter.
    # HINT 3: A pitfall. dataset_sample_index[i] is the k-th sample taken from THAT dataset (its counter), not i.
    taken = np.zeros(len(weights), dtype=np.int64)
    for i in range(size):
        errors = weights * max(i, 1) - taken  # max(i, 1): Megatron's, so sample 0 already follows the weights
        d = int(np.argmax(errors))  # the first of equal errors, as in helpers.cpp
        dataset_index[i] = d
        dataset_sample_index[i] = taken[d]
        taken[d] += 1
    ### END SOLUTION
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` in proportion to `weights`; each item also says its `dataset_id`."""

    def __init__(self, datasets: list, weights: list[float], size: int):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights: give one weight per dataset")
        self.datasets, self.weights, self.size = datasets, normalize(weights), size
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, size)
        for d, dataset in enumerate(datasets):
            needed = int(np.sum(self.dataset_index == d))
            if needed > len(dataset):
                raise ValueError(f"dataset {d} has {len(dataset)} samples but the blend takes {needed}; build it larger")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        d = int(self.dataset_index[idx])
        return {"dataset_id": d, **self.datasets[d][int(self.dataset_sample_index[idx])]}


def dataset_size(weight: float, num_samples: int, surplus: float = 0.005) -> int:
    """Samples to build from one dataset of a blend: its share, rounded up, plus a surplus, rounded up (Megatron's)."""
    return math.ceil(math.ceil(weight * num_samples) * (1 + surplus))


def build_blended_gpt_dataset(prefixes: list[str], weights: list[float], seq_length: int, num_samples: int, seed: int,
                              eod: int, **gpt_kwargs) -> BlendedDataset:
    """One GPTDataset per indexed-dataset prefix, each sized ceil(ceil(weight * num_samples) * 1.005) as Megatron
    does (blended_megatron_dataset_builder._get_size_per_split_per_dataset, 0.5% surplus), blended to num_samples."""
    w = normalize(weights)
    datasets = [GPTDataset(IndexedDataset(prefix), seq_length, dataset_size(wd, num_samples), seed, eod, **gpt_kwargs)
                for prefix, wd in zip(prefixes, w, strict=True)]
    return BlendedDataset(datasets, list(w), num_samples)
