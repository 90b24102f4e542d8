"""Calibrate the cost model to THIS machine, then predict the course's own runs before measuring them.

Three measurements fix the model (chapter 01 · 03's idea: a cost is a latency plus a size over a rate):

    matmul     t(m, n, k) = overhead + 2 m n k / rate          fp32 on CPU, 1 thread and all threads
    elementwise              seconds per element of torch.exp    fp32, 1 thread (softmax's passes)
    gloo       one message of M bytes: alpha + M beta            fitted from dist.all_reduce on 2 and 4
               (a ring all-reduce: 2 (n-1) alpha + 2 (n-1)/n M beta, comm.fit_alpha_beta)

matmul and gloo both fitted with `comm.fit_alpha_beta` (a matmul is a "message" of 2mnk FLOPs). The
ranks of a torchrun share the cores (the launcher gives each cpus // ranks threads, at least one):
with more ranks than cores each runs at `cores / (ranks x threads)` of a core.

    measure_matmul ──────┐
    measure_elementwise ─┼── Calibration (cached as JSON in mdist.cache_dir("calibration"))
    measure_gloo ────────┘        │ .hardware(ranks): step_time's Hardware for one of `ranks` ranks
                                  ▼
    predict_ddp_step  predict_traced_step (TP)  predict_pipeline  predict_cp_attention
    predict_moe_all_to_all  predict_recompute        composed of step_time's pieces: gemm_time,
                                                     elementwise_time, collective_time, overlapped, bubble

The formulas are the planner's (extras/step_time.py); what is laptop-specific lives here: the
calibration itself, ranks sharing cores, and the overlap rule (gloo's threads hide nothing when the
compute threads already take every core: overlap_slowdown 1). It is a CPU calibration: where the course's runs
compute on a GPU, calibration() says so and the predictions are nan, not compared with the GPU's measurements.

`calibration()` measures once (about 10 s: a few matmuls, two short gloo launches) and reuses the
cache afterwards; `calibration(refresh=True)`, or `python -m megalab.extras.calibrate`, measures again.
Not in Megatron-LM: it is the course's way of checking that the step-time model it teaches for
clusters (`extras/step_time.py`, `extras/planner.py`) also predicts the runs the reader can make.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from megalab.extras import comm
from megalab.extras import step_time as st

CACHE_NAME = "calibration"
CACHE_FILE = "laptop.json"
# (m, n, k): overhead-bound to rate-bound, the shapes of the course's runs; a fraction of a second in all
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
                points.append({"threads": t, "m": m, "n": n, "k": k, "seconds": _best_seconds(lambda a=a, b=b: a @ b, repeats)})
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


def gloo_rank(numels=GLOO_NUMELS, repeats: int = 7) -> dict[str, list[float]]:
    """Inside every rank (launch.run_function): median seconds of dist.all_reduce per float32 size (each run
    the slowest rank's: comm.time_collective), as the notebooks measure their collectives."""
    import torch.distributed as dist

    from megalab.lab import dist as mdist

    mdist.init()
    host = torch.device("cpu")  # gloo on host memory: what this laptop calibration measures (even on a GPU node)
    dist.all_reduce(torch.zeros(1, device=host))  # the first collective sets up the connections: not timed
    out: dict[str, list[float]] = {"nbytes": [], "seconds": []}
    for numel in numels:
        tensor = torch.zeros(numel, device=host)
        out["nbytes"].append(numel * FP32)
        out["seconds"].append(comm.time_collective(lambda t: dist.all_reduce(t), tensor, repeats=repeats))
    dist.barrier()
    return out


def measure_gloo(world_sizes=GLOO_WORLD_SIZES, numels=GLOO_NUMELS, repeats: int = 7) -> dict[int, dict]:
    """dist.all_reduce timings on gloo for each world size: {n: {"nbytes": [...], "seconds": [...]}}."""
    from megalab.lab import launch

    return {n: launch.run_function(gloo_rank, n, numels, repeats, launch=dict(timeout=120, backend="gloo")).returns[0]
            for n in world_sizes}


# --------------------------------------------------------------------------------------------- the model
def _fit(sizes, seconds, latency_steps: float = 1.0, size_factor: float = 1.0, what: str = "") -> tuple[float, float]:
    """(latency, time per unit) by comm.fit_alpha_beta. Noise can make the fitted latency (or rate) negative:
    then no latency, and the rate of the largest size."""
    if len(sizes) < 2:
        raise CalibrationError(f"{what}: need at least two measured sizes to fit a latency and a rate, got {len(sizes)}")
    if any(not s > 0 for s in seconds):
        raise CalibrationError(f"{what}: every measured time must be > 0 (got {list(seconds)}); measure again")
    latency, per_unit = comm.fit_alpha_beta(sizes, seconds, latency_steps=latency_steps, bytes_factor=size_factor)
    if latency < 0 or per_unit <= 0:
        largest, t = max(zip(sizes, seconds))
        latency, per_unit = 0.0, t / (size_factor * largest)
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
    runs_on: str = field(default="cpu", compare=False)  # where the runs it is compared with compute (calibration())

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

    def link(self, ranks: int) -> Link:
        """The gloo link measured on `ranks` ranks (or on the nearest world size measured)."""
        nearest = min(self.links, key=lambda n: (abs(n - ranks), -n))
        return self.links[nearest]

    def hardware(self, ranks: int = 1, threads: int | None = None) -> st.Hardware:
        """The step-time model's Hardware for ONE of `ranks` ranks running at once on this machine, each with
        `threads` threads (default: the launcher's): its "GPU" is that rank's share of the cores (the
        calibrated rate and overhead, no shape penalty), its links are gloo on `ranks` ranks."""
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        if not self.elementwise > 0:
            raise CalibrationError("this calibration has no elementwise rate: recalibrate (calibration(refresh=True)) "
                                   "or pass elementwise= seconds per element")
        threads = threads or self.threads_per_rank(ranks)
        share = self.rank_share(ranks, threads)
        overhead = self.matmul.get(threads, self.matmul[min(self.matmul)])[0]
        # elementwise: one fp32 element read and written (8 bytes) per `elementwise` seconds and thread
        bandwidth = 2 * FP32 / self.elementwise * min(threads, self.cpus) * share
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / ranks
        cpu = st.GPU(f"{threads} CPU thread(s) at {share:.0%} of their cores", peak_flops=self.flops(threads) * share,
                     matmul_efficiency=1.0, num_sms=max(1, threads), memory_bandwidth=bandwidth, memory_gb=memory_gb,
                     memory_efficiency=1.0, sustained=1.0, overlap_slowdown=0.0 if overlap_hides(self, ranks) else 1.0,
                     kernel_overhead=overhead / share, efficiency_curve=_calibrated_rate,
                     source=f"calibrated on {self.machine or 'this machine'} {self.measured_at}")
        link = self.link(ranks)
        gloo = st.Link(f"gloo on {link.n} ranks", bandwidth=link.bandwidth, latency=link.alpha,
                       source="fitted to dist.all_reduce (comm.fit_alpha_beta)")
        return st.Hardware(f"{self.machine or 'this machine'}: 1 of {ranks} rank(s)", cpu, gloo, gloo, gpus_per_node=ranks)

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


def runs_device() -> str:
    """Where the course's runs compute on this machine: "cuda" when %%torchrun's ranks get GPUs (a CUDA GPU:
    NCCL; or MEGALAB_DEVICE=cuda), else "cpu"."""
    if os.environ.get("MEGALAB_DEVICE") == "cuda" or torch.cuda.is_available():
        return "cuda"
    return "cpu"


def calibration(refresh: bool = False) -> Calibration:
    """This machine's calibration: the cached one, or measured now (and cached) when there is none or refresh=True.

    It measures the CPU and gloo. Where the course's runs compute on a GPU (runs_device), a prediction from it
    would compare a CPU model with a GPU run: it says so, and the predictions it makes are nan (not compared)."""
    cal = None if refresh else load()
    if cal is None:
        cal = Calibration.measure()
        save(cal)
    where = runs_device()
    if where != "cpu":
        print(f"calibrate: this calibration measured the CPU and gloo (matmuls on CPU threads, all-reduces through host "
              f"memory), but the runs on this machine compute on {where}: predicted vs measured would compare a CPU "
              "model with a GPU run, so the calibrated predictions are nan (not compared). For GPUs, the planner's "
              "hardware presets model them (megalab/extras/step_time.py).")
        cal = dataclasses.replace(cal, runs_on=where)
    return cal


def _not_compared_off_cpu(*kept: str):
    """A prediction from `cal`, or nan in place of every calibrated time when cal.runs_on is not the CPU it
    measured (counts, and the `kept` parts that do not depend on the calibration, stay)."""
    def wrap(predict):
        @functools.wraps(predict)
        def checked(cal: Calibration, *args, **kwargs):
            out = predict(cal, *args, **kwargs)
            if cal.runs_on == "cpu":
                return out
            if isinstance(out, dict):
                return {k: v if k in kept or isinstance(v, int) else math.nan for k, v in out.items()}
            return math.nan
        return checked
    return wrap


# --------------------------------------------------------------------------------------------- predictions
# Each composes the step-time model's pieces (extras/step_time.py: gemm_time, elementwise_time,
# collective_time, overlapped, bubble) on this machine's Hardware, and returns seconds:
# {"compute", "communication", "exposed communication", "total", ...the parts}.

def overlap_hides(cal: Calibration, ranks: int) -> bool:
    """Whether gloo's communication threads can run beside the compute: only with more cores than ranks
    (with one core or less per rank, sending steals the time it would hide behind)."""
    return ranks < cal.cpus


def _calibrated_rate(m: int, n: int, k: int) -> float:
    """The laptop's matmul efficiency curve: its peak is the calibrated rate, whatever the shape (the
    per-call overhead, step_time's kernel_overhead, is what makes small matmuls slow)."""
    return 1.0


# comm_tracer's names -> step_time's kinds
_KINDS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "all_gather_single": "all_gather",
          "all_gather_into_tensor": "all_gather", "reduce_scatter_single": "reduce_scatter",
          "reduce_scatter_tensor": "reduce_scatter", "all_to_all": "all_to_all", "isend": "send_recv"}


