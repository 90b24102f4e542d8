"""The sweep of chapter 03's mistakes and the bug hunt's (tests/test_mistakes.py has the rest): about half of the
whole sweep's time, so a test file of its own and `make test`'s two workers share the sweep."""

import pytest

from tests.test_mistakes import SLOW, pytestmark, sweep  # noqa: F401  (pytestmark: the reference only)


@pytest.mark.slow
@pytest.mark.parametrize("path", SLOW)
def test_every_mistake_is_caught_and_named(path, tmp_path):
    sweep(path, tmp_path)
