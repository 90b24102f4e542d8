"""megalab.lab.dist: shard_bounds (exercise `dist.shard_bounds`), checked alone and across real ranks."""

import pytest
import torch

from megalab.lab import launch
from megalab.lab.checks import mistake, require
from megalab.lab.dist import shard_bounds

LENGTHS = [0, 1, 2, 3, 7, 10, 16, 31, 100]


def _bounds_from_sizes(sizes):
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    return [(a, a + n) for a, n in zip(starts, sizes)]


def _ceil_bounds(length, world):
    size = -(-length // world)
    return [(min(r * size, length), min(r * size + size, length)) for r in range(world)]


# What the typical wrong splits give (sizes of ranks 0..world-1), to name the mistake a wrong answer looks like.
SHARD_MISTAKES = {
    "gave the extra items to the last ranks, not the first": lambda length, world: _bounds_from_sizes(
        [length // world] * (world - length % world) + [length // world + 1] * (length % world)),
    "put the whole remainder on the last rank (sizes then differ by more than 1)": lambda length, world:
        _bounds_from_sizes([length // world] * (world - 1) + [length - (world - 1) * (length // world)]),
    "ceil-sized shards, as torch.chunk cuts them (the last ranks run short or empty)": _ceil_bounds,
    "rank length % world_size got an extra item too (<= where < belongs): its shard overlaps the next one or runs "
    "past length": lambda length, world: [
        (r * (length // world) + min(r, length % world),
         r * (length // world) + min(r, length % world) + length // world + (r <= length % world))
        for r in range(world)],
}


@pytest.mark.exercise("dist.shard_bounds")
def test_shard_bounds_names_typical_mistakes():
    """Every (length, world): if the split is wrong everywhere it is wrong in the way one typical mistake is,
    the verdict names that mistake."""
    cases = [(length, world) for length in LENGTHS for world in range(1, 9)]
    got = {case: [shard_bounds(*case, rank) for rank in range(case[1])] for case in cases}
    wrong = [case for case in cases if got[case] != _bounds_from_sizes(
        [case[0] // case[1] + 1] * (case[0] % case[1]) + [case[0] // case[1]] * (case[1] - case[0] % case[1]))]
    if not wrong:
        return
    length, world = wrong[0]
    for name, model in SHARD_MISTAKES.items():
        if all(got[case] == model(*case) for case in wrong):
            require(mistake(name, f"shard_bounds({length}, {world}, rank) for ranks 0..{world - 1} gives "
                                  f"{got[wrong[0]]}; the first length % world_size ranks get one extra item"))


@pytest.mark.exercise("dist.shard_bounds")
def test_shard_bounds_balanced_and_exact():
    for length in LENGTHS:
        for world in range(1, 9):
            bounds = [shard_bounds(length, world, rank) for rank in range(world)]
            where = f"shard_bounds({length}, {world}, rank) for ranks 0..{world - 1}"
            assert bounds[0][0] == 0 and bounds[-1][1] == length, (
                f"{where} gives {bounds}: the shards should start at 0 and end at {length}")
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])), (
                f"{where} gives {bounds}: gaps or overlaps (each shard should start where the previous one stops)")
            sizes = [stop - start for start, stop in bounds]
            extra = length % world  # the first length % world ranks carry the extra item
            expected = [length // world + 1] * extra + [length // world] * (world - extra)
            assert max(sizes) - min(sizes) <= 1, (
                f"{where}: shard sizes {sizes} differ by more than 1; expected {expected} (the first "
                f"{length} % {world} = {extra} ranks get one extra item)")
            assert sizes == expected, (
                f"{where}: shard sizes {sizes}, expected {expected} (the FIRST {length} % {world} = {extra} ranks "
                "get one extra item, not the last)")


@pytest.mark.exercise("dist.shard_bounds")
def test_shard_bounds_example_and_bad_rank():
    got = [shard_bounds(10, 4, r) for r in range(4)]
    assert got == [(0, 3), (3, 6), (6, 8), (8, 10)], (
        f"shard_bounds(10, 4, r) for r = 0..3 gives {got}, expected [(0, 3), (3, 6), (6, 8), (8, 10)] (sizes 3, 3, 2, 2)")
    for length, world, rank in [(10, 4, 4), (10, 4, -1), (10, 0, 0)]:
        with pytest.raises(ValueError, match="not in a world"):
            shard_bounds(length, world, rank)


def _sum_of_shards(lengths):
    """On each rank: sum my shard of arange(length), all_reduce the sums; returns [(total, expected)]."""
    import torch.distributed as dist

    from megalab.lab import dist as mdist

    rank, world = mdist.init()
    out = []
    for length in lengths:
        start, stop = mdist.shard_bounds(length, world, rank)
        part = torch.arange(start, stop, dtype=torch.float64, device=mdist.device()).sum()
        dist.all_reduce(part)
        out.append((part.item(), float(sum(range(length)))))
    return out


@pytest.mark.integration
@pytest.mark.exercise("dist.shard_bounds")
def test_shard_sums_all_reduce_to_full_sum():
    res = launch.run_function(_sum_of_shards, 3, LENGTHS, launch=dict(timeout=60, hard_timeout=360))
    for rank, pairs in res.returns.items():
        for length, (total, expected) in zip(LENGTHS, pairs):
            assert total == expected, (
                f"3 ranks, rank {rank}: the all-reduced sum of the ranks' shards of arange({length}) is {total:g}, "
                f"expected {expected:g} (shards that miss or repeat items)")