def _gemm(hw: st.Hardware, m: int, n: int, k: int, batch: int = 1) -> float:
    return st.gemm_time(m, n, k, hw.gpu, dtype_bytes=FP32, batch=batch)


def _collective(hw: st.Hardware, kind: str, nbytes: float, ranks: int) -> float:
    if kind not in _KINDS:
        raise ValueError(f"no cost model for collective {kind!r}: use one of {', '.join(_KINDS)}")
    return st.collective_time(_KINDS[kind], nbytes, ranks, hw.intra_node) if nbytes else 0.0


def _result(compute: float, communication: float, exposed: float | None = None, **parts) -> dict[str, float]:
    exposed = communication if exposed is None else exposed
    return {"compute": compute, "communication": communication, "exposed communication": exposed,
            "total": compute + exposed, **parts}


@_not_compared_off_cpu()
def traced_time(cal: Calibration, records, ranks: int) -> float:
    """Seconds of the collectives a CollectiveTracer recorded on one of `ranks` ranks, one after another."""
    hw = cal.hardware(ranks)
    return sum(_collective(hw, r.op, r.payload_bytes, r.group_size) for r in records)


@_not_compared_off_cpu()
def predict_all_reduce(cal: Calibration, ranks: int, nbytes: float) -> float:
    """01·03: seconds of one dist.all_reduce of `nbytes` on `ranks` gloo ranks (ring: 2(n-1) alpha + 2(n-1)/n M beta)."""
    return _collective(cal.hardware(ranks), "all_reduce", nbytes, ranks) if ranks > 1 else 0.0


