"""An endless loop becomes a verdict with its line (megalab/lab/cpu_guard.py), counted in CPU time, not wall time."""

import time

import pytest

from megalab.lab.cpu_guard import EndlessLoop, cpu_limit


def test_an_endless_loop_is_stopped_at_its_line_and_sleeping_is_not():
    with pytest.raises(EndlessLoop, match=r"still running after 0.3 s of CPU time at .*test_cpu_guard.py:\d+"):
        with cpu_limit(0.3):
            n = 0
            while n >= 0:  # the learner's loop whose counter never goes the other way
                n += 1
    with cpu_limit(0.3):
        time.sleep(0.6)  # waiting (a rank in a recv, a loaded machine) uses no CPU: never stopped
    with cpu_limit(None):
        pass


def test_a_learner_except_exception_does_not_swallow_it():
    with pytest.raises(EndlessLoop):
        with cpu_limit(0.2):
            while True:
                try:
                    sum(range(1000))
                except Exception:  # noqa: BLE001 - what a learner might write
                    pass
