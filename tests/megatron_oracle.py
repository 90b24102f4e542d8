"""megatron-core as the test oracle: the parity tests compare megalab with Megatron-Core's own code.

megatron-core is a dev dependency (pyproject's `dev` extra, pinned): `make setup` installs it. Nothing at
run time imports it; only tests and the notebooks' check cells do. A run without it, or with another
version, FAILS the parity tests (they must run in CI, never skip) with the line that installs it.

Pinned: megatron-core 0.19.2, the newest release (it needs Python >= 3.12, as the course does). A build
may carry a local version suffix ('0.19.2+f1b6066'): the version compared is the public one. Megatron-Core's
pure-torch functions run on CPU without Transformer Engine or apex (it warns once on import; silenced here).

From 0.16.1 (the previous pin) to 0.19.2 every compared result stayed the same; interfaces moved, and the
tests call the new ones: `permute` needs `num_out_tokens` and returns five values (the fused kernel's pad
offsets and counts: None unfused); `get_batch_on_this_cp_rank` takes the CP group and `is_hybrid_cp`, and
splits packed sequences (`cu_seqlens`) per document, which megalab does not (its CP takes no packed documents);
the router records its losses in `MoEMetricsTracker` and divides a repeated MTP layer's aux loss by
`mtp_num_layers` (megalab has no MTP).
"""

from __future__ import annotations

import importlib
import warnings

import pytest

MEGATRON_CORE_VERSION = "0.19.2"
INSTALL_HINT = (f"the parity tests need megatron-core=={MEGATRON_CORE_VERSION} (the dev extra): run `make setup`, "
                f"or `pip install -e .[dev]` (or `pip install megatron-core=={MEGATRON_CORE_VERSION}`) in this environment")


def public_version(version: str | None) -> str | None:
    """'0.19.2+f1b6066' -> '0.19.2': a local build suffix (after '+') is not another release."""
    return version.split("+", 1)[0] if version else version


class MegatronCoreUnavailable(RuntimeError):
    """megatron-core is missing or not the pinned version."""


def check_megatron_core(module_name: str = "megatron.core", required: str = MEGATRON_CORE_VERSION):
    """The imported megatron.core package, or MegatronCoreUnavailable saying how to install it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mcore = importlib.import_module(module_name)
    except ImportError as e:
        raise MegatronCoreUnavailable(f"megatron-core is not installed ({e}); {INSTALL_HINT}") from e
    version = getattr(mcore, "__version__", None)
    if public_version(version) != required:
        raise MegatronCoreUnavailable(f"megatron-core {version} is installed, not {required}; {INSTALL_HINT}")
    return mcore


def import_mcore(name: str):
    """Import a megatron.core submodule (after the version check), without the TE/apex warnings."""
    try:
        check_megatron_core()
    except MegatronCoreUnavailable as e:
        pytest.fail(str(e), pytrace=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


@pytest.fixture(scope="session")
def mcore_installed() -> str:
    """The pinned megatron-core's version, checked without importing it (importing takes seconds)."""
    import importlib.metadata
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"megatron-core is not installed; {INSTALL_HINT}", pytrace=False)
    if public_version(version) != MEGATRON_CORE_VERSION:
        pytest.fail(f"megatron-core {version} is installed, not {MEGATRON_CORE_VERSION}; {INSTALL_HINT}", pytrace=False)
    return version


@pytest.fixture(scope="session")
def mcore():
    """megatron.core, checked: a parity test FAILS (not skips) without the pinned megatron-core."""
    try:
        return check_megatron_core()
    except MegatronCoreUnavailable as e:
        pytest.fail(str(e), pytrace=False)
