"""Sharded, reshardable, atomic checkpoints with torch.distributed.checkpoint (DCP).

Every tensor is saved under its GLOBAL name and full shape, the way the unsplit model names it,
so any tp/pp/dp layout can load it (Megatron's dist_checkpointing: a ShardedTensor knows its
global key and offset). TP slices are gathered to the full tensor (a gated linear_fc1 slice is
[gate_r; up_r]: its `partition_stride` 2 says to reassemble [gate; up]); DCP's planner then picks ONE
writer per key, so the pipeline stages (and DP replicas) write disjoint parts in parallel:

    tp2·pp2 save:  rank 0,1 (stage 0) -> layers 0-1 (+ embedding)    one file per rank, one
                   rank 2,3 (stage 1) -> layers 2-3 (+ output layer)  .metadata for the lot
    tp1·pp4 load:  rank k reads layers k (any file), slices nothing; tp2 load slices its half

On disk (Megatron's folder names and tracker file; common.pt and the .tmp rename below are ours):

    save_dir/latest_checkpointed_iteration.txt       "20"  (written last, atomically)
    save_dir/iter_0000020/  __0_0.distcp ... .metadata  (DCP: model, optimizer, per-rank RNG and RNG-tracker streams)
                            common.pt                   (iteration, consumed samples, scheduler,
                                                         model config; torch.load(weights_only=True))

The distributed optimizer's AdamW state is sharded over DP as flat ranges; it is gathered per
parameter before the save and each rank keeps its range after the load, so the optimizer state, too,
loads at any layout (or into a plain AdamW): Megatron's "fully_reshardable" format
(--dist-ckpt-optim-fully-reshardable); its default, "dp_reshardable", saves the flat buckets and
reshards over DP only.

Atomic: every rank writes into iter_0000020.tmp; only when all finished does rank 0 rename it
and then replace the tracker. A crash mid-save leaves a .tmp folder that loading never reads.
Megatron (since 2026-07) stores the non-sharded state as one "common_state" object inside the DCP
files (a common.pt is only read from older checkpoints), writes straight into iter_0000020/, ends
with metadata.json and only then writes the tracker (rank 0).

Checked on load, never modified: a missing or truncated shard, a damaged .metadata or common.pt, a
missing tracker beside iter_* folders, a checkpoint of another model: each is a CheckpointError
naming the file, on every rank. With checksums=True (the default) the CRC32 of every shard goes into
common.pt at save (the ranks hash their share of the files in parallel, ~3.7 GB/s per core here) and
is verified at load, so bit rot inside a shard is caught too. DCP keeps none; Megatron's training loop
keeps none either, though megatron.core.dist_checkpointing.save(verify_integrity=True) writes a SHA-256
manifest that load(verify_integrity=True) checks.

Megatron-LM: megatron/training/checkpointing.py (`save_checkpoint`, `load_checkpoint`,
`get_checkpoint_tracker_filename`, `read_metadata`), megatron/core/dist_checkpointing/.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from megalab.core import parallel_state as ps
from megalab.core.optimizer.distrib_optimizer import DistributedOptimizer
from megalab.core.tensor_parallel.layers import tensor_parallel_dims
from megalab.core.tensor_parallel.random import get_cuda_rng_tracker

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: missing, incomplete, corrupt or from another model."""


def checkpoint_dir(save_dir: str | Path, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def read_tracker(load_dir: str | Path) -> int | None:
    """The iteration named in the tracker file, or None if the folder holds no checkpoint yet."""
    tracker = Path(load_dir) / TRACKER
    if not tracker.exists():
        saved = sorted(p.name for p in Path(load_dir).glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))
        if saved:  # checkpoints without the file that says which one is complete: never guess, never start over
            raise CheckpointError(f"{tracker} is missing, but {load_dir} holds {', '.join(saved)}: write the iteration "
                                  f"to load into it (e.g. {int(saved[-1][5:])}) or pass iteration=")
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} should hold an iteration number, found {text!r}: fix or delete the file")
    return int(text)


