"""The resharding plan: which source rank sends which slice of which parameter to which destination rank.

    every rank: its metadata (shape, TP group, partition dim, global name) ──all_gather_object──> the rosters
    every rank: replay ONE deterministic schedule over the rosters, keep only its own sends and receives

    the schedule   for each destination rank (ascending), each of its parameters (in its order):
                   pick a source replica, tile the TP dimension (LCM tiling), one op per tile, task_id += 1

LCM tiling: the full TP dimension of length F is cut into L = lcm(src_tp · src_stride, dst_tp · dst_stride)
units; a unit lies inside exactly one source shard and one destination shard, so each unit is one copy
(neighbouring units of the same pair are merged into one slice). tp2 -> tp1: the engine rank receives
the two halves; tp2 -> tp2 (same groups): each rank copies its own shard locally, nothing on the wire.

Because every rank replays the same schedule, a send and its receive get the same task_id with no
coordinator, and the receiver posts its receives in the order the sender sends them.

Megatron: megatron/core/resharding/planner.py (build_local_reshard_plan, _iter_global_transfer_ops,
_emit_lcm_block_ops, _finalize_dp_transfers). Ours checks more before any byte moves: the two models'
architectures (SIGNATURE_FIELDS), every name, every full shape, each refused with its cause.
"""

from __future__ import annotations

import math

import torch.distributed as dist

from megalab.core.resharding.utils import ParameterMetadata, ReshardPlan, TransferOp, extract_param_metadata

_CAUSES = {"vocab_size": "padded vocabularies differ (vocab_size_with_padding depends on the TP size)",
           "num_attention_heads": "attention heads differ", "num_query_groups": "query groups (GQA) differ",
           "kv_channels": "head dimensions differ", "num_layers": "the number of layers differs",
           "hidden_size": "hidden sizes differ", "ffn_hidden_size": "MLP sizes differ"}


class ReshardError(ValueError):
    """The two models cannot exchange weights (raised before any byte moves: nothing is half-copied)."""


def full_shape(meta: ParameterMetadata) -> tuple[int, ...]:
    shape = list(meta.shape)
    if meta.is_tp:
        shape[meta.partition_dim] *= len(meta.tensor_parallel_group_ranks)
    return tuple(shape)


def check_signatures(src_signatures: list[dict], dst_signatures: list[dict]) -> None:
    """Every source and destination rank must describe the same architecture."""
    for side, sigs in (("trainer", src_signatures), ("engine", dst_signatures)):
        if any(s != sigs[0] for s in sigs):
            raise ReshardError(f"the {side}'s ranks disagree about the model: {sigs}")
    src, dst = src_signatures[0], dst_signatures[0]
    wrong = [f for f in src if src[f] != dst.get(f)]
    if wrong:
        raise ReshardError("refit between incompatible models: " + "; ".join(
            f"{f} {src[f]} (trainer) vs {dst.get(f)} (engine)" + (f": {_CAUSES[f]}" if f in _CAUSES else "")
            for f in wrong))


