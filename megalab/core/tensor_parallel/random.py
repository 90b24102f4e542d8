"""Random-number streams for model parallelism, and activation recomputation.

RNG streams (Megatron: model_parallel_cuda_manual_seed / get_cuda_rng_tracker). After
`model_parallel_cuda_manual_seed(seed)` a rank has

    the default generator       seed                  the same on every TP rank: dropout on REPLICATED
                                                      activations (hidden dropout without sequence
                                                      parallelism) must draw the same mask on all of them
    "model-parallel-rng"        seed + 2718 + tp_rank  different on every TP rank: dropout on SPLIT
                                                      activations (attention heads split over TP, the
                                                      sequence slices of sequence parallelism)
    "expert-parallel-rng"       seed + 1024 + 100 ep_rank + etp_rank

and code that works on a TP split draws inside `with get_cuda_rng_tracker().fork(): ...`.
The training loop seeds with seed + 100 * pp_rank (megatron/training/initialize.py
`_set_random_seed`), so every TP, CP and DP rank of a pipeline stage shares the default stream.
Megatron tracks only CUDA generators (its dropout runs on GPUs); here the CPU generator is tracked
too, as megalab trains on CPUs, and `fork` is a no-op until a seed is set (one process: one stream).

Activation recomputation: keep a region's inputs, drop its insides, run it again in backward.

    forward:   x ──[ region, run without autograd ]──> y        keeps only x (and the RNG state)
    backward:  x ──[ region, run again WITH autograd ]──> y  then backprop dy through it

Megatron's version is `CheckpointFunction` / `tensor_parallel.checkpoint`
(megatron/core/tensor_parallel/random.py). It restores the random-number state before the
second run (the tracker's streams too), so dropout draws the same masks and the gradients are
identical to not recomputing.

`SavedTensorsMeter` measures what autograd keeps for backward, with
torch.autograd.graph.saved_tensors_hooks: every tensor the forward saves passes through a hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"


def _get_rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the CPU generator's state, the current CUDA device's or None)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


class CudaRNGStatesTracker:
    """Named generator states: `add(name, seed)` creates one, `fork(name)` runs a block on it and keeps
    where it got to, leaving the default generator as it was (Megatron's class of this name)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, tuple] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def get_states(self) -> dict[str, tuple]:
        """A copy of the name -> state map (fork replaces states, never changes them in place)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, tuple]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = _get_rng_state()
        torch.default_generator.manual_seed(seed)  # the CPU generator only (torch.manual_seed seeds CUDA too)
        if orig[1] is not None:
            torch.cuda.manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from stream `name` inside the block; a no-op before any seed is set (one process, one stream)."""
        if not self.states_:
            yield
            return
        if name not in self.states_:
            raise ValueError(f"rng state {name} is not added")
        orig = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(orig)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """This process's tracker (Megatron's name; here it tracks the CPU generator too)."""
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """Seed the tracker's streams from `seed` (see the module docstring), and the CUDA default generator
    with `seed`, as Megatron's function of this name (the caller seeds the CPU one: torch.manual_seed).
    Megatron reads the ranks from parallel_state; here they are arguments."""
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    _CUDA_RNG_STATE_TRACKER.reset()
    _CUDA_RNG_STATE_TRACKER.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)  # 2718: Megatron's offset
    _CUDA_RNG_STATE_TRACKER.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


def _with_tracker_states(run_function: Callable, states: dict[str, tuple]) -> Callable:
    """run_function, run with the tracker's streams as `states` (restored to the current ones afterwards)."""
    def run(*args):
        tracker = get_cuda_rng_tracker()
        current = tracker.get_states()
        tracker.set_states(states)
        try:
            return run_function(*args)
        finally:
            tracker.set_states(current)
    return run


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function: Callable, *args):
        # the replay in backward runs with the tracker's streams as they are now (Megatron: _get_all_rng_states)
        ctx.run_function = _with_tracker_states(run_function, get_cuda_rng_tracker().get_states())
        ctx.cpu_rng_state = torch.get_rng_state()
        ctx.cuda_devices = sorted({a.device.index for a in args if torch.is_tensor(a) and a.is_cuda})
        ctx.cuda_rng_states = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.tensor_indices = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.non_tensor_args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(a for a in args if torch.is_tensor(a)))  # the only activations kept
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        # EXERCISE model.recompute: re-run the region with the forward's RNG state and autograd on, backprop through it
        ### BEGIN SOLUTION
        # HINT 1: backward must rebuild the graph forward threw away: run run_function again on the saved inputs, with
        #         autograd on and the random state the forward started from, then backprop grad_outputs through it.
        # HINT 2: Detach the saved tensors (keeping requires_grad); inside
        #         torch.random.fork_rng(devices=ctx.cuda_devices) restore ctx.cpu_rng_state (and the CUDA states)
        #         and re-run under torch.enable_grad; torch.autograd.backward the outputs that require grad; return
        #         None for run_function, then each argument's .grad (None for non-tensors).
        # HINT 3: backward runs with grad mode off; and fork_rng puts the RNG back when it exits, so the replay
        #         leaves the random draws that follow untouched.
        args = list(ctx.non_tensor_args)
        for i, saved in zip(ctx.tensor_indices, ctx.saved_tensors):
            args[i] = saved.detach().requires_grad_(saved.requires_grad)
        with torch.random.fork_rng(devices=ctx.cuda_devices):  # leaves the RNG as it was afterwards
            torch.set_rng_state(ctx.cpu_rng_state)
            for device, state in zip(ctx.cuda_devices, ctx.cuda_rng_states):
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad():
                outputs = ctx.run_function(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [args[i].grad if i in ctx.tensor_indices else None for i in range(len(args))]
        return (None, *grads)
        ### END SOLUTION


def checkpoint(function: Callable, *args):
    """function(*args), keeping only args for backward and recomputing the rest there."""
    return CheckpointFunction.apply(function, *args)


