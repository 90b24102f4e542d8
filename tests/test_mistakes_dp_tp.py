"""The sweep of chapter 03's data- and tensor-parallel mistakes (tests/test_mistakes.py has the rest): each is
a 2-process launch, so it is a test file of its own and `make test`'s two workers share the whole sweep."""

import pytest

from tests.test_mistakes import SLOW, pytestmark, sweep  # noqa: F401  (pytestmark: the reference only)


@pytest.mark.slow
@pytest.mark.parametrize("path", SLOW)
def test_every_mistake_is_caught_and_named(path, tmp_path):
    sweep(path, tmp_path)
