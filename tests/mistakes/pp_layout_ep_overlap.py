"""Typical wrong answers to the pipeline-layout and EP-overlap exercises (course/03_parallelism/07_*, 09_*)."""

from tests.mistakes import Mistake

MISTAKES = [
    # ------------------------------------------------------------------ pp.layout_offset
    Mistake("pp.layout_offset", "counted rank by rank: every chunk of the earlier ranks, then this rank's earlier chunks",
            says="counted rank by rank", code="""
offset = 0
for rank in range(pp_rank):
    for stage in self.layout[rank]:
        offset += stage.count(layer_type)
for vp in range(vp_stage):
    offset += self.layout[pp_rank][vp].count(layer_type)
return offset
"""),
    Mistake("pp.layout_offset", "counted the embedding and the loss as layers (len of each stage)",
            says="counted 'E', 'L' and 'm'", code="""
offset = 0
for vp in range(vp_stage + 1):
    for rank in range(self.pipeline_model_parallel_size if vp < vp_stage else pp_rank):
        offset += len(self.layout[rank][vp])
return offset
"""),
    Mistake("pp.layout_offset", "only this rank's earlier chunks", says="only this rank's earlier chunks", code="""
return sum(self.layout[pp_rank][vp].count(layer_type) for vp in range(vp_stage))
"""),
    # ------------------------------------------------------------------ moe.ep_overlap
    Mistake("moe.ep_overlap", "waited for every all-to-all as soon as it started", says="none of the four", code="""
if b_layer is not None:
    b_grad = b_layer.mlp.backward(b_layer.moe_combine.backward(b_grad).wait())
    b_grad = b_layer.pre_dispatch.backward(b_layer.moe_dispatch.backward(b_grad).wait())
if f_layer is not None:
    f_input = f_layer.pre_dispatch.forward(f_input)
    f_input = f_layer.mlp.forward(f_layer.moe_dispatch.forward(f_input).wait())
    f_input = f_layer.moe_combine.forward(f_input).wait()
return f_input, b_grad
"""),
    Mistake("moe.ep_overlap", "started the backward's combine all-to-all only after the forward's pre_dispatch",
            says="moe_combine backward", code="""
if f_layer is not None:
    f_input = f_layer.pre_dispatch.forward(f_input)
if b_layer is not None:
    pending_b = b_layer.moe_combine.backward(b_grad)
if f_layer is not None:
    pending_f = f_layer.moe_dispatch.forward(f_input)
if b_layer is not None:
    b_grad = b_layer.mlp.backward(pending_b.wait())
    pending_b = b_layer.moe_dispatch.backward(b_grad)
if f_layer is not None:
    f_input = f_layer.mlp.forward(pending_f.wait())
    pending_f = f_layer.moe_combine.forward(f_input)
if b_layer is not None:
    b_grad = b_layer.pre_dispatch.backward(pending_b.wait())
if f_layer is not None:
    f_input = pending_f.wait()
return f_input, b_grad
"""),
    Mistake("moe.ep_overlap", "passed on the dispatch's gradient without pre_dispatch's backward",
            says="pre_dispatch backward", code="""
if b_layer is not None:
    pending_b = b_layer.moe_combine.backward(b_grad)
if f_layer is not None:
    f_input = f_layer.pre_dispatch.forward(f_input)
    pending_f = f_layer.moe_dispatch.forward(f_input)
if b_layer is not None:
    b_grad = b_layer.mlp.backward(pending_b.wait())
    pending_b = b_layer.moe_dispatch.backward(b_grad)
if f_layer is not None:
    f_input = f_layer.mlp.forward(pending_f.wait())
    pending_f = f_layer.moe_combine.forward(f_input)
if b_layer is not None:
    b_grad = pending_b.wait()
if f_layer is not None:
    f_input = pending_f.wait()
return f_input, b_grad
"""),
]
