"""Named mistakes of the silent-bug hunt (megalab/extras/bug_hunt.py): for each bug, the bug as shipped (what the
learner's copy starts with) and a plausible wrong fix. Each must fail the bug's focused test, named."""

from tests.mistakes import Mistake

MISTAKES = [
    Mistake("bugs.tp_dropout_seed", "the shipped bug: one seed for every TP rank", says="every TP rank gets the same seed",
            code="""
return base_seed
"""),
    Mistake("bugs.tp_dropout_seed", "offset by the TP rank only: TP rank 0 reuses the default stream",
            says="reuses the default seed", code="""
return base_seed + tp_rank
"""),
    Mistake("bugs.vocab_padding", "the shipped bug: slices rounded down, the last ids dropped",
            says="drop the last", code="""
per_partition = vocab_size // tp_size  # each rank's slice
return per_partition * tp_size, per_partition
"""),
    Mistake("bugs.vocab_padding", "slices rounded up, but the table itself left unpadded",
            says="pad the table itself", code="""
per_partition = -(-vocab_size // tp_size)
return vocab_size, per_partition
"""),
    Mistake("bugs.output_layer", "the shipped bug: a plain Linear over this rank's vocabulary rows",
            says="a plain Linear", code="""
return nn.Linear(config.hidden_size, vocab_size // dist.get_world_size(tp_group), bias=False)
"""),
    Mistake("bugs.output_layer", "a ColumnParallelLinear that gathers its output (gather_output=True)",
            says="gather_output", code="""
return ColumnParallelLinear(config.hidden_size, vocab_size, config=config, init_method=init_method_normal(0.02),
                            bias=False, gather_output=True, tp_group=tp_group)
"""),
    Mistake("bugs.pp_grad_sync", "the shipped bug: sync only in the cooldown phase (the last stage has none)",
            says="never syncs", code="""
in_cooldown = backward_index >= num_microbatches - num_warmup
return in_cooldown and backward_index == num_microbatches - 1
"""),
    Mistake("bugs.pp_grad_sync", "sync after the last steady-state backward, before the cooldown's",
            says="synced before the last backward", code="""
return backward_index == num_microbatches - 1 - num_warmup
"""),
    Mistake("bugs.cp_packed", "the shipped bug: packed rows, PackedSeqParams dropped", says="packed into", code="""
batch = pack_batch(docs, seq_length)  # documents back to back in rows of seq_length
batch.pop("packed_seq_params")  # ContextParallelAttention refuses them
return batch
"""),
    Mistake("bugs.cp_packed", "one row per document, but the padding left in the loss",
            says="padding is counted in the loss", code="""
rows = [pack_batch([doc], seq_length) for doc in docs]
batch = {key: torch.cat([row[key] for row in rows]) for key in ("tokens", "labels", "position_ids")}
batch["loss_mask"] = torch.ones(batch["tokens"].shape)
return batch
"""),
]
