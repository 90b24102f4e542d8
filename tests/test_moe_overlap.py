"""EP communication overlap (combined 1F1B): every all-to-all of one micro-batch hidden behind the other's compute,
and the gradients of the unoverlapped run and of one process holding every expert (threaded worlds of 2 ranks)."""

import pytest
import torch

from megalab.core.pipeline_parallel import combined_1f1b as c1
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.lab.checks import RIGHT, Verdict, all_of, close, equal, mistake, require, wrong
from tests import threaded_world

CONFIG = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=8, seq_length=8,
                           num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
NODES = ("pre_dispatch", "moe_dispatch", "mlp", "moe_combine")
COMM = {"moe_dispatch", "moe_combine"}


def loss_func(output, target):
    return ((output - target) ** 2).mean()


def _data(rank, m, tokens=6):
    gen = torch.Generator().manual_seed(10 + rank)
    return ([torch.randn(tokens, CONFIG.hidden_size, generator=gen) for _ in range(m)],
            [torch.randn(tokens, CONFIG.hidden_size, generator=gen) for _ in range(m)])


def _layers(num_layers, group):
    torch.manual_seed(0)
    return [c1.MoETransformerLayer(CONFIG, group) for _ in range(num_layers)]


def _run(num_layers, m, overlap):
    def body(rank, group):
        layers = _layers(num_layers, group)
        inputs, targets = _data(rank, m)
        losses, input_grads, records = c1.combined_1f1b_schedule_for_no_pipelining(layers, inputs, targets, loss_func,
                                                                                   overlap)
        return dict(losses=losses, input_grads=input_grads, records=records,
                    grads={n: p.grad for i, layer in enumerate(layers) for n, p in layer.named_parameters(prefix=str(i))})
    return threaded_world.run(2, body)


def check_overlap(records, m: int, num_layers: int, rank: int) -> Verdict:
    """Every node ran once each way; every all-to-all of the combined steps was hidden (only micro-batch 0's forward
    and micro-batch m-1's backward have no partner)."""
    ran = [(r.microbatch, r.layer, r.name, r.direction) for r in records]
    for mb in range(m):
        for layer in range(num_layers):
            for name in NODES:
                for direction, word in (("F", "forward"), ("B", "backward")):
                    if ran.count((mb, layer, name, direction)) != 1:
                        return wrong(f"rank {rank}: the {name} {word} of micro-batch {mb} (layer {layer}) ran "
                                     f"{ran.count((mb, layer, name, direction))} times, expected once")
    exposed = [r for r in c1.exposed_all_to_alls(records)
               if not (r.direction == "F" and r.microbatch == 0) and not (r.direction == "B" and r.microbatch == m - 1)]
    if not exposed:
        return RIGHT
    kinds = sorted({(r.name, r.direction) for r in exposed})
    first = exposed[0]
    detail = (f"rank {rank}: the {first.name} {'forward' if first.direction == 'F' else 'backward'} all-to-all of "
              f"micro-batch {first.microbatch} (layer {first.layer}) was waited for with no compute of the other "
              f"micro-batch started while it was in flight; exposed: {kinds}")
    if len(kinds) == 4:
        return mistake("none of the four all-to-alls is hidden: each was waited for as soon as it started", detail)
    return wrong(detail)


@pytest.mark.exercise("moe.ep_overlap")
def test_overlap_hides_every_all_to_all_with_the_same_gradients():
    for num_layers, m in ((1, 2), (2, 3)):
        overlapped, plain = _run(num_layers, m, True), _run(num_layers, m, False)
        for rank in range(2):
            got, ref = overlapped[rank], plain[rank]
            where = f"rank {rank}, {num_layers} layer(s), {m} micro-batches"
            require(check_overlap(got["records"], m, num_layers, rank))
            require(all_of(*(close(g, r, f"{where}: the gradient of micro-batch {i}'s input (overlapped vs not)")
                             for i, (g, r) in enumerate(zip(got["input_grads"], ref["input_grads"])))))
            require(close(torch.stack(got["losses"]), torch.stack(ref["losses"]), f"{where}: the losses"))
            require(all_of(*(close(got["grads"][n], ref["grads"][n], f"{where}: the gradient of {n}, overlapped vs not")
                             for n in ref["grads"])))


@pytest.mark.exercise("moe.ep_overlap")
def test_expert_parallel_layer_equals_one_process_with_every_expert():
    m, num_layers = 3, 2
    overlapped = _run(num_layers, m, True)
    reference = _layers(num_layers, None)  # one process: all 4 experts, every rank's tokens
    data = [_data(rank, m) for rank in range(2)]
    for i in range(m):
        x = torch.cat([data[r][0][i] for r in range(2)]).requires_grad_()
        out = x
        for layer in reference:
            out = layer(out)
        halves = out.chunk(2)
        loss = sum(loss_func(halves[r], data[r][1][i]) / m for r in range(2))
        loss.backward()
        for r in range(2):
            require(close(overlapped[r]["input_grads"][i], x.grad.chunk(2)[r],
                          f"rank {r}: the gradient of micro-batch {i}'s input vs one process with every expert"))
    for n, p in ((n, p) for i, layer in enumerate(reference) for n, p in layer.named_parameters(prefix=str(i))):
        if ".experts." in n:  # rank r holds experts 2r, 2r+1 as its local experts 0, 1
            e = int(n.split("local_experts.")[1].split(".")[0])
            local = n.replace(f"local_experts.{e}.", f"local_experts.{e % 2}.")
            require(close(overlapped[e // 2]["grads"][local], p.grad, f"the gradient of {n} (on rank {e // 2})"))
        else:  # replicated: each rank's gradient covers its own tokens
            require(close(overlapped[0]["grads"][n] + overlapped[1]["grads"][n], p.grad,
                          f"the gradient of {n}, summed over the 2 ranks"))
    require(equal(len(c1.exposed_all_to_alls(overlapped[0]["records"])), 2 * 2 * num_layers,
                  "all-to-alls exposed on rank 0 (only micro-batch 0's forward and the last backward)"))
