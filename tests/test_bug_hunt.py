"""The silent-bug hunt (megalab/extras/bug_hunt.py, course/07_projects/05_silent_bug_hunt.ipynb).

For each bug, first a fast focused test of its function that fails on the bug with a message naming it (and
on the typical wrong fixes of tests/mistakes/bug_hunt.py), then the end-to-end trainers: the parallel run
equals the single-process one with the fix, and differs from it with the bug (`injected`).
"""

import pytest
import torch
import torch.nn.functional as F

from megalab.extras import bug_hunt as bh
from megalab.lab import launch
from megalab.lab.checks import all_of, close, equal, mistake, require

# ------------------------------------------------------------------ fast, focused: one per bug


@pytest.mark.exercise("bugs.tp_dropout_seed")
def test_each_tensor_parallel_rank_gets_its_own_dropout_stream():
    for base in (1234, 0):
        for tp in (2, 4):
            seeds = [bh.tensor_parallel_dropout_seed(base, r) for r in range(tp)]
            where = f"tensor_parallel_dropout_seed({base}, tp_rank) for tp_rank in 0..{tp - 1}: {seeds}"
            if len(set(seeds)) == 1:
                require(mistake("every TP rank gets the same seed: each slice of a TP region draws the same "
                                "dropout mask", where))
            if len(set(seeds)) < tp:
                require(mistake("two TP ranks share a dropout seed", where))
            if base in seeds:
                require(mistake(f"TP rank {seeds.index(base)} reuses the default seed {base}: its TP-region masks "
                                "repeat the masks of the dropout outside the region (Megatron adds 2718)", where))


@pytest.mark.exercise("bugs.vocab_padding")
def test_vocab_partition_gives_every_token_to_one_rank():
    for vocab, tp in [(67, 2), (66, 4), (64, 4), (10, 3), (5, 1)]:
        padded, per = bh.vocab_partition(vocab, tp)
        where = f"vocab_partition({vocab}, {tp}) = ({padded}, {per})"
        if padded < vocab:
            require(mistake(f"the slices drop the last {vocab - padded} token ids: no rank owns them (their "
                            "embedding is zero, their logit never exists); pad the vocabulary up", where))
        if padded != per * tp:
            require(mistake(f"the table has {padded} rows but the {tp} slices hold {per * tp}: pad the table "
                            "itself to tp x the slice", where))
        if padded - vocab >= tp:
            require(mistake(f"padded by {padded - vocab} rows: more than needed to divide by tp={tp}", where))


def _output_layer_case(rank, group):
    """Rank `rank` of tp=2 (group: both ranks, threads of tests/threaded_world.py): the output layer's logits and the
    gradient it sends back to the hidden state, against one process (x @ W^T, plain cross entropy) and against a
    layer without f (this rank's slice only)."""
    from megalab.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    from megalab.core.tensor_parallel.layers import full_shard_of

    config, vocab = bh.toy_tp_config(), 8
    g = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, config.hidden_size, generator=g)  # the single-process weight [V, h]
    x = torch.randn(2, 3, config.hidden_size, generator=g)
    labels = torch.randint(0, vocab, (2, 3), generator=g)
    layer = bh.build_output_layer(config, vocab, group)
    with torch.no_grad():
        layer.weight.copy_(full_shard_of(w, layer.weight, rank))
    xs = x.clone().requires_grad_()
    logits = layer(xs)
    out = {"logits_shape": tuple(logits.shape), "vocab": vocab}
    vocab_parallel_cross_entropy(logits, labels, group=group).sum().backward()
    out["grad"] = xs.grad
    xr = x.clone().requires_grad_()  # one process
    F.cross_entropy((xr @ w.t()).view(-1, vocab), labels.view(-1), reduction="sum").backward()
    out["reference"] = xr.grad
    xp = x.clone().requires_grad_()  # no f: this rank's slice's share of the gradient only
    vocab_parallel_cross_entropy(xp @ full_shard_of(w, layer.weight, rank).t(), labels, group=group).sum().backward()
    out["partial"] = xp.grad
    return out


