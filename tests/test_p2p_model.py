"""The NCCL p2p model checker (megalab/extras/p2p_model.py), and every p2p exchange in megalab under it."""

import pytest
import torch

from megalab.extras import p2p_model as pm
from megalab.extras.p2p_model import P2P, P2PDeadlock, P2PMismatch
from megalab.lab.checks import require
from tests.ch03_checks import check_communicate, require_schedule_pieces

SHAPE, DTYPE = (1, 2), "float32"


def _op(kind, peer, tag=0):
    return P2P(kind, peer, tag, SHAPE, DTYPE)


def _ring(world, batched):
    """Every rank sends to rank+1 and receives from rank-1, as two lone ops or one batch."""
    streams = {}
    for r in range(world):
        send, recv = _op("send", (r + 1) % world), _op("recv", (r - 1) % world)
        streams[r] = [[send, recv]] if batched else [[send], [recv]]
    return streams


# ------------------------------------------------------------------ the model itself
def test_unbatched_ring_deadlocks_and_batched_ring_completes():
    for world in (2, 3, 8):
        with pytest.raises(P2PDeadlock) as e:
            pm.replay(_ring(world, batched=False))
        assert sorted(e.value.stuck) == list(range(world)), f"a ring of {world} lone isend-then-irecv: every rank stuck"
        assert "rank 0 is stuck in unit #0" in str(e.value) and "send→1" in str(e.value)
        pm.replay(_ring(world, batched=True))


def test_alternating_order_and_chains_complete():
    # even ranks send first, odd ranks receive first (Megatron's _p2p_ops order): no cycle even when unbatched
    world = 4
    streams = {r: ([[_op("send", (r + 1) % world)], [_op("recv", (r - 1) % world)]] if r % 2 == 0 else
                   [[_op("recv", (r - 1) % world)], [_op("send", (r + 1) % world)]]) for r in range(world)}
    pm.replay(streams)
    with pytest.raises(P2PDeadlock, match="never posts the matching receive"):
        pm.replay({0: [[_op("send", 1)]], 1: []})


def test_crossed_tags_between_two_ranks_are_a_mismatch():
    """pp=2: prev == next. Megatron's batch order (send_prev, recv_prev, send_next, recv_next) pairs rank 0's
    gradient with rank 1's activation buffer (Megatron-LM #750); activations first, then gradients, does not."""
    act, grad = 0, 1
    megatron = {r: [[_op("send", 1 - r, grad), _op("recv", 1 - r, act), _op("send", 1 - r, act),
                     _op("recv", 1 - r, grad)]] for r in (0, 1)}
    with pytest.raises(P2PMismatch, match="without tags"):
        pm.replay(megatron)
    ours = {r: [[_op("send", 1 - r, act), _op("recv", 1 - r, act), _op("send", 1 - r, grad),
                 _op("recv", 1 - r, grad)]] for r in (0, 1)}
    pm.replay(ours)


# The streams the interleaved executor issued before issue 23 (pp=2, m=4, v=2; recorded with record_pipeline):
# one unit per "|", "s1" = send with tag 1 (gradient) to the other rank, "r0" = receive with tag 0 (activation).
OLD_INTERLEAVED = {
    0: "s0 | s0 r0 | s0 r0 | s0 | s0 r1 | s1 | s0 r1 | s1 r0 | s0 r1 | r0 | s0 r1 | r1 | s1 r1 | s1 r1 | r1",
    1: "r0 | s0 r0 | s0 r0 | s1 r0 | s1 r0 | s0 r1 | s1 r0 | s0 r1 | s1 r0 | s1 r0 | s1 r1 | s1 r1 | s1",
}


def _parse(streams):
    kinds = {"s": "send", "r": "recv"}
    return {r: [[_op(kinds[t[0]], 1 - r, int(t[1:])) for t in unit.split()] for unit in text.split(" | ")]
            for r, text in streams.items()}


def test_the_old_interleaved_executor_deadlocks():
    with pytest.raises(P2PDeadlock) as e:
        pm.replay(_parse(OLD_INTERLEAVED))
    assert set(e.value.stuck) == {0, 1}
    assert "rank 0 is stuck in unit #5" in str(e.value) and "rank 1 is stuck in unit #4" in str(e.value)


def test_recording_sees_what_the_code_issues():
    def code(rank, group):
        buf = torch.empty(SHAPE)
        ops = [torch.distributed.P2POp(torch.distributed.isend, torch.ones(SHAPE), (rank + 1) % 3, group, tag=5),
               torch.distributed.P2POp(torch.distributed.irecv, buf, (rank - 1) % 3, group, tag=5)]
        for request in torch.distributed.batch_isend_irecv(ops):
            request.wait()
        torch.distributed.isend(torch.ones(3, dtype=torch.bfloat16), group_dst=(rank + 1) % 3, group=group)

    streams = pm.record(code, 3)
    assert streams[1] == [[P2P("send", 2, 5, SHAPE, DTYPE), P2P("recv", 0, 5, SHAPE, DTYPE)],
                          [P2P("send", 2, 0, (3,), "bfloat16")]]
    assert torch.distributed.isend.__module__ == "torch.distributed.distributed_c10d"  # the stand-in is gone again


