"""Named mistakes of the all-to-all (Ulysses) context-parallel exercise (issue 39).

Each is a typical wrong answer, runnable and different in behaviour from the reference; the exercise's first
test (tests/test_context_parallel.py, check_a2a_communicate) must fail on it and its verdict must contain `says`.
"""

from tests.mistakes import Mistake

MISTAKES = [
    Mistake("cp.a2a_communicate", "chunks not reordered after the all-to-all", says="not reordered into sequence order",
            code="""
send = x.view(b, cp, h // cp, s_local, hn).movedim(1, 0).contiguous()
recv = torch.empty_like(send)
dist.all_to_all_single(recv, send, group=group)
return recv.movedim(0, 2).reshape(b, h // cp, cp * s_local, hn)
"""),
    Mistake("cp.a2a_communicate", "head dim cut as [h/cp, cp] (strided heads)", says="strided heads", code="""
send = x.view(b, h // cp, cp, s_local, hn).movedim(2, 0).contiguous()
recv = torch.empty_like(send)
dist.all_to_all_single(recv, send, group=group)
chunks = recv.movedim(0, 2).reshape(b, h // cp, 2 * cp, s_local // 2, hn)
ids = torch.tensor(seq_chunk_ids_for_a2a(cp, True, zigzag), device=x.device)
return chunks.index_select(2, ids).flatten(2, 3)
"""),
    Mistake("cp.a2a_communicate", "the after-attention chunk ids used before attention", says="after-attention ids",
            code="""
send = x.view(b, cp, h // cp, s_local, hn).movedim(1, 0).contiguous()
recv = torch.empty_like(send)
dist.all_to_all_single(recv, send, group=group)
chunks = recv.movedim(0, 2).reshape(b, h // cp, 2 * cp, s_local // 2, hn)
ids = torch.tensor(seq_chunk_ids_for_a2a(cp, False, zigzag), device=x.device)
return chunks.index_select(2, ids).flatten(2, 3)
"""),
    Mistake("cp.a2a_communicate", "all-to-all over the batch dim (head blocks not moved to the front)",
            says="split the batch (dim 0)", code="""
send = x.contiguous()
recv = torch.empty_like(send)
dist.all_to_all_single(recv, send, group=group)
return recv.reshape(b, h // cp, cp * s_local, hn)
"""),
]
