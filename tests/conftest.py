import os

import pytest
import torch

# Triton's interpreter mode is fixed when triton is first imported, and some torch modules import
# it (torch.utils.flop_counter, used by test_model, does): choose it before any test module loads,
# as megalab.kernels would, so the kernel tests run interpreted on CPU whatever ran before them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

# the megatron-core oracle's fixtures (tests/megatron_oracle.py): parity tests fail, never skip, without it
from tests.megatron_oracle import mcore, mcore_installed  # noqa: E402, F401