@_not_compared_off_cpu()
def predict_ddp_step(cal: Calibration, layers: int, width: int, batch: int, ranks: int,
                     bucket_size: int | None = None, overlap_grad_reduce: bool = False) -> dict[str, float]:
    """03·01: one step (forward, backward, gradient sync) of a stack of `layers` Linear(width, width) + tanh,
    `batch` rows per rank, fp32; bucket_size=None is the naive one all-reduce per parameter. With overlap,
    every bucket but the last runs beside the backward (step_time.overlapped)."""
    from megalab.core.distributed.param_and_grad_buffer import build_buckets

    hw = cal.hardware(ranks)
    forward = layers * _gemm(hw, batch, width, width)
    backward = layers * _gemm(hw, width, width, batch) + (layers - 1) * _gemm(hw, batch, width, width)  # no dX for layer 0
    numels = [width * width, width] * layers
    if bucket_size is None:
        messages = [n * FP32 for n in numels]
    else:
        messages = [(end - start) * FP32 for _, start, end in build_buckets(numels, bucket_size, pad_to=ranks)]
    times = [_collective(hw, "all_reduce", m, ranks) for m in messages]
    communication = sum(times)
    exposed = communication
    if overlap_grad_reduce:
        exposed = st.overlapped(communication - times[-1], backward, hw.gpu) + times[-1]
    return _result(forward + backward, communication, exposed, forward=forward, backward=backward,
                   messages=len(messages))


@_not_compared_off_cpu("compute", "busy", "bubble")
def predict_pipeline(cal: Calibration, pp: int, num_microbatches: int, num_model_chunks: int = 1,
                     forward_s: float = 0.02, backward_s: float = 0.04, message_bytes: float = 128) -> dict[str, float]:
    """03·07: one step of 1F1B (GPipe: the same bubble) or interleaved 1F1B on `pp` ranks whose stages take
    forward_s + backward_s per micro-batch (all chunks together): compute (1 + bubble), and every p2p
    exposed — one activation forward and one gradient backward per micro-batch and chunk."""
    hw = cal.hardware(pp)
    m, v = num_microbatches, num_model_chunks
    busy = m * (forward_s + backward_s)
    bubble = st.bubble(pp, m, v) * busy
    messages = 2 * m * v if pp > 1 else 0
    communication = messages * _collective(hw, "isend", message_bytes, 2)
    return _result(busy + bubble, communication, busy=busy, bubble=bubble, messages=messages)