@pytest.mark.exercise("bugs.output_layer")
def test_output_layer_sends_every_vocab_slices_gradient_back():
    """2 ranks as threads (tests/threaded_world.py); the real processes: the end-to-end TP trainer below."""
    from tests import threaded_world

    res = threaded_world.run(2, _output_layer_case)
    for rank, out in res.items():
        held, vocab = out["logits_shape"][-1], out["vocab"]
        if held != vocab // 2:
            cause = ("the whole vocabulary: gathered (gather_output=True?) or not split at all" if held == vocab else
                     "vocab/4: the layer was given vocab/2 and split it again (give ColumnParallelLinear the whole "
                     "padded vocabulary)" if held == vocab // 4 else "neither vocab/2 nor vocab")
            require(mistake(f"the logits hold {held} of the {vocab} vocabulary entries on rank {rank}, not this "
                            f"rank's slice of vocab/2 ({cause}): vocab_parallel_cross_entropy reads them as a slice "
                            "and computes a wrong loss", f"logits {out['logits_shape']}"))
        require(close(out["grad"], out["reference"], f"the hidden state's gradient on TP rank {rank}", atol=1e-5,
                      mistakes={"a plain Linear: the hidden state's gradient misses the other ranks' vocabulary "
                                "slices (no copy_to_tensor_model_parallel_region, whose backward all-reduces)":
                                out["partial"]}))


def _sync_points(pp_size: int, pp_rank: int, m: int) -> list[int]:
    from megalab.core.pipeline_parallel.schedules import get_num_warmup_microbatches

    warmup = get_num_warmup_microbatches(pp_size, pp_rank, m)
    return [b for b in range(m) if bh.should_sync_grads(b, m, warmup)]


@pytest.mark.exercise("bugs.pp_grad_sync")
def test_grad_sync_once_after_the_last_backward_on_every_stage():
    for pp in (2, 4):
        for m in (4, 8, 3, 1):
            for rank in range(pp):
                points = _sync_points(pp, rank, m)
                where = f"pp={pp}, stage {rank}, m={m}: syncs after backward(s) {points}, expected [{m - 1}]"
                if not points:
                    require(mistake("this stage never syncs its gradients over DP"
                                    + (" (the last stage's 1F1B has no warmup, so no cooldown phase)"
                                       if rank == pp - 1 else ""), where))
                if max(points) < m - 1:
                    require(mistake(f"synced before the last backward: the gradients of the {m - 1 - max(points)} "
                                    "backward(s) after it (the cooldown) never reach the other replicas", where))
                require(equal(points, [m - 1], f"the backwards after which pp={pp}, stage {rank}, m={m} syncs"))


@pytest.mark.exercise("bugs.cp_packed")
def test_cp_batch_holds_one_document_per_row():
    docs, s = bh.toy_documents(), 16
    batch = bh.cp_batch_from_documents(docs, s)
    rows = batch["tokens"].shape[0]
    if rows < len(docs):
        require(mistake(f"{len(docs)} documents packed into {rows} rows: ring attention has no document boundaries, "
                        "so each document attends to the ones before it in its row"))
    require(equal(tuple(batch["tokens"].shape), (len(docs), s), "the batch shape [documents, seq_length]"))
    for i, d in enumerate(docs):
        n = d.numel() - 1
        require(close(batch["tokens"][i, :n], d[:-1], f"row {i}'s first {n} tokens (document {i})"))
        require(close(batch["labels"][i, :n], d[1:], f"row {i}'s first {n} labels (document {i}, shifted)"))
        mask = batch["loss_mask"][i]
        if mask[n:].any():
            require(mistake(f"the padding is counted in the loss (loss_mask 1 on row {i}'s {s - n} padded tokens)"))
        require(close(mask[:n], torch.ones(n), f"row {i}'s loss mask on its real tokens"))


# ------------------------------------------------------------------ end to end: equal to one process only when fixed


def _tp_runs():
    from megalab.core.tensor_parallel.utils import vocab_size_with_padding
    from megalab.lab import dist as mdist

    mdist.init()
    torch.set_num_threads(1)
    ref = bh.train_tp(1, padded_vocab_size=vocab_size_with_padding(67, 1, 2))
    out = {"reference": ref["losses"], "fixed": bh.train_tp(2, master=ref["master"])}
    for name in ("vocab_padding", "output_layer"):
        with bh.injected(name):
            out[name] = bh.train_tp(2, master=ref["master"])
    single = bh.train_tp(1, hidden_dropout=0.25)["tp_mask"]  # one process: the full-width mask
    out["dropout_single"] = bh.mask_agreement(single, 2)
    out["dropout_fixed"] = bh.train_tp(2, hidden_dropout=0.25)["tp_mask"]
    with bh.injected("tp_dropout_seed"):
        out["dropout_buggy"] = bh.train_tp(2, hidden_dropout=0.25)["tp_mask"]
    torch.distributed.barrier()
    return out


@pytest.fixture(scope="module")
def tp_runs():
    return launch.run_function(_tp_runs, 2, launch=dict(timeout=240)).returns


def _curve_verdict(name, run, ref, buggy):
    return close(run, ref, f"the tp=2 loss curve ({name})", atol=1e-4,
                 mistakes={f"still the shipped bug ({name})": buggy})


@pytest.mark.integration
@pytest.mark.exercise("bugs.vocab_padding")
def test_tp_trainer_with_padded_vocab_equals_one_process(tp_runs):
    out = tp_runs[0]
    require(_curve_verdict("vocab_padding", out["fixed"]["losses"], out["reference"], out["vocab_padding"]["losses"]))
    require(equal(bh.same_curve(out["vocab_padding"]["losses"], out["reference"]), False,
                  "the shipped bug's curve equals one process's (the bug would be invisible)"))


@pytest.mark.integration
@pytest.mark.exercise("bugs.output_layer")
def test_tp_trainer_output_layer_equals_one_process_and_keeps_replicas_equal(tp_runs):
    out = tp_runs[0]
    require(_curve_verdict("output_layer", out["fixed"]["losses"], out["reference"], out["output_layer"]["losses"]))
    fixed_norms = {r: runs["fixed"]["grad_norms"] for r, runs in tp_runs.items()}
    buggy_norms = {r: runs["output_layer"]["grad_norms"] for r, runs in tp_runs.items()}
    require(all_of(equal(bh.replicated_grad_norms_agree(fixed_norms), True, "replicated gradients agree (fix)"),
                   equal(bh.replicated_grad_norms_agree(buggy_norms), False, "replicated gradients agree (bug)"),
                   equal((out["fixed"]["backward_all_reduces"], out["output_layer"]["backward_all_reduces"]), (2, 1),
                         "all-reduces in backward (fix, bug)")))


@pytest.mark.integration
@pytest.mark.exercise("bugs.tp_dropout_seed")
def test_tp_trainer_dropout_masks_are_independent_like_one_process(tp_runs):
    single = tp_runs[0]["dropout_single"]
    fixed = bh.mask_agreement(torch.cat([tp_runs[r]["dropout_fixed"] for r in sorted(tp_runs)], -1), 2)
    buggy = bh.mask_agreement(torch.cat([tp_runs[r]["dropout_buggy"] for r in sorted(tp_runs)], -1), 2)
    require(equal(abs(single - 0.625) < 0.05, True, f"one process's halves agree on {single:.3f} (p=0.25: 0.625)"))
    if fixed == 1.0:
        require(mistake("every TP rank gets the same seed: the two halves of the TP region's dropout mask are equal"))
    require(all_of(equal(abs(fixed - single) < 0.05, True, f"the TP ranks' masks agree on {fixed:.3f}, one process "
                                                           f"{single:.3f}"),
                   equal(buggy, 1.0, "the shipped bug's mask agreement")))


def _pp_dp_runs():
    from megalab.lab import dist as mdist

    mdist.init()
    torch.set_num_threads(1)
    fixed = bh.train_pp_dp(2)
    with bh.injected("pp_grad_sync"):
        buggy = bh.train_pp_dp(2)
    ref = bh.train_pp_dp_reference(2, 2)
    torch.distributed.barrier()
    return {"fixed": fixed, "buggy": buggy, "reference": ref}


@pytest.mark.integration
@pytest.mark.exercise("bugs.pp_grad_sync")
def test_pp_dp_trainer_equals_one_process_only_when_fixed():
    res = launch.run_function(_pp_dp_runs, 4, launch=dict(timeout=240)).returns
    verdicts, buggy_differs = [], False
    for rank, out in res.items():
        stage, ref = out["fixed"]["stage"], out["reference"]
        for i, (p, q, b) in enumerate(zip(out["fixed"]["params"], ref["params"][stage], out["buggy"]["params"])):
            verdicts.append(close(p, q, f"rank {rank} (stage {stage}) parameter {i} after training", atol=1e-5,
                                  mistakes={"still the shipped bug: the last stage never syncs over DP": b}))
            buggy_differs |= not torch.allclose(b, q, atol=1e-5)
        if out["fixed"]["losses"]:
            verdicts.append(close(out["fixed"]["losses"], ref["losses"], f"rank {rank}'s DP-averaged loss", atol=1e-5))
    require(all_of(*verdicts))
    require(equal(buggy_differs, True, "the shipped bug's parameters differ from one process's"))
    for stage in (0, 1):
        norms = [out["fixed"]["grad_norms"] for out in res.values() if out["fixed"]["stage"] == stage]
        require(equal(norms[0] == norms[1], True, f"stage {stage}'s DP replicas' gradient norms agree"))


def _cp_runs():
    from megalab.lab import dist as mdist

    mdist.init()
    torch.set_num_threads(1)
    fixed = bh.train_cp(2)
    with bh.injected("cp_packed"):
        buggy = bh.train_cp(2)
    torch.distributed.barrier()
    return {"fixed": fixed, "buggy": buggy}


@pytest.mark.integration
@pytest.mark.exercise("bugs.cp_packed")
def test_cp_trainer_equals_one_process_document_by_document_only_when_fixed():
    out = launch.run_function(_cp_runs, 2, launch=dict(timeout=240)).returns[0]
    ref = out["fixed"]["reference_losses"]
    require(close(out["fixed"]["losses"], ref, "the cp=2 loss curve (per real token)", atol=1e-5,
                  mistakes={"still the shipped bug: documents packed into rows": out["buggy"]["losses"]}))
    require(equal(bh.same_curve(out["buggy"]["losses"], ref, 1e-5), False,
                  "the shipped bug's curve equals one process's (the bug would be invisible)"))


def test_buggy_versions_are_the_regions_bug():
    """injected() runs each region's shipped bug (SHIPPED = the region's `### BUGGY` lines), and puts the fix back."""
    from pathlib import Path

    from megalab.lab.exercises import parse_regions

    path = Path(bh.__file__)
    regions, problems = parse_regions(path.read_text(), "megalab/extras/bug_hunt.py")
    require(equal(problems, [], "problems of the exercise markers in bug_hunt.py"))
    buggy = {ex.id.removeprefix("bugs."): "\n".join(line.strip() and line[len(ex.indent):] for line in ex.buggy)
             for ex in regions}
    require(equal(buggy, bh.SHIPPED, "the regions' BUGGY lines (bug_hunt.SHIPPED must hold the same code)"))
    require(all_of(equal(bh.buggy_version("tp_dropout_seed")(7, 1), 7, "buggy seed"),
                   equal(bh.buggy_version("vocab_padding")(67, 2), (66, 33), "buggy vocab_partition(67, 2)"),
                   equal(bh.buggy_version("pp_grad_sync")(3, 4, 0), False, "buggy sync on the last stage")))
    with bh.injected("vocab_padding"):
        require(equal(bh.vocab_partition(67, 2), (66, 33), "vocab_partition inside injected('vocab_padding')"))
    require(equal(bh.vocab_partition(67, 2), (68, 34), "vocab_partition after injected(...)"))
