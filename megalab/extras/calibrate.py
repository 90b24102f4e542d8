"""Calibrate the cost model to THIS machine, then predict the course's own runs before measuring them.

Two measurements fix the model (chapter 01 · 03's idea: a cost is a latency plus a size over a rate):

    matmul     t(m, n, k) = overhead + 2 m n k / rate          fp32 on CPU, 1 thread and all threads
    gloo       one message of M bytes: alpha + M beta            fitted from dist.all_reduce on 2 and 4
               (a ring all-reduce: 2 (n-1) alpha + 2 (n-1)/n M beta, comm.fit_alpha_beta)

both fitted with `comm.fit_alpha_beta` (a matmul is a "message" of 2mnk FLOPs). One thing is
laptop-specific: torchrun's ranks share the cores (the launcher gives each cpus // ranks threads, at
least one), so with more ranks than cores each rank runs at `cores / (ranks x threads)` of a core.

    measure_matmul ──┐
                     ├── Calibration (cached as JSON in mdist.cache_dir("calibration"))
    measure_gloo  ───┘        │ .gemm_time  .link  .rank_share  .hardware()  (the planner's Hardware)
                              ▼
    predict_ddp_step  predict_tp_mlp  predict_pipeline  predict_cp_attention  predict_moe_all_to_all
    predict_recompute

`calibration()` measures once (about 10 s: a few matmuls, two short gloo launches) and reuses the
cache afterwards; `calibration(refresh=True)`, or `python -m megalab.extras.calibrate`, measures again.
Not in Megatron-LM: it is the course's way of checking that the step-time model it teaches for
clusters (`extras/planner.py`) also predicts the runs the reader can make.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from megalab.extras import comm

CACHE_NAME = "calibration"
CACHE_FILE = "laptop.json"
# (m, n, k): overhead-bound to rate-bound, the shapes of the course's runs; about 0.5 s on one core
MATMUL_SHAPES = ((16, 16, 16), (64, 64, 64), (128, 128, 128), (256, 512, 512), (512, 512, 512), (256, 1024, 1024))
GLOO_NUMELS = tuple(2**k for k in range(8, 21, 2))  # float32: 1 KiB .. 4 MiB
GLOO_WORLD_SIZES = (2, 4)
FP32 = 4


class CalibrationError(ValueError):
    """A calibration that cannot predict anything: says what to measure or provide."""


# --------------------------------------------------------------------------------------------- measuring
def _best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` calls after one warm-up: the least disturbed by other work on the machine."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul(shapes=MATMUL_SHAPES, threads: tuple[int, ...] | None = None, repeats: int = 5) -> list[dict]:
    """Seconds of an fp32 [m, k] @ [k, n] on CPU for every shape and thread count (best of `repeats`)."""
    from megalab.lab.launch import available_cpus

    threads = threads or tuple(sorted({1, available_cpus()}))
    before = torch.get_num_threads()
    points = []
    try:
        for t in threads:
            torch.set_num_threads(t)
            for m, n, k in shapes:
                g = torch.Generator().manual_seed(0)
                a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
                points.append({"threads": t, "m": m, "n": n, "k": k, "seconds": _best_seconds(lambda: a @ b, repeats)})
    finally:
        torch.set_num_threads(before)
    return points


def measure_elementwise(numel: int = 2**18, repeats: int = 5) -> float:
    """Seconds per element of an fp32 elementwise op on one thread (torch.exp: softmax's op), best of `repeats`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        return _best_seconds(lambda: torch.exp(x), repeats) / numel
    finally:
        torch.set_num_threads(before)


def gloo_rank(numels=GLOO_NUMELS, repeats: int = 5) -> dict[str, list[float]]:
    """Inside every rank (launch.run_function): median seconds of dist.all_reduce per float32 size."""
    import torch.distributed as dist

    from megalab.lab import dist as mdist

    mdist.init()
    out: dict[str, list[float]] = {"nbytes": [], "seconds": []}
    for numel in numels:
        tensor = torch.zeros(numel)
        out["nbytes"].append(numel * FP32)
        out["seconds"].append(comm.time_collective(lambda t: dist.all_reduce(t), tensor, repeats=repeats))
    dist.barrier()
    return out


def measure_gloo(world_sizes=GLOO_WORLD_SIZES, numels=GLOO_NUMELS, repeats: int = 5) -> dict[int, dict]:
    """dist.all_reduce timings on gloo for each world size: {n: {"nbytes": [...], "seconds": [...]}}."""
    from megalab.lab import launch

    return {n: launch.run_function(gloo_rank, n, numels, repeats, launch=dict(timeout=120)).returns[0]
            for n in world_sizes}


# --------------------------------------------------------------------------------------------- the model
def _fit(sizes, seconds, latency_steps: float = 1.0, size_factor: float = 1.0, what: str = "") -> tuple[float, float]:
    """(latency, time per unit) by comm.fit_alpha_beta; under noise the latency can come out negative: then 0."""
    if len(sizes) < 2:
        raise CalibrationError(f"{what}: need at least two measured sizes to fit a latency and a rate, got {len(sizes)}")
    if any(not s > 0 for s in seconds):
        raise CalibrationError(f"{what}: every measured time must be > 0 (got {list(seconds)}); measure again")
    latency, per_unit = comm.fit_alpha_beta(sizes, seconds, latency_steps=latency_steps, bytes_factor=size_factor)
    if latency < 0 or per_unit <= 0:  # the small sizes were slower than the line: keep the rate of the big ones
        latency = max(latency, 0.0)
        per_unit = max((s - latency_steps * latency) / (size_factor * m) for m, s in zip(sizes, seconds))
    return latency, per_unit


@dataclass(frozen=True)
class Link:
    """One message of M bytes takes alpha + M beta (chapter 01 · 03); `n` the ranks it was measured on."""

    alpha: float
    beta: float
    n: int

    @property
    def bandwidth(self) -> float:
        return 1 / self.beta


@dataclass(frozen=True)
class Calibration:
    """This machine, measured: matmul overhead and FLOP/s per thread count; a gloo Link per world size."""

    cpus: int
    matmul: dict[int, tuple[float, float]]  # threads -> (overhead s, FLOP/s)
    links: dict[int, Link]  # ranks -> Link
    elementwise: float = 0.0  # seconds per element of an fp32 elementwise op, one thread (0: not measured)
    points: dict = field(default_factory=dict, compare=False)  # the raw measurements
    machine: str = ""
    measured_at: str = ""
    load_average: tuple[float, ...] = ()

    def __post_init__(self):
        if self.cpus < 1:
            raise CalibrationError(f"cpus must be >= 1, got {self.cpus}")
        if not self.matmul:
            raise CalibrationError("no matmul rate: measure one (measure_matmul) or pass matmul={threads: (overhead, flops)}")
        if not self.links:
            raise CalibrationError("no gloo link: measure one (measure_gloo) or pass links={ranks: Link(alpha, beta, ranks)}")
        for t, (overhead, rate) in self.matmul.items():
            if not rate > 0 or overhead < 0 or not math.isfinite(rate):
                raise CalibrationError(f"matmul on {t} thread(s): need FLOP/s > 0 and overhead >= 0, "
                                       f"got {rate} FLOP/s, {overhead} s: measure again (measure_matmul)")
        for n, link in self.links.items():
            if not link.beta > 0 or not math.isfinite(link.beta):
                raise CalibrationError(f"gloo on {n} ranks: zero or infinite bandwidth (beta = {link.beta} s/B): "
                                       f"measure again (measure_gloo), or give beta = 1 / (bytes per second) > 0")
            if link.alpha < 0 or not math.isfinite(link.alpha):
                raise CalibrationError(f"gloo on {n} ranks: negative latency alpha = {link.alpha}: measure again")

    # ------------------------------------------------------------------ building
    @classmethod
    def from_measurements(cls, matmul_points: list[dict], gloo_points: dict[int, dict], cpus: int,
                          elementwise: float = 0.0, **meta) -> Calibration:
        """Fit the model to measure_matmul's and measure_gloo's outputs (or fake ones, in tests)."""
        if not matmul_points:
            raise CalibrationError("no matmul measurements: run measure_matmul() (or pass its list of points)")
        if not gloo_points:
            raise CalibrationError("no gloo measurements: run measure_gloo() (or pass {ranks: {'nbytes', 'seconds'}})")
        matmul = {}
        for t in sorted({p["threads"] for p in matmul_points}):
            mine = [p for p in matmul_points if p["threads"] == t]
            overhead, per_flop = _fit([2 * p["m"] * p["n"] * p["k"] for p in mine], [p["seconds"] for p in mine],
                                      what=f"matmul on {t} thread(s)")
            matmul[t] = (overhead, 1 / per_flop)
        links = {}
        for n, pts in gloo_points.items():
            n = int(n)
            if n < 2:
                raise CalibrationError(f"gloo timings on {n} rank(s) say nothing about a link: measure on 2 or more")
            alpha, beta = _fit(pts["nbytes"], pts["seconds"], 2 * (n - 1), 2 * (n - 1) / n, what=f"gloo on {n} ranks")
            links[n] = Link(alpha, beta, n)
        return cls(cpus, matmul, links, elementwise, {"matmul": matmul_points, "gloo": {int(n): p for n, p in gloo_points.items()}},
                   **meta)

    @classmethod
    def measure(cls, world_sizes=GLOO_WORLD_SIZES) -> Calibration:
        """Measure this machine now (a few seconds of matmuls, one short gloo launch per world size)."""
        from megalab.lab.launch import available_cpus

        matmul_points = measure_matmul()
        gloo_points = measure_gloo(world_sizes)
        return cls.from_measurements(matmul_points, gloo_points, available_cpus(), measure_elementwise(), machine=platform.node(),
                                     measured_at=time.strftime("%Y-%m-%d %H:%M:%S"), load_average=os.getloadavg())

    def to_json(self) -> str:
        d = asdict(self)
        d["links"] = {n: asdict(link) for n, link in self.links.items()}
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        d = json.loads(text)
        points = d.get("points", {})
        if "gloo" in points:  # JSON keys are strings
            points["gloo"] = {int(n): p for n, p in points["gloo"].items()}
        return cls(d["cpus"], {int(t): tuple(v) for t, v in d["matmul"].items()},
                   {int(n): Link(**v) for n, v in d["links"].items()}, d.get("elementwise", 0.0), points, d.get("machine", ""),
                   d.get("measured_at", ""), tuple(d.get("load_average", ())))

    # ------------------------------------------------------------------ the machine as the model sees it
    def threads_per_rank(self, ranks: int) -> int:
        """What megalab's launcher gives each rank: cpus // ranks threads, at least one."""
        return max(1, self.cpus // ranks)

    def rank_share(self, ranks: int, threads: int | None = None) -> float:
        """Share of its threads' cores a rank gets when `ranks` ranks run at once: 1, or less when they
        oversubscribe the cores (4 ranks x 1 thread on 2 cores: 0.5)."""
        threads = threads or self.threads_per_rank(ranks)
        return min(1.0, self.cpus / (ranks * threads))

    def flops(self, threads: int = 1) -> float:
        """Peak fp32 matmul FLOP/s on `threads` threads (measured counts, else the nearest below, scaled)."""
        if threads in self.matmul:
            return self.matmul[threads][1]
        below = max((t for t in self.matmul if t <= threads), default=min(self.matmul))
        return self.matmul[below][1] * min(threads, self.cpus) / min(below, self.cpus)

    def gemm_time(self, m: int, n: int, k: int, ranks: int = 1, threads: int | None = None, batch: int = 1) -> float:
        """Seconds of `batch` [m, k] @ [k, n] on one of `ranks` ranks running at once (launcher's threads)."""
        if min(m, n, k, batch) < 0:
            raise ValueError(f"matmul sizes must be >= 0, got m={m} n={n} k={k} batch={batch}")
        threads = threads or self.threads_per_rank(ranks)
        overhead = self.matmul.get(threads, self.matmul[min(self.matmul)])[0]
        return (overhead + 2 * m * n * k * batch / self.flops(threads)) / self.rank_share(ranks, threads)

    def elementwise_time(self, elements: float, ranks: int = 1, threads: int | None = None) -> float:
        """Seconds of `elements` fp32 elementwise operations (one op on one element each) on one of `ranks` ranks."""
        if not self.elementwise > 0:
            raise CalibrationError("this calibration has no elementwise rate: recalibrate (calibration(refresh=True)) "
                                   "or pass elementwise= seconds per element")
        threads = threads or self.threads_per_rank(ranks)
        return elements * self.elementwise / min(threads, self.cpus) / self.rank_share(ranks, threads)

    def link(self, ranks: int) -> Link:
        """The gloo link measured on `ranks` ranks (or on the nearest world size measured)."""
        nearest = min(self.links, key=lambda n: (abs(n - ranks), -n))
        return self.links[nearest]

    def hardware(self, ranks: int = 1):
        """The planner's Hardware for one of `ranks` ranks on this machine."""
        from megalab.extras import planner

        if not hasattr(planner, "Hardware"):
            raise CalibrationError("extras/planner.py has no Hardware dataclass yet: merge the planner branch")
        link = self.link(ranks)
        return planner.Hardware.from_calibration(self, ranks) if hasattr(planner.Hardware, "from_calibration") else \
            planner.Hardware(name=f"{self.machine or 'this machine'} ({ranks} gloo ranks)",
                             peak_flops=self.flops(self.threads_per_rank(ranks)) * self.rank_share(ranks),
                             alpha=link.alpha, bandwidth=link.bandwidth)

    def summary(self) -> str:
        lines = [f"calibration of {self.machine or 'this machine'} ({self.cpus} cores), {self.measured_at}, "
                 f"load average {', '.join(f'{x:.1f}' for x in self.load_average)}"]
        for t, (overhead, rate) in sorted(self.matmul.items()):
            lines.append(f"  fp32 matmul, {t} thread(s): {rate / 1e9:6.1f} GFLOP/s, {overhead * 1e6:6.1f} µs per call")
        if self.elementwise:
            lines.append(f"  fp32 elementwise (exp), 1 thread: {self.elementwise * 1e9:.2f} ns per element")
        for n, link in sorted(self.links.items()):
            lines.append(f"  gloo, {n} ranks: alpha = {link.alpha * 1e6:7.1f} µs, 1/beta = {link.bandwidth / 1e9:5.2f} GB/s")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------- the cache
def cache_path() -> Path:
    from megalab.lab import dist as mdist

    return mdist.cache_dir(CACHE_NAME) / CACHE_FILE


def save(cal: Calibration) -> Path:
    """Write `cal` to the cache (whole or not at all: publish_dir)."""
    import tempfile

    from megalab.lab import dist as mdist

    final = cache_path().parent
    final.parent.mkdir(parents=True, exist_ok=True)
    built = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}-", dir=final.parent))
    (built / CACHE_FILE).write_text(cal.to_json())
    mdist.publish_dir(built, final)
    return final / CACHE_FILE


def load() -> Calibration | None:
    """The cached calibration, or None when there is none (or it no longer reads)."""
    path = cache_path()
    try:
        return Calibration.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def calibration(refresh: bool = False) -> Calibration:
    """This machine's calibration: the cached one, or measured now (and cached) when there is none or refresh=True."""
    cal = None if refresh else load()
    if cal is None:
        cal = Calibration.measure()
        save(cal)
    return cal


# --------------------------------------------------------------------------------------------- predictions
# Each returns seconds: {"compute": ..., "communication": ..., "total": ...} (and the parts it adds up).
# Collective times are chapter 01's alpha-beta counts with the link measured on the same number of ranks.

def collective_time(cal: Calibration, op: str, ranks: int, nbytes: float) -> float:
    """Seconds of one collective on `ranks` gloo ranks; nbytes = the full payload (comm_tracer's convention:
    the all-gather's output, the reduce-scatter's input, the all-to-all's input)."""
    if ranks < 2 or nbytes == 0:
        return 0.0
    link = cal.link(ranks)
    if op == "all_reduce":
        return comm.all_reduce_time(ranks, nbytes, link.alpha, link.beta, "ring")
    if op in ("all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
              "reduce_scatter_tensor", "all_to_all"):  # n-1 messages of nbytes/n from every rank
        return (ranks - 1) * (link.alpha + nbytes / ranks * link.beta)
    if op in ("isend", "send"):  # one message
        return link.alpha + nbytes * link.beta
    raise ValueError(f"no cost model for collective {op!r}: use all_reduce, all_gather, reduce_scatter, "
                     f"all_to_all or isend")


def traced_time(cal: Calibration, records) -> float:
    """Seconds of the collectives a CollectiveTracer recorded (its records, in order, none overlapped)."""
    return sum(collective_time(cal, r.op, r.group_size, r.payload_bytes) for r in records)


def _result(compute: float, communication: float, exposed: float | None = None, **parts) -> dict[str, float]:
    exposed = communication if exposed is None else exposed
    return {"compute": compute, "communication": communication, "exposed communication": exposed,
            "total": compute + exposed, **parts}


def overlap_hides(cal: Calibration, ranks: int) -> bool:
    """Whether gloo's communication threads can run beside the compute: only with more cores than ranks
    (with one core or less per rank, sending steals the time it would hide behind)."""
    return ranks < cal.cpus


def predict_ddp_step(cal: Calibration, layers: int, width: int, batch: int, ranks: int,
                     bucket_size: int | None = None, overlap_grad_reduce: bool = False) -> dict[str, float]:
    """One step (forward, backward, gradient sync) of 03·01's stack of `layers` Linear(width, width) + tanh,
    `batch` rows per rank, fp32: bucket_size=None is the naive one all-reduce per parameter."""
    from megalab.core.distributed.param_and_grad_buffer import build_buckets

    gemm = cal.gemm_time(batch, width, width, ranks)
    weight_grad = cal.gemm_time(width, width, batch, ranks)
    forward = layers * gemm
    backward = layers * weight_grad + (layers - 1) * gemm  # no input gradient for the first layer
    numels = [width * width, width] * layers
    if bucket_size is None:
        messages = [n * FP32 for n in numels]
    else:
        messages = [(end - start) * FP32 for _, start, end in build_buckets(numels, bucket_size, pad_to=ranks)]
    times = [collective_time(cal, "all_reduce", ranks, m) for m in messages]
    communication = sum(times)
    exposed = communication
    if overlap_grad_reduce and overlap_hides(cal, ranks):  # all but the last bucket can hide behind backward
        exposed = max(times[-1], communication - backward)
    return _result(forward + backward, communication, exposed, forward=forward, backward=backward,
                   messages=len(messages))


def predict_all_reduce(cal: Calibration, ranks: int, nbytes: float) -> float:
    """01·03: seconds of one dist.all_reduce of `nbytes` on `ranks` gloo ranks."""
    return collective_time(cal, "all_reduce", ranks, nbytes)


def predict_pipeline(cal: Calibration, pp: int, num_microbatches: int, num_model_chunks: int = 1,
                     forward_s: float = 0.02, backward_s: float = 0.04, message_bytes: float = 128) -> dict[str, float]:
    """03·07: one step of 1F1B (or GPipe: the same bubble) / interleaved 1F1B on `pp` ranks whose stages take
    forward_s + backward_s per micro-batch (all chunks together): compute (1 + bubble), every p2p exposed
    (one activation forward and one gradient backward per micro-batch and chunk, as the planner counts them)."""
    from megalab.extras.pipeline_sim import bubble_fraction

    m, v = num_microbatches, num_model_chunks
    compute = m * (forward_s + backward_s)
    bubble = bubble_fraction(pp, m, v) * compute
    messages = 2 * m * v if pp > 1 else 0
    communication = messages * collective_time(cal, "isend", pp, message_bytes)
    out = _result(compute + bubble, communication, busy=compute, bubble=bubble, messages=messages)
    return out


def predict_cp_attention(cal: Calibration, seq_length: int, cp: int, rank: int, zigzag: bool = True,
                         batch: int = 1, heads: int = 4, head_dim: int = 32, ranks: int | None = None) -> dict[str, float]:
    """03·08: one rank's ring-attention forward (causal, fp32, one thread per rank as in the notebook):
    the block matmuls it computes (a diagonal block in full, masked) and the softmax's elementwise passes
    over their scores ("thread time": this thread's CPU time), then, for the wall time, the cores shared
    with the other `ranks` running (default cp) and cp-1 K/V messages."""
    from megalab.core.utils import rank_chunks
    from megalab.transformer_engine.context_parallel import _block_pairs

    c = seq_length // (2 * cp)
    mine = rank_chunks(cp, rank, zigzag)
    pairs = [kind for owner in range(cp) for _, _, kind in _block_pairs(mine, rank_chunks(cp, owner, zigzag), c)]
    scores = batch * heads * c * c  # one block's [b, np, c, c]
    matmuls = len(pairs) * 2 * cal.gemm_time(c, c, head_dim, ranks=1, threads=1, batch=batch * heads)  # qk^T, pv
    # over the scores: scale, logsumexp (max, exp, sum: 3), subtract, exp = 6 passes; + masked_fill on a diagonal
    passes = sum(6 + (kind == "causal") for kind in pairs)
    softmax = cal.elementwise_time(passes * scores, ranks=1, threads=1)
    compute = matmuls + softmax
    blocks = len(pairs)
    kv_bytes = 2 * batch * heads * (seq_length // cp) * head_dim * FP32  # K and V, one message per ring step
    communication = (cp - 1) * collective_time(cal, "isend", cp, kv_bytes)
    ranks = ranks or cp
    exposed = communication if not overlap_hides(cal, ranks) else max(0.0, communication - compute)
    wall = compute / cal.rank_share(ranks, 1)  # the ranks' threads share the cores
    return {**_result(wall, communication, exposed, blocks=blocks, matmuls=matmuls, softmax=softmax), "thread time": compute}


def predict_moe_all_to_all(cal: Calibration, ep: int, sent_bytes: float, num_experts: int = 8,
                           experts_gemm: tuple[int, int, int] | None = None) -> dict[str, float]:
    """03·09: a MoE layer's forward on one of `ep` ranks with the all-to-all dispatcher: the all-gather of
    tokens_per_expert, then dispatch and combine all-to-alls moving `sent_bytes` (a2a_bytes: both, to other
    ranks); experts_gemm = (tokens, hidden, ffn) of the local experts' matmuls (fc1 and fc2), if any."""
    per_direction = sent_bytes / 2 * ep / (ep - 1) if ep > 1 else 0.0  # the all-to-all's whole input
    counts = ep * num_experts * 8  # every rank's tokens_per_expert, int64
    communication = collective_time(cal, "all_gather", ep, counts) + 2 * collective_time(
        cal, "all_to_all", ep, per_direction)
    compute = 0.0
    if experts_gemm is not None:
        tokens, hidden, ffn = experts_gemm
        compute = cal.gemm_time(tokens, ffn, hidden, ep) + cal.gemm_time(tokens, hidden, ffn, ep)
    return _result(compute, communication)


def predict_traced_step(cal: Calibration, records, flops: float, ranks: int) -> dict[str, float]:
    """03·05: a step that computes `flops` (calc.model_flops / t) and issues the traced collectives, on one of
    `ranks` ranks: matmuls at the calibrated rate, every collective on the critical path (TP's are)."""
    compute = flops / (cal.flops(cal.threads_per_rank(ranks)) * cal.rank_share(ranks))
    return _result(compute, traced_time(cal, records), collectives=len(records))


def predict_recompute(cal: Calibration, config, batch: int, seq_length: int) -> dict[str, float]:
    """06·04: forward + backward seconds of a GPTModel in this process (all threads) for each recompute
    setting, from the matmul FLOPs (calc.model_flops): backward = 2 forwards; full recompute runs every
    layer's forward again, selective the attention core's (q k^T and p v)."""
    from megalab.extras import calc

    forward = calc.model_flops(config, batch, seq_length, training=False)
    attention = 4 * batch * seq_length**2 * config.num_attention_heads * config.kv_channels * config.num_layers
    logits = 2 * batch * seq_length * config.vocab_size * config.hidden_size  # the output layer is not recomputed
    extra = {"none": 0.0, "selective": attention, "full": forward - logits}
    rate = cal.flops(cal.cpus)
    return {name: (3 * forward + more) / rate for name, more in extra.items()}


if __name__ == "__main__":  # python -m megalab.extras.calibrate: measure this machine again and cache it
    print(calibration(refresh=True).summary())
    print(f"cached in {cache_path()}")