# ------------------------------------------------------------------ TP slices <-> full tensors
def _gather_tp(tensor: torch.Tensor, dim: int | None, tp_group, stride: int = 1) -> torch.Tensor:
    """The full tensor from every TP rank's slice along `dim` (dim None: replicated, returned as is).

    stride k: the full tensor is k concatenated parts and each slice holds its share of every part
    (a gated linear_fc1: rank r holds [gate_r; up_r], the full tensor is [gate; up]).
    """
    if dim is None or tp_group is None or dist.get_world_size(tp_group) == 1:
        return tensor.detach()
    slices = [torch.empty_like(tensor) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(slices, tensor.detach().contiguous(), group=tp_group)
    parts = zip(*(s.chunk(stride, dim) for s in slices))  # part k of every rank's slice
    return torch.cat([torch.cat(part, dim) for part in parts], dim)


def _tp_slice(full: torch.Tensor, dim: int | None, tp_group, stride: int = 1) -> torch.Tensor:
    """This TP rank's slice of a full tensor along `dim` (with stride k: its share of each of k parts)."""
    if dim is None or tp_group is None or dist.get_world_size(tp_group) == 1:
        return full
    t, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    return torch.cat([part.chunk(t, dim)[rank] for part in full.chunk(stride, dim)], dim)


def _owned(model: nn.Module, params: list[nn.Parameter]) -> dict[str, nn.Parameter]:
    """Global name -> parameter for the parameters this rank holds (its pipeline stages)."""
    ids = {id(p) for p in params}
    return {name: p for name, p in model.named_parameters() if id(p) in ids}


def _parameter_state(optimizer, params: list[nn.Parameter]) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
    """Each parameter's optimizer state, shaped like the parameter (collective for a DistributedOptimizer:
    its DP shards are gathered into parameter shapes, as Megatron's "fully_reshardable" format does, so any
    layout can load it)."""
    if isinstance(optimizer, DistributedOptimizer):
        init_optimizer_state(optimizer.optimizer)
        return optimizer.get_parameter_state()
    init_optimizer_state(optimizer)
    return {p: optimizer.state[p] for p in params}


def _global_state(model, params, opt_state, tp_group, full: bool) -> dict[str, torch.Tensor]:
    """The DCP state dict of this rank: model.<name> and optimizer.<name>.<key>, full tensors.

    opt_state: _parameter_state's dict. full=True gathers the live values (save); full=False
    allocates empty full-shape tensors (load).
    """
    dims = tensor_parallel_dims(model)
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    state = {}
    for name, p in _owned(model, params).items():
        dim = dims.get(name)
        entries = {f"model.{name}": p}
        entries.update({f"optimizer.{name}.{k}": v for k, v in opt_state[p].items()})
        stride = getattr(p, "partition_stride", 1)
        for key, t in entries.items():
            split = dim if t.ndim > 0 else None
            if full:
                state[key] = _gather_tp(t, split, tp_group, stride).clone()
            else:
                shape = list(t.shape)
                if split is not None:
                    shape[split] *= tp
                state[key] = torch.empty(shape, dtype=t.dtype)
    return state


def full_state_dict(model, params, optimizer, tp_group) -> dict[str, torch.Tensor]:
    """Collective: this rank's model.<name> and optimizer.<name>.<key> entries as full (TP- and DP-gathered)
    tensors, what save_checkpoint writes. Gathering them all onto one rank is the unsharded baseline."""
    return _global_state(model, params, _parameter_state(optimizer, params), tp_group, full=True)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam's state (step, exp_avg, exp_avg_sq) before the first step, so a checkpoint can fill it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def _tracker_states(cuda_rng: bool) -> dict[str, torch.Tensor]:
    """This rank's RNG-tracker streams as {"rng_tracker.<name>": CPU state, "cuda_rng_tracker.<name>": ...}."""
    out = {}
    for name, (cpu, cuda) in get_cuda_rng_tracker().get_states().items():
        out[f"rng_tracker.{name}"] = cpu.clone()
        if cuda_rng and cuda is not None:
            out[f"cuda_rng_tracker.{name}"] = cuda.clone()
    return out


def _on_cuda(params: list[nn.Parameter]) -> bool:
    """Whether this rank trains on a GPU (then its CUDA generator is saved and restored with the CPU one)."""
    return torch.cuda.is_available() and any(p.is_cuda for p in params)


# ------------------------------------------------------------------ save
def commit_checkpoint(tmp: Path, save_dir: str | Path, iteration: int) -> Path:
    """Publish a fully written tmp folder as iter_<iteration> and point the tracker at it (rank 0 only)."""
    final, tracker = checkpoint_dir(save_dir, iteration), Path(save_dir) / TRACKER
    # EXERCISE checkpoint.commit: rename tmp to final (replacing an old one), then replace the tracker atomically
    ### BEGIN SOLUTION
    # HINT 1: The idea. A resumed run trusts the tracker: it may only ever name a checkpoint that is complete on
    #         disk, and it must never be read half-written, whenever the process dies.
    # HINT 2: The approach. Publish the data first: remove an older `final` of the same iteration, then os.rename
    #         tmp to final (atomic on one file system). Only then write the iteration number to a temporary file
    #         beside the tracker and os.replace it onto the tracker.
    # HINT 3: A pitfall. shutil.move into an existing directory nests tmp inside it; and writing the tracker in
    #         place can leave it empty if the process dies mid-write.
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)  # atomic on one file system: the folder exists whole or not at all
    tracker.with_suffix(".tmp").write_text(str(iteration))
    os.replace(tracker.with_suffix(".tmp"), tracker)  # readers see the old or the new number, never half
    ### END SOLUTION
    return final


