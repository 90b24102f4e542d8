"""megalab: learn how Megatron-LM trains and serves large language models by building it.

`%load_ext megalab` in a notebook registers the `%%torchrun` cell magic (megalab/magic.py).
Importing the package is cheap: torch is imported only by the modules that need it.
"""

__version__ = "0.1.0"


def load_ipython_extension(ipython):
    from megalab.magic import TorchrunMagics

    ipython.register_magics(TorchrunMagics)