@_not_compared_off_cpu()
def predict_cp_attention(cal: Calibration, seq_length: int, cp: int, rank: int, zigzag: bool = True,
                         batch: int = 1, heads: int = 4, head_dim: int = 32, ranks: int | None = None) -> dict[str, float]:
    """03·08: one rank's ring-attention forward (causal, fp32, one thread per rank as in the notebook): the
    two matmuls of every block pair it computes (a diagonal block in full, masked) and the softmax's
    elementwise passes over their scores — "thread time", its CPU time — then, for the wall time, the
    cores shared with the other `ranks` running (default cp) and cp-1 K/V messages."""
    from megalab.core.utils import rank_chunks
    from megalab.transformer_engine.context_parallel import _block_pairs

    ranks = ranks or cp
    alone = cal.hardware(1, threads=1)
    c = seq_length // (2 * cp)
    mine = rank_chunks(cp, rank, zigzag)
    pairs = [kind for owner in range(cp) for _, _, kind in _block_pairs(mine, rank_chunks(cp, owner, zigzag), c)]
    scores = batch * heads * c * c  # one block's [b, np, c, c]
    matmuls = len(pairs) * 2 * _gemm(alone, c, c, head_dim, batch=batch * heads)  # q k^T, p v
    # over the scores: scale, logsumexp (max, exp, sum: 3), subtract, exp = 6 passes; + masked_fill on a diagonal
    passes = sum(6 + (kind == "causal") for kind in pairs)
    softmax = st.elementwise_time(passes * scores * 2 * FP32, alone.gpu)  # each pass reads and writes fp32
    thread_time = matmuls + softmax
    wall = thread_time / cal.rank_share(ranks, 1)
    kv_bytes = 2 * batch * heads * (seq_length // cp) * head_dim * FP32  # K and V, one message per ring step
    hw = cal.hardware(ranks, threads=1)
    communication = (cp - 1) * _collective(hw, "isend", kv_bytes, 2)
    exposed = st.overlapped(communication, wall, hw.gpu)
    return {**_result(wall, communication, exposed, blocks=len(pairs), matmuls=matmuls, softmax=softmax),
            "thread time": thread_time}


@_not_compared_off_cpu()
def predict_moe_all_to_all(cal: Calibration, ep: int, sent_bytes: float, num_experts: int = 8) -> dict[str, float]:
    """03·09: the all-to-all dispatcher's communication in a MoE layer's forward on one of `ep` ranks: the
    all-gather of every rank's tokens_per_expert, then dispatch and combine all-to-alls that send `sent_bytes`
    to other ranks in all (a2a_bytes). The experts' matmuls are left to the caller (tiny in 03·09)."""
    hw = cal.hardware(ep)
    whole = sent_bytes / 2 * ep / (ep - 1) if ep > 1 else 0.0  # one all-to-all's input, its own rows included
    counts = _collective(hw, "all_gather", ep * num_experts * 8, ep) if ep > 1 else 0.0  # int64 counts
    communication = counts + 2 * (_collective(hw, "all_to_all", whole, ep) if ep > 1 else 0.0)
    return _result(0.0, communication)


@_not_compared_off_cpu()
def predict_traced_step(cal: Calibration, records, flops: float, ranks: int) -> dict[str, float]:
    """03·05: a step that computes `flops` (calc.model_flops / t) and issues the traced collectives, on one of
    `ranks` ranks: matmuls at the calibrated rate, every collective on the critical path (TP's are)."""
    compute = flops / cal.hardware(ranks).gpu.peak_flops
    return _result(compute, traced_time(cal, records, ranks), collectives=len(records))


@_not_compared_off_cpu()
def predict_recompute(cal: Calibration, config, batch: int, seq_length: int) -> dict[str, float]:
    """06·04: forward + backward seconds of a GPTModel in this process (all threads) for each recompute
    setting, from the matmul FLOPs (calc.model_flops): backward = 2 forwards; full recompute runs every
    layer's forward again, selective the attention core's (q k^T and p v)."""
    from megalab.extras import calc

    forward = calc.model_flops(config, batch, seq_length, training=False)
    attention = 4 * batch * seq_length**2 * config.num_attention_heads * config.kv_channels * config.num_layers
    logits = 2 * batch * seq_length * config.vocab_size * config.hidden_size  # the output layer is not recomputed
    extra = {"none": 0.0, "selective": attention, "full": forward - logits}
    rate = cal.hardware(1).gpu.peak_flops
    return {name: (3 * forward + more) / rate for name, more in extra.items()}


if __name__ == "__main__":  # python -m megalab.extras.calibrate: measure this machine again and cache it
    from megalab.extras import calibrate  # the ranks import the module by name, not as __main__

    print(calibrate.calibration(refresh=True).summary())
    print(f"cached in {calibrate.cache_path()}")