def save_checkpoint(save_dir: str | Path, iteration: int, model: nn.Module, params: list[nn.Parameter],
                    optimizer: torch.optim.Optimizer, scheduler, consumed_samples: int, tp_group=None,
                    checksums: bool = True) -> Path:
    """Collective: save model, optimizer, RNG and data position of `iteration` (see the module docstring).

    params: the parameters this rank holds (its stages); model: the full model they belong to.
    tp_group: the current state's tensor-parallel group unless given (none when no state is current).
    checksums: record every shard's CRC32 in common.pt, verified at load (costs one read of each file).
    """
    tp_group = ps.resolve_group(tp_group, "tp")
    rank = dist.get_rank()
    final = checkpoint_dir(save_dir, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt
        tmp.mkdir(parents=True)
    dist.barrier()
    state = full_state_dict(model, params, optimizer, tp_group)
    state[f"rng.rank{rank}"] = torch.get_rng_state()
    cuda_rng = _on_cuda(params)
    if cuda_rng:  # this rank's GPU generator too (a CPU uint8 tensor, stored like the CPU one)
        state[f"cuda_rng.rank{rank}"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    tracker = _tracker_states(cuda_rng)  # the RNG tracker's streams (Megatron: rng_tracker_states)
    state.update({f"{key}.rank{rank}": value for key, value in tracker.items()})
    metadata = dcp.save(state, checkpoint_id=tmp)
    sums = _checksum_files(tmp, _shard_files(metadata)) if checksums else None
    if rank == 0:
        common = {"iteration": iteration, "consumed_samples": consumed_samples, "scheduler": scheduler.state_dict(),
                  "model_config": dataclasses.asdict(model.config), "world_size": dist.get_world_size(),
                  "cuda_rng": cuda_rng, "rng_tracker": sorted(tracker)}
        if sums is not None:
            common["checksums"] = {"algorithm": "crc32", "files": sums}
        torch.save(common, tmp / "common.pt")
        commit_checkpoint(tmp, save_dir, iteration)
    dist.barrier()
    return final


# ------------------------------------------------------------------ shard files and their checksums
def _shard_files(metadata) -> list[str]:
    """The data files a DCP checkpoint's metadata points into (relative names, sorted)."""
    return sorted({info.relative_path for info in metadata.storage_data.values()})


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _my_share(files: list[str], no_dist: bool) -> list[str]:
    """This rank's share of the files (all of them without a process group): hashing runs in parallel."""
    return files if no_dist or not dist.is_initialized() else files[dist.get_rank()::dist.get_world_size()]


def _checksum_files(path: Path, files: list[str], no_dist: bool = False) -> dict[str, str]:
    """{file: CRC32} of every file, each rank hashing its share; collective unless no_dist."""
    mine = {name: _crc32(path / name) for name in _my_share(files, no_dist)}
    if no_dist or not dist.is_initialized():
        return mine
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {name: crc for part in parts for name, crc in sorted(part.items())}


def _same_verdict(problem: str | None, no_dist: bool) -> None:
    """Raise the first rank's problem on every rank (so no rank goes on into a collective alone)."""
    if not no_dist and dist.is_initialized():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    if problem:
        raise CheckpointError(problem)


def check_shards(path: Path, metadata, checksums: dict | None = None, no_dist: bool = False) -> None:
    """Every shard the metadata points into exists and is long enough, and (given checksums) still has
    the CRC32 it was saved with. Collective unless no_dist; a CheckpointError naming the file on every rank."""
    problem = None
    for index, info in metadata.storage_data.items():
        shard = path / info.relative_path
        if not shard.exists():
            problem = f"{shard} is missing (it holds {index.fqn}): the checkpoint is incomplete; load an earlier iteration"
            break
        if shard.stat().st_size < info.offset + info.length:
            problem = (f"{shard} is truncated: {shard.stat().st_size} bytes, {index.fqn} needs bytes up to "
                       f"{info.offset + info.length}; load an earlier iteration")
            break
    if problem is None and checksums is not None:
        for name in _my_share(sorted(checksums["files"]), no_dist):
            if (path / name).exists() and _crc32(path / name) != checksums["files"][name]:
                problem = (f"{path / name} does not match its checksum from the save (CRC32 "
                           f"{checksums['files'][name]}): the file was changed or damaged on disk; load an earlier "
                           "iteration or restore the file")
                break
    _same_verdict(problem, no_dist)


# ------------------------------------------------------------------ load
def read_common(path: Path) -> dict:
    """common.pt of a checkpoint folder (iteration, consumed_samples, scheduler, model_config, world_size)."""
    if not (path / ".metadata").exists() or not (path / "common.pt").exists():
        raise CheckpointError(f"{path} is incomplete (no .metadata or common.pt): it was not written to the end. "
                              f"Point {TRACKER} at an earlier iteration or delete the folder")
    try:
        return torch.load(path / "common.pt", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path / 'common.pt'} cannot be loaded with weights_only=True: it is corrupt or holds "
                              f"objects other than tensors and plain data ({type(e).__name__}); load an earlier "
                              "iteration") from e


def find_checkpoint(load_dir: str | Path, iteration: int | None = None) -> Path:
    """The folder of `iteration` in load_dir (default: the one the tracker names); a clear error if there is none."""
    iteration = read_tracker(load_dir) if iteration is None else iteration
    if iteration is None:
        raise CheckpointError(f"no checkpoint in {load_dir} (no {TRACKER}); train from scratch or fix the path")
    path = checkpoint_dir(load_dir, iteration)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint of iteration {iteration}: {path} does not exist (check {TRACKER} or the iteration asked for)")
    return path


def read_state(path: Path, state: dict[str, torch.Tensor], no_dist: bool = False) -> None:
    """Fill `state`'s full-shape tensors from the checkpoint at path (collective unless no_dist), after checking
    that it holds every key at that shape and that its shards are whole (and match the checksums in common.pt,
    when it has them); a corrupt, truncated or missing file is a CheckpointError naming it, on every rank."""
    problem = None
    try:  # before anything else: a damaged .metadata must not escape as a raw unpickling error
        full_metadata = dcp.FileSystemReader(path).read_metadata()
        metadata = full_metadata.state_dict_metadata
    except Exception as e:
        problem = (f"{path / '.metadata'} cannot be read ({type(e).__name__}: "
                   f"{(str(e).strip().splitlines() or [''])[0][:200]}): it is corrupt or truncated; load an earlier "
                   "iteration")
    _same_verdict(problem, no_dist)
    checksums = read_common(path).get("checksums") if (path / "common.pt").exists() else None
    check_shards(path, full_metadata, checksums, no_dist)
    for key, t in state.items():
        if key not in metadata:
            raise CheckpointError(f"{path} lacks {key!r}: saved from a different model or optimizer")
        if hasattr(metadata[key], "size") and tuple(metadata[key].size) != tuple(t.shape):
            raise CheckpointError(f"{path}: {key} has shape {tuple(metadata[key].size)}, this model {tuple(t.shape)}")
    try:
        dcp.load(state, checkpoint_id=path, no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException, one failure per rank
        cause = next(iter(e.failures.values())) if isinstance(e, CheckpointException) else e
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback) from another rank
        detail = (str(cause).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{path} could not be read ({type(cause).__name__}: {detail}): a file is corrupt "
                              "or truncated; load an earlier iteration") from e


def load_checkpoint(load_dir: str | Path, model: nn.Module, params: list[nn.Parameter],
                    optimizer: torch.optim.Optimizer, scheduler, tp_group=None, iteration: int | None = None) -> dict:
    """Collective: restore what save_checkpoint wrote, into any tp/pp/dp layout; returns common.pt's dict.

    The RNG state (CPU, and the GPU's when training on one) comes back only if the world size is the one
    saved (otherwise ranks do not map).
    tp_group: the current state's tensor-parallel group unless given (none when no state is current).
    """
    tp_group = ps.resolve_group(tp_group, "tp")
    path = find_checkpoint(load_dir, iteration)
    common = read_common(path)
    saved, ours = common["model_config"], dataclasses.asdict(model.config)
    diff = {k: (saved.get(k), v) for k, v in ours.items() if saved.get(k) != v}
    if diff:
        raise CheckpointError(f"{path} was saved from another model: (saved, this run) differ in {diff}")
    opt_state = _parameter_state(optimizer, params)
    state = _global_state(model, params, opt_state, tp_group, full=False)
    same_world = common["world_size"] == dist.get_world_size()
    cuda_rng = same_world and common.get("cuda_rng", False) and _on_cuda(params)
    if same_world:
        state[f"rng.rank{dist.get_rank()}"] = torch.get_rng_state()
    if cuda_rng:
        state[f"cuda_rng.rank{dist.get_rank()}"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    tracker = _tracker_states(cuda_rng)
    restore_tracker = same_world and sorted(tracker) == common.get("rng_tracker")
    if restore_tracker:
        state.update({f"{key}.rank{dist.get_rank()}": value for key, value in tracker.items()})
    read_state(path, state)
    dims = tensor_parallel_dims(model)
    with torch.no_grad():
        for name, p in _owned(model, params).items():
            stride = getattr(p, "partition_stride", 1)
            p.copy_(_tp_slice(state[f"model.{name}"], dims.get(name), tp_group, stride))  # in place: DDP's buffers stay
            for k, v in opt_state[p].items():
                v.copy_(_tp_slice(state[f"optimizer.{name}.{k}"], dims.get(name) if v.ndim else None, tp_group,
                                  stride))
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.load_parameter_state(opt_state)
    if same_world:
        torch.set_rng_state(state[f"rng.rank{dist.get_rank()}"])
    if cuda_rng:
        torch.cuda.set_rng_state(state[f"cuda_rng.rank{dist.get_rank()}"], torch.cuda.current_device())
    if restore_tracker:
        names = {key.split(".", 1)[1] for key in tracker}
        get_cuda_rng_tracker().set_states({
            name: (state[f"rng_tracker.{name}.rank{dist.get_rank()}"],
                   state.get(f"cuda_rng_tracker.{name}.rank{dist.get_rank()}")) for name in names})
    scheduler.load_state_dict(common["scheduler"])
    return common
