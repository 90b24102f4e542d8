"""The data pipeline of chapter 05, Megatron-LM's `megatron/core/datasets/` in small.

    JSONL text ──tokenizer (training/tokenizer/)──► token ids ──tools/preprocess_data.py──► .bin/.idx (indexed_dataset.py)
        ──gpt_dataset.py──► fixed-length samples ──blended_dataset.py──► a weighted mix of datasets

`DATA_DIR` is the repository's `data/` folder: the shipped corpus and the trained tokenizer.
"""

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[3] / "data"
