"""Refit and rollouts of the RL loop (megalab/rl/parallel.py), measured on 4 gloo processes and predicted.

1. Refit: the trainer at tp2·pp2 -> the engine at tp1 (4 replicas) and tp2 (2 replicas), swap_model_weights with
   the plan cached, for the RL policy and a wider model. Measured: the bytes over the wire (all ranks) and the
   seconds (the slowest rank, median). Predicted from the planner's pieces: every rank's messages, each a
   step_time.collective_time("send_recv") on a gloo Link fitted here (comm.fit_alpha_beta to one-way
   point-to-point messages of 1 KiB .. 1 MiB between two ranks while the other pair does the same), the
   slowest rank's max(sends, receives); plus the two agreement rounds (all_gather of a few bytes) and the
   copies (staging, install: elementwise_time on the calibrated memory rate).
2. Rollouts: each engine-tp1 replica generates its share of one GRPO step's rollouts (P x G, ragged, 1-3 tokens).
   Predicted from the same pieces (extras/calc and step_time have no decode model): a roofline per engine step
   (the prefill, then one decode step per token) of its GEMMs (gemm_time, the calibrated fp32 matmul rate and
   per-call overhead, the 4 ranks sharing the cores) and its memory-bound work (elementwise_time); then with every
   other torch op the rollouts dispatch (counted with a TorchDispatchMode) at the calibrated per-call overhead.
   At this model's size the ops, not the FLOPs, set the time; the rest of the ratio is Python (the engine's
   scheduling, the paged cache's bookkeeping) that no piece of the model counts.

    python benchmarks/refit.py            # ~25 s at load 8 (a 4-rank launch is ~12 of them); --quick: the policy only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report  # noqa: E402

RANKS = 4
PING_BYTES = tuple(2**k for k in range(10, 21, 2))  # 1 KiB .. 1 MiB
MODELS = {"policy": {}, "wide": dict(num_layers=4, hidden_size=256, num_attention_heads=8)}  # changes to the policy's


def model_config(name: str):
    """The RL policy's config (train_rl.policy_config) with MODELS[name]'s sizes (the derived sizes recomputed)."""
    from megalab.core.transformer.transformer_config import TransformerConfig
    from megalab.extras.tiny_gpt import TINY_CONFIG
    from megalab.rl.agent.arithmetic_agent import VOCAB_SIZE

    return TransformerConfig(**{**TINY_CONFIG, "vocab_size": VOCAB_SIZE, "seq_length": 8, **MODELS[name]})


def _max_over_ranks(seconds: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def ping(repeats: int) -> dict:
    """One-way seconds of a message of each size, ranks 0->1 and 2->3 at once (median; the slower pair)."""
    import torch.distributed as dist

    rank, out = dist.get_rank(), {"nbytes": [], "seconds": []}
    peer = rank ^ 1
    for nbytes in PING_BYTES:
        buffer, times = torch.zeros(nbytes // 4), []
        for i in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank % 2 == 0:
                dist.send(buffer, peer)
                dist.recv(buffer[:1], peer)  # the receiver says it has it all
            else:
                dist.recv(buffer, peer)
                dist.send(buffer[:1], peer)
            if i:  # the first sets up the connection
                times.append(_max_over_ranks(time.perf_counter() - start))
        out["nbytes"].append(nbytes)
        out["seconds"].append(statistics.median(times) / 2)  # a round trip: the message and a 4-byte reply
    return out


class CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (each costs about a kernel call's overhead on a CPU)."""
    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def rank_main(models: list[str], repeats: int) -> dict:
    """Inside every rank: the ping, then per model and engine layout the refits, then one step's rollouts."""
    import random

    import torch.distributed as dist

    from megalab.lab import dist as mdist
    from megalab.rl import parallel
    from megalab.rl.agent.arithmetic_agent import ArithmeticAgent
    from megalab.train_rl import GRPOConfig, rollout_sampling_params

    mdist.init("gloo")
    torch.set_num_threads(1)
    out = {"ping": ping(repeats), "refits": [], "rollouts": None}
    config = GRPOConfig()
    for name in models:
        for engine_tp in (1, 2):
            layout = parallel.build_layout(2, 2, engine_tp)
            chunk = parallel.build_trainer(layout, 0, model_config(name))
            engine = parallel.build_engine_replica(layout, config, model_config(name))
            dist.barrier()
            start = time.perf_counter()
            _, _, plan = parallel.refit(chunk, engine, layout)  # builds the plan (all_gather of the metadata)
            first = _max_over_ranks(time.perf_counter() - start)
            seconds = []
            for _ in range(repeats):
                dist.barrier()
                stats, plan = parallel.swap_model_weights(chunk, engine, src_tp_group=layout.tp_group,
                                                          dst_tp_group=layout.engine_group, plan=plan)
                seconds.append(_max_over_ranks(stats.seconds))
            mine = {"sends": [op.nbytes for op in plan.send_ops if op.peer_rank != plan.rank],
                    "recvs": [op.nbytes for op in plan.recv_ops if op.peer_rank != plan.rank],
                    "local": stats.bytes_local,
                    "engine_bytes": sum(p.numel() * p.element_size() for p in engine.model.parameters())}
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            out["refits"].append({"model": name, "engine_tp": engine_tp, "first_seconds": first,
                                  "seconds": statistics.median(seconds), "ranks": ranks})
    # one GRPO step's rollouts on the engine-tp1 replicas (the policy, refit: the trained loop's setting)
    layout = parallel.build_layout(2, 2, 1)
    chunk, engine = parallel.build_trainer(layout), parallel.build_engine_replica(layout, config)
    parallel.refit(chunk, engine, layout)
    rng = random.Random(0)
    prompts = [ArithmeticAgent().get_prompt(rng) for _ in range(config.num_prompts)]
    n = config.num_prompts * config.group_size
    mine = [i for i in range(n) if i % layout.num_engine_replicas == layout.engine_replica]
    times = []
    for _ in range(1 + max(1, repeats // 2)):  # the first is a warm-up
        dist.barrier()
        start = time.perf_counter()
        requests = engine.generate([prompts[i // config.group_size].tokens for i in mine],
                                   [rollout_sampling_params(config, 0, i) for i in mine])
        times.append(time.perf_counter() - start)
    times = times[1:]
    lengths = [len(r.generated_tokens) for r in requests]
    with CountOps() as counted:  # the same rollouts once more: how many torch ops they dispatch
        engine.generate([prompts[i // config.group_size].tokens for i in mine],
                        [rollout_sampling_params(config, 0, i) for i in mine])
    out["rollouts"] = {"seconds": _max_over_ranks(statistics.median(times)), "lengths": lengths,
                       "steps": engine.steps // (2 + max(1, repeats // 2)), "requests": len(mine), "ops": counted.n}
    return out


# ------------------------------------------------------------------------------------------------ predictions
def fit_link(points: dict):
    from megalab.extras import comm
    from megalab.extras import step_time as st

    alpha, beta = comm.fit_alpha_beta(points["nbytes"], points["seconds"])
    if alpha < 0 or beta <= 0:  # noise: no latency, the largest message's rate
        alpha, beta = 0.0, points["seconds"][-1] / points["nbytes"][-1]
    return st.Link("gloo point-to-point, fitted here", bandwidth=1 / beta, latency=alpha)


def calibrate_cpu(link, quick: bool):
    """The calibrated machine (extras/calibrate.py's Calibration): fp32 matmul rate and overhead on one thread,
    the elementwise rate, and the gloo link fitted above."""
    from megalab.extras import calibrate, comm
    from megalab.lab.launch import available_cpus

    points = calibrate.measure_matmul(calibrate.MATMUL_SHAPES[:4 if quick else None], threads=(1,), repeats=3)
    overhead, per_flop = comm.fit_alpha_beta([2 * p["m"] * p["n"] * p["k"] for p in points],
                                             [p["seconds"] for p in points])
    if overhead < 0 or per_flop <= 0:
        largest = max(points, key=lambda p: p["m"] * p["n"] * p["k"])
        overhead, per_flop = 0.0, largest["seconds"] / (2 * largest["m"] * largest["n"] * largest["k"])
    return calibrate.Calibration(available_cpus(), {1: (overhead, 1 / per_flop)},
                                 {RANKS: calibrate.Link(link.latency, 1 / link.bandwidth, RANKS)},
                                 calibrate.measure_elementwise(repeats=3), machine="this machine")


def predict_refit(refit: dict, link, hw) -> dict[str, float]:
    """Seconds of one refit from the plan's messages: the slowest rank's max(sends, receives), each message
    alpha + bytes / bandwidth (step_time.collective_time "send_recv"), + 2 agreement all_gathers + the copies."""
    from megalab.extras import step_time as st

    def wire(sizes):
        return sum(st.collective_time("send_recv", b, 2, link) for b in sizes)

    wires = [max(wire(r["sends"]), wire(r["recvs"])) for r in refit["ranks"]]
    agreement = 2 * st.collective_time("all_gather", 64 * RANKS, RANKS, link)
    # staging: the received and local bytes written; install: the engine's weights read and written
    copies = max(st.elementwise_time(2 * (sum(r["recvs"]) + r["local"]) + 2 * r["engine_bytes"], hw.gpu)
                 for r in refit["ranks"])
    return {"wire": max(wires), "agreement": agreement, "copies": copies, "total": max(wires) + agreement + copies}


def predict_rollouts(rollouts: dict, hw) -> dict[str, float]:
    """Seconds for one replica's rollouts: per engine step (prefill, then one decode step per token) the GEMMs of a
    forward over its T tokens and its memory-bound passes; the steps from the measured response lengths."""
    from megalab.extras import step_time as st
    from megalab.rl.agent.arithmetic_agent import PROMPT_LENGTH

    c = model_config("policy")
    h, f, V, L = c.hidden_size, c.ffn_hidden_size, c.vocab_size, c.num_layers
    lengths = rollouts["lengths"]
    tokens_per_step = [len(lengths) * PROMPT_LENGTH] + [sum(n > k for n in lengths) for k in range(1, max(lengths))]

    def step(T: int, context: int) -> float:
        gemms = L * sum(st.gemm_time(T, n, k, hw.gpu, dtype_bytes=4) for n, k in ((3 * h, h), (h, h), (f, h), (h, f)))
        gemms += st.gemm_time(T, V, h, hw.gpu, dtype_bytes=4)  # the logits
        # per layer: two norms, GeLU, two residual adds (fp32, read + write) and the scores over the context
        memory = L * 4 * (2 * 2 * T * h + 2 * T * f + 2 * 2 * T * h + 2 * T * context * c.num_attention_heads)
        return gemms + st.elementwise_time(memory, hw.gpu)

    roofline = sum(step(T, PROMPT_LENGTH + k) for k, T in enumerate(tokens_per_step) if T)
    # every other op (norms, attention over the paged cache, sampling each request) at the calibrated per-call cost
    gemm_calls = len(tokens_per_step) * (4 * L + 1)
    dispatch = max(0, rollouts["ops"] - gemm_calls) * hw.gpu.kernel_overhead
    return {"roofline": roofline, "dispatch": dispatch, "total": roofline + dispatch, "steps": len(tokens_per_step),
            "tokens": sum(lengths)}


CODE = """import sys
sys.path.insert(0, {path!r})
import refit
from megalab.lab.dist import publish
publish("measured", refit.rank_main({models!r}, {repeats}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="CI smoke: the policy only, 3 repeats")
    args = parser.parse_args()
    models = ["policy"] if args.quick else list(MODELS)
    if args.quick:
        args.repeats = 3
    torch.set_num_threads(1)
    from megalab.lab import launch

    res = launch.run(CODE.format(path=str(Path(__file__).resolve().parent), models=models, repeats=args.repeats),
                     RANKS, backend="gloo", timeout=300)
    measured = res.results["measured"][0]
    link = fit_link(measured["ping"])
    cal = calibrate_cpu(link, args.quick)
    hw = cal.hardware(RANKS, threads=1)
    rows, extra = [], {"link": {"alpha_us": link.latency * 1e6, "GB_per_s": link.bandwidth / 1e9},
                       "calibration": cal.to_json(), "load_average": os.getloadavg(), "refits": []}
    for refit in measured["refits"]:
        predicted = predict_refit(refit, link, hw)
        wire_bytes = sum(sum(r["sends"]) for r in refit["ranks"])
        rows.append([f"refit {refit['model']}: tp2·pp2 -> engine tp{refit['engine_tp']}", wire_bytes,
                     sum(len(r["sends"]) for r in refit["ranks"]), 1e3 * predicted["total"], 1e3 * refit["seconds"],
                     refit["seconds"] / predicted["total"]])
        extra["refits"].append({**{k: v for k, v in refit.items() if k != "ranks"}, "wire_bytes": wire_bytes,
                                "predicted": predicted})
    rollouts = measured["rollouts"]
    predicted = predict_rollouts(rollouts, hw)
    for what, key in (("roofline", "roofline"), (f"roofline + {rollouts['ops']} ops x call overhead", "total")):
        rows.append([f"rollouts: {rollouts['requests']} per tp1 replica (x{RANKS}), {what}", predicted["tokens"],
                     predicted["steps"], 1e3 * predicted[key], 1e3 * rollouts["seconds"],
                     rollouts["seconds"] / predicted[key]])
    extra["rollouts"] = {**rollouts, "predicted": predicted,
                         "tokens_per_s_measured": RANKS * predicted["tokens"] / rollouts["seconds"],
                         "tokens_per_s_predicted": RANKS * predicted["tokens"] / predicted["total"],
                         "tokens_per_s_roofline": RANKS * predicted["tokens"] / predicted["roofline"]}
    print(f"gloo point-to-point (fitted): alpha {link.latency * 1e6:.0f} µs, {link.bandwidth / 1e9:.2f} GB/s; "
          f"fp32 matmul {cal.matmul[1][1] / 1e9:.1f} GFLOP/s on one thread, {cal.matmul[1][0] * 1e6:.1f} µs a call")
    report("refit", ["case", "bytes / tokens", "messages / steps", "predicted ms", "measured ms",
                     "measured / predicted"], rows, extra)
    r = extra["rollouts"]
    print(f"rollout throughput (4 replicas): measured {r['tokens_per_s_measured']:.0f} tokens/s, predicted "
          f"{r['tokens_per_s_predicted']:.0f} (the roofline alone {r['tokens_per_s_roofline']:.0f}) tokens/s "
          f"(load {extra['load_average'][0]:.1f})")


if __name__ == "__main__":
    main()
