"""Loss scalers for fp16 training: constant, or dynamic (grow after clean steps, back off on inf/NaN).

Megatron: megatron/core/optimizer/grad_scaler.py (MegatronGradScaler, ConstantGradScaler, DynamicGradScaler).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class MegatronGradScaler(ABC):
    """The loss scale and its inverse; `update(found_inf)` after every step (Megatron's base class)."""

    def __init__(self, initial_scale: float):
        if not initial_scale > 0.0:
            raise ValueError(f"initial_scale must be > 0, got {initial_scale}")
        self._scale = torch.tensor(float(initial_scale))

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool) -> None: ...

    def state_dict(self) -> dict:
        return {"scale": self._scale}

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = state_dict["scale"].clone()


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (Megatron's --loss-scale): overflowing steps are still skipped."""

    def update(self, found_inf: bool) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Megatron's dynamic loss scale.

    Overflow: the growth count restarts and the hysteresis count drops by one; once it reaches 0
    the scale is multiplied by `backoff_factor` (never below `min_scale`) -- on every further
    overflow too, until the next growth. `growth_interval` clean steps in a row: the scale is
    multiplied by `growth_factor` and the hysteresis count is refilled. Megatron's defaults
    (--initial-loss-scale 2^32, --min-loss-scale 1, --loss-scale-window 1000, --hysteresis 2).
    """

    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        super().__init__(initial_scale)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(f"need 0 < min_scale <= initial_scale, got min_scale={min_scale}, initial_scale={initial_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"growth_interval and hysteresis must be >= 1, got {growth_interval} and {hysteresis}")
        self.min_scale = torch.tensor(float(min_scale))
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        # EXERCISE mixed_precision.dynamic_update: back off after `hysteresis` overflows, grow after `growth_interval` clean steps
        ### BEGIN SOLUTION
        # HINT 1: Two counters drive the scale: clean steps in a row (growth) and overflows still
        #         tolerated (hysteresis). The scale grows only after growth_interval clean steps IN A ROW, and backs off
        #         only once the hysteresis is used up.
        # HINT 2: On an overflow: restart the growth count, take one from the hysteresis count, and
        #         once it is <= 0 multiply the scale by backoff_factor, never below min_scale. On a clean step: count
        #         it; at growth_interval clean steps, reset it, refill the hysteresis, multiply by growth_factor.
        # HINT 3: Grow after growth_interval clean steps, not on every clean step, and an overflow must send
        #         the growth count back to 0.
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor
        ### END SOLUTION

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]
