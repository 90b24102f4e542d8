"""Typical wrong answers to the exercises of chapters 06 (advanced) and 07 (projects), as mutants.

`python -m megalab.lab.mutants --file tests/mistakes/ch06_ch07.py` swaps each `code` in for its exercise's
region and checks that the exercise's first failing test names the mistake (its verdict contains `says`).
"""

from tests.mistakes import Mistake

MISTAKES = [
    # ------------------------------------------------------------------ 06·01 mixed precision
    Mistake("mixed_precision.dynamic_update", "grew the scale on every clean step", says="on every clean step", code="""
if found_inf:
    self._growth_tracker = 0
    self._hysteresis_tracker -= 1
    if self._hysteresis_tracker <= 0:
        self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
else:
    self._scale = self._scale * self.growth_factor
"""),
    Mistake("mixed_precision.dynamic_update", "kept the growth count through an overflow",
            says="did not restart the growth count", code="""
if found_inf:
    self._hysteresis_tracker -= 1
    if self._hysteresis_tracker <= 0:
        self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
else:
    self._growth_tracker += 1
    if self._growth_tracker == self.growth_interval:
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis
        self._scale = self._scale * self.growth_factor
"""),
    Mistake("mixed_precision.dynamic_update", "backed off on every overflow (no hysteresis)", says="hysteresis",
            code="""
if found_inf:
    self._growth_tracker = 0
    self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
else:
    self._growth_tracker += 1
    if self._growth_tracker == self.growth_interval:
        self._growth_tracker = 0
        self._scale = self._scale * self.growth_factor
"""),
    Mistake("mixed_precision.unscale", "multiplied by the loss scale instead of 1/scale", says="divided by inv_scale",
            code="""
found_inf = False
for g in grads:
    g.div_(inv_scale)
    found_inf |= not bool(torch.isfinite(g).all())
return found_inf
"""),
    Mistake("mixed_precision.unscale", "unscaled a copy, not the grads in place", says="not the gradients in place",
            code="""
found_inf = False
for g in grads:
    g = g * inv_scale
    found_inf |= not bool(torch.isfinite(g).all())
return found_inf
"""),
    Mistake("mixed_precision.unscale", "checked for inf only, not NaN", says="inf only", code="""
found_inf = False
for g in grads:
    g.mul_(inv_scale)
    found_inf |= bool(torch.isinf(g).any())
return found_inf
"""),
    Mistake("mixed_precision.unscale", "only the last grad's inf/NaN counts", says="only the last gradient counts",
            code="""
found_inf = False
for g in grads:
    g.mul_(inv_scale)
    found_inf = not bool(torch.isfinite(g).all())
return found_inf
"""),
]
