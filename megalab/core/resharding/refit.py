"""Refit: the trainer's weights (laid out for training, tp·pp) into the inference model (its own layout).

    swap_model_weights(trainer chunks, engine or model)      collective over the world, every rank calls it

    1. agree          every rank says whether it can take part (an engine with requests in flight cannot):
                      all_gather_object, and if any rank cannot, EVERY rank raises the same error (no rank
                      is left waiting in a send that never comes)
    2. plan           build_local_reshard_plan (once; pass it back in as `plan` to skip the gather)
    3. move           execute_reshard_plan into staging buffers (gloo point-to-point, same-rank copies)
    4. install        only after EVERY rank says its receives completed (all_gather_object again): engine.update_weights (which refuses missing or
                      mis-shaped tensors) or a copy into the model's parameters; the engine's
                      weights_version goes up by one, so a stale engine is visible

Megatron: megatron/core/resharding/refit.py (swap_model_weights, its plan cache, refit_method "gloo").
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megalab.core.resharding.execution import RefitStats, execute_reshard_plan
from megalab.core.resharding.planner import ReshardError, build_local_reshard_plan
from megalab.core.resharding.utils import ReshardPlan, named_resolved_params


def _model_of(target):
    return target.model if hasattr(target, "update_weights") else target


def swap_model_weights(src_model, target, refit_method: str = "gloo", src_tp_group=None, dst_tp_group=None,
                       group=None, plan: ReshardPlan | None = None) -> tuple[RefitStats, ReshardPlan]:
    """Copy the trainer's weights into `target` (an InferenceEngine or a GPTModel; None on a rank without one).
    src_model: this rank's trainer chunks (GPTModel or list; None where this rank trains nothing).
    Returns this rank's RefitStats and the plan (reuse it for the next refit of the same pair)."""
    if refit_method != "gloo":
        raise ValueError(f"refit_method {refit_method!r}: only 'gloo' here (Megatron also has nccl, nvshmem, nixl)")
    start = time.perf_counter()
    problem = None
    if target is not None and hasattr(target, "has_unfinished_requests") and target.has_unfinished_requests():
        problem = (f"rank {dist.get_rank()}: the engine has requests in flight (their K/V comes from the old "
                   f"weights): finish or abort them before the refit")
    problems = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    if any(problems):
        raise RuntimeError("refit refused, no weight changed: " + "; ".join(p for p in problems if p))
    dst_model = _model_of(target) if target is not None else None
    if plan is None:
        plan = build_local_reshard_plan(src_model, dst_model, src_tp_group, dst_tp_group, group)
    src_params = {r: p for r, _, p in named_resolved_params(src_model)} if src_model is not None else {}
    dst_local = {r: (n, p) for r, n, p in named_resolved_params(dst_model)} if dst_model is not None else {}
    staging = {r: torch.empty_like(p, device="cpu") for r, (_, p) in dst_local.items()}
    stats, error = None, None
    try:
        stats = execute_reshard_plan(plan, src_params, staging, group)
        covered = {op.param_name for op in plan.recv_ops}
        if covered != set(staging):  # a plan for other models (a stale cached plan)
            raise ReshardError(f"the plan fills {len(covered)} of this rank's {len(staging)} parameters "
                               f"(missing {sorted(set(staging) - covered)[:3]}): rebuild it for these models")
    except Exception as exc:  # told to every rank below, then raised on every rank
        error = f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)  # install only if EVERY rank received everything
    if any(errors):
        raise ReshardError("refit failed, no weight changed: " + "; ".join(e for e in errors if e))
    if target is not None:
        install(target, {dst_local[r][0]: t for r, t in staging.items()})
    stats.seconds = time.perf_counter() - start
    return stats, plan


@torch.no_grad()
def install(target, new: dict[str, torch.Tensor]) -> None:
    """Put the received tensors (local name -> tensor) into the engine or model, all of them or none."""
    model = _model_of(target)
    if hasattr(target, "update_weights"):
        state = dict(model.state_dict())  # buffers and anything not refit stay as they are
        state.update(new)
        target.update_weights(state)
        return
    params = dict(model.named_parameters())
    wrong = [n for n, t in new.items() if params[n].shape != t.shape]
    if wrong:
        raise ReshardError(f"shape mismatch installing {wrong[:3]}")
    for n, t in new.items():
        params[n].copy_(t)