# ------------------------------------------------------------------ the pipeline executor under the model
GRID = [(p, m, 1, kind) for kind in ("gpipe", "1f1b") for p in range(2, 9) for m in range(1, 17)]
GRID += [(p, m, v, "interleaved") for p in range(2, 9) for v in (2, 3) for m in range(p, 17, p)]


@pytest.mark.exercise("pp.communicate")
def test_communicate_posts_one_waited_batch_of_the_models_dtype():
    """First, in one process: a wrong _communicate is named (lone isend/irecv, no wait, fp32 or grad-less buffers)."""
    require(check_communicate())


@pytest.mark.exercise("pp.num_warmup")
@pytest.mark.exercise("pp.schedule_table")
@pytest.mark.exercise("pp.one_f_one_b")
def test_schedule_pieces_are_megatrons():
    """First, before the streams: a wrong warmup count, interleaved table or 1F1B order is named."""
    require_schedule_pieces()


@pytest.mark.exercise("pp.communicate")
@pytest.mark.exercise("pp.num_warmup")
@pytest.mark.exercise("pp.schedule_table")
@pytest.mark.exercise("pp.one_f_one_b")
def test_pipeline_schedules_cannot_deadlock_under_nccl():
    """pp 2-8, m 1-16 (any m for GPipe/1F1B, multiples of pp interleaved), v 1-3: the executor's real streams."""
    failures = []
    for p, m, v, kind in GRID:
        try:
            pm.check_pipeline(p, m, v, kind)
        except (P2PDeadlock, P2PMismatch) as e:
            failures.append(str(e))
    assert not failures, f"{len(failures)} of {len(GRID)} configurations fail under NCCL's rules; the first:\n" + \
        failures[0]


def test_one_f_one_b_streams_are_megatrons():
    """1F1B pp=2 m=2 as Megatron's forward_backward_pipelining_without_interleaving issues it."""
    act, grad = 0, 1
    streams = pm.record_pipeline(2, 2, 1, "1f1b")
    assert streams[0] == [[_op("send", 1, act)], [_op("send", 1, act), _op("recv", 1, grad)], [_op("recv", 1, grad)]]
    assert streams[1] == [[_op("recv", 0, act)], [_op("recv", 0, act), _op("send", 0, grad)], [_op("send", 0, grad)]]


@pytest.mark.exercise("pp.communicate")
def test_receive_buffers_have_the_models_dtype():
    """A bf16 model sends bf16 activations; fp32 receive buffers would not match them (gloo: an error, NCCL: garbage)."""
    for kind, v, m in (("1f1b", 1, 5), ("gpipe", 1, 3), ("interleaved", 2, 6)):
        pm.check_pipeline(3, m, v, kind, dtype=torch.bfloat16)
        streams = pm.record_pipeline(3, m, v, kind, dtype=torch.bfloat16)
        assert {op.dtype for stream in streams.values() for unit in stream for op in unit} == {"bfloat16"}


# ------------------------------------------------------------------ rings: collectives from send/recv, ring attention
@pytest.mark.exercise("comm.all_gather")
@pytest.mark.exercise("comm.reduce_scatter")
@pytest.mark.exercise("comm.ring_all_reduce")
@pytest.mark.exercise("comm.broadcast")
def test_collectives_from_send_recv_cannot_deadlock_under_nccl():
    from megalab.extras import comm
    from megalab.lab.dist import shard_bounds

    def shard(rank, group):  # this rank's share of 10 elements
        start, stop = shard_bounds(10, torch.distributed.get_world_size(group), rank)
        return torch.ones(stop - start)

    for world in (2, 3, 4, 8):
        for name, run in (
            ("broadcast", lambda rank, group: comm.broadcast(torch.ones(5), src=1, group=group)),
            ("all_gather", lambda rank, group: comm.all_gather(torch.empty(10), shard(rank, group), group)),
            ("reduce_scatter", lambda rank, group: comm.reduce_scatter(shard(rank, group), torch.ones(10), group)),
            ("ring_all_reduce", lambda rank, group: comm.ring_all_reduce(torch.ones(10), group)),
        ):
            streams = pm.record(run, world)
            assert any(streams.values()), f"comm.{name} on {world} ranks issued no p2p operation"
            try:
                pm.replay(streams)
            except (P2PDeadlock, P2PMismatch) as e:
                raise AssertionError(f"comm.{name} on {world} ranks fails under NCCL's rules:\n{e}") from None


@pytest.mark.exercise("cp.ring_step")
@pytest.mark.exercise("cp.backward_ring")
def test_ring_attention_cannot_deadlock_under_nccl():
    from megalab.transformer_engine.context_parallel import context_parallel_attention

    def run(rank, group):
        q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))  # [b, heads, s/cp, hn]
        context_parallel_attention(q, k, v, group=group).sum().backward()

    for cp in (2, 3, 4):
        streams = pm.record(run, cp)
        assert all(streams.values()), f"ring attention on {cp} ranks: some rank issued no p2p operation"
        try:
            pm.replay(streams)
        except (P2PDeadlock, P2PMismatch) as e:
            raise AssertionError(f"ring attention (forward + backward) on cp={cp} fails under NCCL's rules:\n{e}") \
                from None
