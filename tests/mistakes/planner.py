"""Typical wrong answers to the planner's exercises (course/03_parallelism/10_combining_parallelisms.ipynb)."""

from tests.mistakes import Mistake

_WEIGHTS_HEAD = """
layers = model.num_layers / layout.pp
dense = layers * per_layer["dense"] / layout.tp + model.embedding_params() / layout.tp
if layout.pp == 1:
    dense += model.final_norm_params()
    if model.untie_embeddings_and_output_weights:
        dense += model.embedding_params() / layout.tp
expert = layers * per_layer["expert"] / (layout.ep * layout.etp)
"""

_ACTIVATION_TAIL = """
per_layer = calc.activation_memory_per_layer(s, b, h, model.num_attention_heads, t, sp, train.recompute,
                                             ffn_hidden_size=ffn, context_parallel_size=layout.cp)
tokens = s / layout.cp * b
"""

MISTAKES = [
    Mistake("planner.weight_memory", "forgot to shard the optimizer state (distributed optimizer)",
            says="optimizer state not sharded", code=_WEIGHTS_HEAD + """
params = dense + expert
optimizer = train.optimizer_bytes * params
return {"params": train.param_bytes * params, "grads": train.grad_bytes * params, "optimizer": optimizer}
"""),
    Mistake("planner.weight_memory", "sharded the experts' optimizer state over dp·cp, not expert data parallel",
            says="experts sharded over dp", code=_WEIGHTS_HEAD + """
params = dense + expert
shard = layout.dp * layout.cp if train.use_distributed_optimizer else 1
optimizer = train.optimizer_bytes * params / shard
return {"params": train.param_bytes * params, "grads": train.grad_bytes * params, "optimizer": optimizer}
"""),
    Mistake("planner.weight_memory", "counted the grads in bf16 like the params (Megatron keeps fp32 main grads)",
            says="grads counted in param_bytes", code=_WEIGHTS_HEAD + """
dense_dp = layout.dp * layout.cp
expert_dp = layout.tp * layout.cp * layout.dp // (layout.ep * layout.etp)
shard = (lambda n: 1) if not train.use_distributed_optimizer else (lambda n: n)
params = dense + expert
optimizer = train.optimizer_bytes * (dense / shard(dense_dp) + expert / shard(expert_dp))
return {"params": train.param_bytes * params, "grads": train.param_bytes * params, "optimizer": optimizer}
"""),
    Mistake("planner.weight_memory", "left the embedding out of the first stage", says="embedding left out", code="""
layers = model.num_layers / layout.pp
dense = layers * per_layer["dense"] / layout.tp
expert = layers * per_layer["expert"] / (layout.ep * layout.etp)
dense_dp = layout.dp * layout.cp
expert_dp = layout.tp * layout.cp * layout.dp // (layout.ep * layout.etp)
shard = (lambda n: 1) if not train.use_distributed_optimizer else (lambda n: n)
params = dense + expert
optimizer = train.optimizer_bytes * (dense / shard(dense_dp) + expert / shard(expert_dp))
return {"params": train.param_bytes * params, "grads": train.grad_bytes * params, "optimizer": optimizer}
"""),
    Mistake("planner.activation_memory", "kept all m micro-batches in flight (1F1B holds at most p)",
            says="all m micro-batches", code=_ACTIVATION_TAIL + """
in_flight = num_microbatches
embedding = (8 * tokens + tokens * h) * in_flight
total = per_layer * model.num_layers / layout.pp * in_flight + embedding / (t if sp else 1)
"""),
    Mistake("planner.activation_memory", "ignored context parallelism (each rank holds s/cp tokens)",
            says="context parallelism ignored", code="""
per_layer = calc.activation_memory_per_layer(s, b, h, model.num_attention_heads, t, sp, train.recompute,
                                             ffn_hidden_size=ffn)
in_flight = in_flight_microbatches(layout, num_microbatches)
tokens = s * b
embedding = (8 * tokens + tokens * h) * in_flight
total = per_layer * model.num_layers / layout.pp * in_flight + embedding / (t if sp else 1)
"""),
    Mistake("planner.activation_memory", "counted every layer of the model, not the stage's",
            says="all layers of the model", code=_ACTIVATION_TAIL + """
in_flight = in_flight_microbatches(layout, num_microbatches)
embedding = (8 * tokens + tokens * h) * in_flight
total = per_layer * model.num_layers * in_flight + embedding / (t if sp else 1)
"""),
    Mistake("planner.activation_memory", "left out the embedding's activations", says="embedding left out",
            code=_ACTIVATION_TAIL + """
in_flight = in_flight_microbatches(layout, num_microbatches)
total = per_layer * model.num_layers / layout.pp * in_flight
"""),
    Mistake("planner.llama3_70b_layout", "tensor parallelism across two nodes (tp=16)",
            says="tensor parallel group larger than a node", code="""
layout = Layout(tp=16, pp=4, cp=1, dp=1)
"""),
    Mistake("planner.llama3_70b_layout", "pure data parallelism: every GPU holds all 70B weights",
            says="does not fit", code="""
layout = Layout(tp=1, pp=1, cp=1, dp=64)
"""),
    Mistake("planner.llama3_70b_layout", "sizes that multiply to more than 64 GPUs", says="not 64", code="""
layout = Layout(tp=8, pp=4, cp=1, dp=4)
"""),
]
