"""Activation recomputation: keep a region's inputs, drop its insides, run it again in backward.

    forward:   x ──[ region, run without autograd ]──> y        keeps only x (and the RNG state)
    backward:  x ──[ region, run again WITH autograd ]──> y  then backprop dy through it

Megatron's version is `CheckpointFunction` / `tensor_parallel.checkpoint`
(megatron/core/tensor_parallel/random.py). It restores the random-number state before the
second run, so dropout draws the same masks and the gradients are identical to not recomputing.

`SavedTensorsMeter` measures what autograd keeps for backward, with
torch.autograd.graph.saved_tensors_hooks: every tensor the forward saves passes through a hook.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function: Callable, *args):
        ctx.run_function = run_function
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


