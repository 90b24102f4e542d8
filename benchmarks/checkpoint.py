"""Checkpoint save/load at tp2·pp2 (4 ranks): megalab's sharded DCP checkpoint vs gather + torch.save.

Ours: `save_checkpoint` (every rank writes its part with torch.distributed.checkpoint, atomic
commit) and `load_checkpoint` (every rank reads what it needs). Reference, in the same launch:
gather the full state (model + Adam moments) to rank 0 with all_gather_object, torch.save one
file; load = torch.load of that file on every rank. Medians over repeats; ratio ours / reference
(below 1 means ours is faster). Also the cost of the per-shard CRC32 checksums: ours with them (the
default) against ours without, in the same launch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, report  # noqa: E402

from megalab.lab import launch  # noqa: E402

CODE = """
import shutil, time
from pathlib import Path
import torch, torch.distributed as dist
from megalab.training import checkpointing as ckpt
from megalab.core import parallel_state
from megalab.lab import dist as mdist
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.training.training import TrainingConfig, setup_model_and_optimizer

rank, _ = mdist.init()
root = mdist.scratch_dir("bench-checkpoint")  # every rank makes it (exist_ok): rank 0 empties it, races none
if rank == 0:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
dist.barrier()
model = TransformerConfig(num_layers={layers}, hidden_size={hidden}, num_attention_heads=4, vocab_size=8192,
                          seq_length=64, share_embeddings_and_output_weights=False)
state = setup_model_and_optimizer(TrainingConfig(model=model, train_iters=10, global_batch_size=8,
                                                 tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
tp = state.ps.get_tensor_model_parallel_group()
times = dict(ours_save=[], ours_load=[], ref_save=[], ref_load=[], nocrc_save=[], nocrc_load=[])

def timed(key, fn):
    dist.barrier(); start = time.perf_counter(); fn(); dist.barrier()
    times[key].append(time.perf_counter() - start)

def ref_save():
    full = ckpt.full_state_dict(state.model, state.params, state.optimizer, tp)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, full)
    if rank == 0:
        torch.save({{k: v for part in gathered for k, v in part.items()}}, root / "gathered.pt")

for _ in range({repeats}):
    timed("ours_save", lambda: ckpt.save_checkpoint(root, 1, state.model, state.params, state.optimizer,
                                                     state.scheduler, 0, tp))
    timed("ours_load", lambda: ckpt.load_checkpoint(root, state.model, state.params, state.optimizer,
                                                     state.scheduler, tp))
    timed("nocrc_save", lambda: ckpt.save_checkpoint(root, 2, state.model, state.params, state.optimizer,
                                                      state.scheduler, 0, tp, checksums=False))
    timed("nocrc_load", lambda: ckpt.load_checkpoint(root, state.model, state.params, state.optimizer,
                                                      state.scheduler, tp, iteration=2))
    timed("ref_save", ref_save)
    timed("ref_load", lambda: torch.load(root / "gathered.pt", weights_only=True))
mdist.publish("times", times)
mdist.publish("bytes", sum(f.stat().st_size for f in (root / "iter_0000001").iterdir()))
parallel_state.destroy_model_parallel()
dist.barrier()
if rank == 0:
    shutil.rmtree(root, ignore_errors=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="CI smoke: a tiny model, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.repeats = 64, 4, 1
    res = launch.run(CODE.format(hidden=args.hidden, layers=args.layers, repeats=args.repeats), 4, backend="gloo",
                     timeout=300)
    times, size = res.results["times"][0], res.results["bytes"][0]
    m = {k: median(v) for k, v in times.items()}
    rows = [["save", args.hidden, args.layers, size / 2**20, 1e3 * m["ours_save"], 1e3 * m["ref_save"],
             m["ours_save"] / m["ref_save"]],
            ["load", args.hidden, args.layers, size / 2**20, 1e3 * m["ours_load"], 1e3 * m["ref_load"],
             m["ours_load"] / m["ref_load"]]]
    rows += [["save: CRC32 on / off", args.hidden, args.layers, size / 2**20, 1e3 * m["ours_save"],
              1e3 * m["nocrc_save"], m["ours_save"] / m["nocrc_save"]],
             ["load: CRC32 on / off", args.hidden, args.layers, size / 2**20, 1e3 * m["ours_load"],
              1e3 * m["nocrc_load"], m["ours_load"] / m["nocrc_load"]]]
    report("checkpoint", ["op", "hidden", "layers", "MiB", "ours ms (DCP, tp2·pp2)",
                          "gather+torch.save/load ms (or ours without checksums)", "ratio"], rows, {"times_s": times})
    print(f"save ratio ours / reference = {rows[0][-1]:.3f}, load ratio = {rows[1][-1]:.3f}; "
          f"checksum overhead: save x{rows[2][-1]:.3f}, load x{rows[3][-1]:.3f}")


if __name__ == "__main__":
    main()