def lcm_tiles(full_len: int, src_world: int, src_stride: int, dst_world: int, dst_stride: int,
              dst_local_rank: int, name: str) -> list[tuple[int, int, int, int]]:
    """(source TP rank, start in its shard, start in the destination shard, length) covering the destination
    shard `dst_local_rank` of a dimension of full length `full_len`, merged where contiguous.

    With stride k a dimension is k concatenated parts and a TP rank holds its slice of each part, so its
    local segment j is the full dimension's segment j·world + rank (Megatron's partition_stride).
    """
    ns, nd = src_world * src_stride, dst_world * dst_stride
    lcm = math.lcm(ns, nd)
    if full_len % lcm:
        raise ReshardError(f"{name}: length {full_len} of its TP dimension is not divisible by lcm({ns}, {nd})")
    # EXERCISE resharding.lcm_tiles: cut the dimension into lcm units; for each unit of this destination shard, its source rank and offsets; merge neighbours
    ### BEGIN SOLUTION
    # HINT 1: With stride k and world w the full dimension is k·w segments, and segment s lives on TP rank s % w, as
    #         that rank's local segment s // w. Cut the dimension into `lcm` equal units: every unit then lies inside
    #         one source segment and one destination segment, so it is one copy. Each unit's answer is a tuple
    #         (source TP rank, start in that rank's LOCAL shard, start in the destination's local shard, length).
    # HINT 2: A unit is full_len / lcm elements; a source segment holds lcm // ns units, a destination segment
    #         lcm // nd. Walk the destination's units in its local order (its segments k = 0 .. dst_stride - 1,
    #         each of them unit by unit): a unit's index in the full dimension gives its source segment, and that
    #         segment gives the source rank and where the segment starts in that rank's shard.
    # HINT 3: Merge a unit into the previous tile when it comes from the same source rank and continues the
    #         previous tile on BOTH sides (source start + length == its source start, and the same for the
    #         destination): tp2 -> tp1 at stride 1 is two tiles, one per source rank, not lcm of them.
    unit = full_len // lcm
    per_src, per_dst = lcm // ns, lcm // nd  # units per source segment, per destination segment
    tiles: list[list[int]] = []
    for k in range(dst_stride):
        for off in range(per_dst):
            g = (k * dst_world + dst_local_rank) * per_dst + off  # the unit's index in the full dimension
            seg = g // per_src
            src_rank, src_start = seg % src_world, ((seg // src_world) * per_src + g % per_src) * unit
            dst_start = (k * per_dst + off) * unit
            last = tiles[-1] if tiles else None
            if last and last[0] == src_rank and last[1] + last[3] == src_start and last[2] + last[3] == dst_start:
                last[3] += unit
            else:
                tiles.append([src_rank, src_start, dst_start, unit])
    return [tuple(t) for t in tiles]
    ### END SOLUTION


def _select_source(candidates: list[ParameterMetadata], dst_rank: int) -> list[ParameterMetadata]:
    """One replica of the parameter: its TP shards in TP order (the one on dst_rank itself if any, else
    round-robin over the replicas by destination rank, as Megatron's select_src_metadata_balanced)."""
    replicas: dict[tuple[int, ...], list[ParameterMetadata]] = {}
    for m in sorted(candidates, key=lambda m: m.owner_rank):
        replicas.setdefault(tuple(m.tensor_parallel_group_ranks), []).append(m)
    keys = sorted(replicas)
    local = [k for k in keys if dst_rank in k]
    key = local[0] if local else keys[dst_rank % len(keys)]
    by_owner = {m.owner_rank: m for m in replicas[key]}
    return [by_owner[r] for r in key]


def iter_global_transfer_ops(src_by_rank: dict[int, dict[str, ParameterMetadata]],
                             dst_by_rank: dict[int, dict[str, ParameterMetadata]]):
    """Yield (task_id, dst_rank, src_rank, src_meta, dst_meta, src_slice, dst_slice) for the whole refit, in the
    same order on every rank. Refuses (ReshardError) a missing parameter or a full-shape mismatch first."""
    sources: dict[str, list[ParameterMetadata]] = {}
    for rank in sorted(src_by_rank):
        for resolved, meta in src_by_rank[rank].items():
            sources.setdefault(resolved, []).append(meta)
    dst_names = {n for metas in dst_by_rank.values() for n in metas}
    missing_src = [n for n in dst_names if n not in sources]
    missing_dst = [n for n in sources if n not in dst_names]
    if missing_src or missing_dst:
        raise ReshardError(f"the models' parameters differ: the trainer lacks {sorted(missing_src)[:4]}, the engine "
                           f"lacks {sorted(missing_dst)[:4]} (another architecture, or a pipeline stage's layers "
                           f"not mapped to their global numbers)")
    for dst_rank in sorted(dst_by_rank):
        for resolved, dst in dst_by_rank[dst_rank].items():
            for src in sources[resolved]:
                if full_shape(src) != full_shape(dst):
                    raise ReshardError(f"{resolved}: full shape {full_shape(src)} on the trainer vs {full_shape(dst)} "
                                       f"on the engine (vocab padding? heads? TP size?)")
    task_id = 0
    for dst_rank in sorted(dst_by_rank):
        for resolved, dst in dst_by_rank[dst_rank].items():
            replica = _select_source(sources[resolved], dst_rank)
            ndim = len(dst.shape)
            if not replica[0].is_tp and not dst.is_tp:  # replicated on both sides: one full copy
                full = (slice(None),) * ndim
                yield task_id, dst_rank, replica[0].owner_rank, replica[0], dst, full, full
                task_id += 1
                continue
            tp_meta = replica[0] if replica[0].is_tp else dst
            dim, stride = tp_meta.partition_dim, tp_meta.partition_stride
            if dst.is_tp and replica[0].is_tp and (dst.partition_dim, dst.partition_stride) != (dim, stride):
                raise ReshardError(f"{resolved}: split along dim {dim} (stride {stride}) on the trainer, dim "
                                   f"{dst.partition_dim} (stride {dst.partition_stride}) on the engine")
            dst_ranks = dst.tensor_parallel_group_ranks if dst.is_tp else [dst_rank]
            for src_i, src_start, dst_start, n in lcm_tiles(
                    full_shape(dst)[dim], len(replica), stride, len(dst_ranks), stride,
                    dst_ranks.index(dst_rank), resolved):
                src_slice = [slice(None)] * ndim
                dst_slice = [slice(None)] * ndim
                src_slice[dim], dst_slice[dim] = slice(src_start, src_start + n), slice(dst_start, dst_start + n)
                src = replica[src_i]
                yield task_id, dst_rank, src.owner_rank, src, dst, tuple(src_slice), tuple(dst_slice)
                task_id += 1


def _numel(shape: tuple[int, ...], slices: tuple[slice, ...]) -> int:
    return math.prod(len(range(*s.indices(n))) for n, s in zip(shape, slices))


def build_plan_from_rosters(src_by_rank, dst_by_rank, my_rank: int, src_signatures=None,
                            dst_signatures=None) -> ReshardPlan:
    """This rank's plan from everyone's metadata (a pure function: every rank computes the same schedule)."""
    if src_signatures is not None:
        check_signatures(src_signatures, dst_signatures)
    plan = ReshardPlan(send_ops=[], recv_ops=[], rank=my_rank)
    for task_id, dst_rank, src_rank, src, dst, src_slice, dst_slice in iter_global_transfer_ops(
            src_by_rank, dst_by_rank):
        nbytes = _numel(dst.shape, dst_slice) * dst.element_size
        if src_rank == my_rank:
            plan.send_ops.append(TransferOp(src.resolved_name, dst_rank, True, src_slice, dst_slice, task_id, nbytes, dst.dtype))
        if dst_rank == my_rank:
            plan.recv_ops.append(TransferOp(dst.resolved_name, src_rank, False, dst_slice, src_slice, task_id, nbytes, dst.dtype))
    return plan


def build_local_reshard_plan(src_model, dst_model, src_tp_group=None, dst_tp_group=None, group=None) -> ReshardPlan:
    """Collective over `group` (default: the world): gather every rank's metadata, build this rank's plan.
    src_model / dst_model: this rank's trainer chunks (a GPTModel or a list) and engine model, or None where this
    rank holds none. Megatron: build_local_reshard_plan (planner.py)."""
    rank = dist.get_rank()
    mine = (extract_param_metadata(src_model, rank, src_tp_group) if src_model is not None else None,
            extract_param_metadata(dst_model, rank, dst_tp_group) if dst_model is not None else None,
            _signature(src_model), _signature(dst_model))
    world = dist.get_world_size(group)
    rosters = [None] * world
    dist.all_gather_object(rosters, mine, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    src_by_rank = {r: ro[0] for r, ro in zip(ranks, rosters) if ro[0] is not None}
    dst_by_rank = {r: ro[1] for r, ro in zip(ranks, rosters) if ro[1] is not None}
    src_sigs = [ro[2] for ro in rosters if ro[2] is not None]
    dst_sigs = [ro[3] for ro in rosters if ro[3] is not None]
    if not src_by_rank or not dst_by_rank:
        raise ReshardError("no rank holds the " + ("trainer's" if not src_by_rank else "engine's") + " model")
    return build_plan_from_rosters(src_by_rank, dst_by_rank, rank, src_sigs, dst_sigs)


def _signature(model):
    if model is None:
        return None
    from megalab.core.resharding.utils import model_signature
    first = model[0] if isinstance(model, (list, tuple)) else model
    return model_signature(first.config)
