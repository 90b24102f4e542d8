"""Megatron-Core's own code for the notebooks' live parity lines (megatron-core: the dev extra).

Nothing in megalab needs megatron-core to run; a notebook's check cell imports it through `import_mcore`
and compares its result with megalab's on the same inputs.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import warnings

NOT_INSTALLED = "megatron-core is not installed (`make setup` installs it): no comparison with Megatron-Core here"


def import_mcore(name: str):
    """The module `name` (e.g. "megatron.core.parallel_state"), or ImportError(NOT_INSTALLED).

    Imported without the two notices Megatron-Core gives on a CPU machine: the Python warnings that
    Transformer Engine and apex are missing, and torch's "No CUDA runtime is found, using CUDA_HOME=..."
    (megatron.core imports torch.utils.cpp_extension, which probes for a CUDA toolkit; with nvcc installed
    and no GPU it logs that line). Neither concerns the pure-torch functions the course compares.
    """
    import torch

    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_logger.level
    if not torch.cuda.is_available():
        cpp_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except ImportError as e:
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            raise ImportError(NOT_INSTALLED) from e
        raise
    finally:
        cpp_logger.setLevel(level)
