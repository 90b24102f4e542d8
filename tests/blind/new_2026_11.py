"""Blind solutions of the exercises added in November 2026 (cp.a2a_communicate, moe.ep_overlap, pp.layout_offset,
mxfp8.quantize_rowwise, inference.release_blocks): written from the student workspace's text alone (the notebook,
the task line, the docstrings and `megalab hint`), by a writer who had not seen the reference, the tests or the
named mistakes (issue 34; see __init__.py)."""

_A2A = '''
hl = h // cp
send = x.reshape(b, cp, hl, s_local, hn).movedim(1, 0).contiguous()  # [cp, b, h/cp, s/cp, hn]: head block j -> rank j
recv = torch.empty_like(send)
dist.all_to_all_single(recv, send, group=group)  # recv[j]: my head block of rank j's tokens
chunks = recv.movedim(0, 2).reshape(b, hl, 2 * cp, s_local // 2, hn)  # rank-major chunks: rank j's at 2j, 2j + 1
ids = torch.tensor(seq_chunk_ids_for_a2a(cp, True, zigzag), device=x.device)
return chunks.index_select(2, ids).reshape(b, hl, cp * s_local, hn)  # [b, h/cp, s, hn] in sequence order
'''

_EP_OVERLAP = '''
x, g = f_input, b_grad
# round 1: b's combine backward (comm) under f's pre_dispatch (compute)
if b_layer is not None:
    pending_b = b_layer.moe_combine.backward(g)
if f_layer is not None:
    x = f_layer.pre_dispatch.forward(x)
if b_layer is not None:
    g = pending_b.wait()
# round 2: f's dispatch under b's mlp backward
if f_layer is not None:
    pending_f = f_layer.moe_dispatch.forward(x)
if b_layer is not None:
    g = b_layer.mlp.backward(g)
if f_layer is not None:
    x = pending_f.wait()
# round 3: b's dispatch backward under f's mlp
if b_layer is not None:
    pending_b = b_layer.moe_dispatch.backward(g)
if f_layer is not None:
    x = f_layer.mlp.forward(x)
if b_layer is not None:
    g = pending_b.wait()
# round 4: f's combine under b's pre_dispatch backward
if f_layer is not None:
    pending_f = f_layer.moe_combine.forward(x)
if b_layer is not None:
    g = b_layer.pre_dispatch.backward(g)
if f_layer is not None:
    x = pending_f.wait()
return x, g
'''

_LAYOUT_OFFSET = '''
pp = self.pipeline_model_parallel_size
offset = 0
for v in range(vp_stage):  # every rank's earlier chunks
    for r in range(pp):
        offset += self.layout[r][v].count(layer_type)
for r in range(pp_rank):  # this chunk's earlier ranks
    offset += self.layout[r][vp_stage].count(layer_type)
return offset
'''

_MXFP8 = '''
blocks = x.float().reshape(M, K // MXFP8_BLOCK_SCALING_SIZE, MXFP8_BLOCK_SCALING_SIZE)  # [M, K/32, 32]
amax = blocks.abs().amax(dim=-1)  # [M, K/32]
scale_inv = float_to_e8m0(amax * max_norm_rcp(fp8_dtype).to(x.device))  # [M, K/32] uint8, rounded up
scale = exp2f_rcp(scale_inv).to(x.device)  # 2^(127 - e)
fp8_max = torch.finfo(fp8_dtype).max
data = (blocks * scale.unsqueeze(-1)).clamp(-fp8_max, fp8_max).to(fp8_dtype).reshape(M, K)
'''

_RELEASE = '''
for b in blocks:
    if self.block_ref_counts[b] <= 0:
        raise ValueError(f"block {b} released but nobody holds it (a double free)")
    self.block_ref_counts[b] -= 1
    if self.block_ref_counts[b] == 0:
        if self.block_hashes[b] is not None and self.prefix_caching_eviction_policy == "lru":
            continue  # stays cached: evictable, its K/V reusable
        if self.block_hashes[b] is not None:
            self._deregister(b)
        self.free_blocks.append(b)
'''

SOLUTIONS = [
    dict(exercise='cp.a2a_communicate', name='first try', code=_A2A),
    dict(exercise='moe.ep_overlap', name='first try', code=_EP_OVERLAP),
    dict(exercise='pp.layout_offset', name='first try', code=_LAYOUT_OFFSET),
    dict(exercise='mxfp8.quantize_rowwise', name='first try', code=_MXFP8),
    # first try FAILS (2026-11-27): hint 2 says "refuse a block whose count is already 0 (a double free)" and names no
    # exception (the notebook and the docstring do not mention a double free); this raises ValueError, the grader
    # wants another type (RuntimeError passes): the text or the grader is to be fixed, the first try kept.
    dict(exercise='inference.release_blocks', name='first try', code=_RELEASE),
]
