"""tests/threaded_world.py itself: the collectives the quick first checks use, one rank at a time, deadlocks at once."""

import time

import pytest
import torch
import torch.distributed as dist

from tests import threaded_world


def test_collectives_give_what_torch_distributed_gives():
    def fn(rank, group):
        x = torch.tensor([1.0, -2.0, 3.0, 4.0]) * (rank + 1)
        out = {}
        for op in ("SUM", "MAX", "MIN", "PRODUCT", "AVG"):
            y = x.clone()
            dist.all_reduce(y, op=getattr(dist.ReduceOp, op), group=group)
            out[op] = y.tolist()
        gathered = torch.empty(8)
        dist.all_gather_single(gathered, x, group=group)
        shard = torch.empty(2)
        dist.reduce_scatter_single(shard, x, group=group)
        out["gathered"], out["shard"] = gathered.tolist(), shard.tolist()
        alone = [dist.new_group([r]) for r in range(2)][rank]  # every rank makes every group, as in torch
        y = x.clone()
        dist.all_reduce(y, group=alone)
        out["alone"] = y.tolist()
        return out

    got = threaded_world.run(2, fn)
    a, b = [1.0, -2.0, 3.0, 4.0], [2.0, -4.0, 6.0, 8.0]
    for rank, mine in ((0, a), (1, b)):
        r = got[rank]
        assert r["SUM"] == [3.0, -6.0, 9.0, 12.0] and r["AVG"] == [1.5, -3.0, 4.5, 6.0]
        assert r["MAX"] == [2.0, -2.0, 6.0, 8.0] and r["MIN"] == [1.0, -4.0, 3.0, 4.0] and r["PRODUCT"] == [2.0, 8.0, 18.0, 32.0]
        assert r["gathered"] == a + b and r["shard"] == [3.0, -6.0, 9.0, 12.0][2 * rank:2 * rank + 2]
        assert r["alone"] == mine  # a group of one rank: its own value, not the world's sum


def test_one_rank_runs_at_a_time_so_seeding_works_as_in_processes():
    def fn(rank, group):
        torch.manual_seed(0)
        time.sleep(0.05)  # another rank would seed (and draw) here if ranks ran at once
        drawn = torch.randn(4)
        dist.barrier(group=group)
        return drawn

    got = threaded_world.run(2, fn)
    assert torch.equal(got[0], got[1]), "the same seed gave the two ranks different numbers"


def test_a_collective_one_rank_skips_fails_at_once_and_names_the_wait():
    def fn(rank, group):
        if rank == 0:
            dist.all_reduce(torch.ones(2), group=group)

    world = threaded_world.World(2, timeout=3600)  # without the deadlock check this test would wait an hour
    with pytest.raises(threaded_world.WorldStuck) as info:
        world.run(fn)
    assert info.value.stuck == {0: "all_reduce on ranks [0, 1]: not every rank joined"}


def test_an_endless_loop_in_a_rank_is_stopped_at_its_line_and_no_thread_outlives_run():
    import threading

    def fn(rank, group):
        if rank == 1:
            dist.barrier(group=group)
        n = 0
        while rank == 0:  # the endless loop
            try:
                n += 1
            except Exception:  # noqa: BLE001  (a learner's broad except must not swallow the stop)
                pass

    before = threading.active_count()
    with pytest.raises(BaseException) as info:
        threaded_world.World(2, cpu_limit=0.5).run(fn)
    assert type(info.value).__name__ == "EndlessLoop", repr(info.value)
    assert "rank 0 still computing after 0.5 s of CPU time at " in str(info.value)
    assert "test_threaded_world.py" in str(info.value) and "an endless loop?" in str(info.value)
    assert threading.active_count() == before, "a rank thread outlived run"
