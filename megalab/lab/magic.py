"""The `%%torchrun` cell magic: run the cell on N ranks under real torchrun.

    %load_ext megalab

    %%torchrun -n 4
    import torch, torch.distributed as dist
    from megalab.lab import dist as mdist
    rank, world = mdist.init()
    print(f"hello from rank {rank} of {world}")
    mdist.publish("answer", rank * 10)      # after the cell: answer == {0: 0, 1: 10, 2: 20, 3: 30}

Output is grouped by rank, in rank order, so notebooks compare it deterministically. While the
cell runs, a status line shows the elapsed time and the latest line of the first shown rank.

`--timeout` (300 s) is when a cell whose ranks all wait (a deadlock: no CPU used) is stopped,
with each rank's stack. Ranks still computing then are not stopped: on a loaded machine they go
on, the status line saying so, until `--hard-timeout` (3 x --timeout by default). The error's
`kind` says which: "deadlock", "overloaded" or "not started" (see megalab.lab.launch).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from megalab.lab import launch


def step_name(execution_count: int | None) -> str:
    """What names the cell's Slurm step: the notebook (Jupyter Server sets JPY_SESSION_NAME to its path) and
    the cell's execution count, e.g. 01_setup_and_torchrun-cell7."""
    notebook = os.environ.get("JPY_SESSION_NAME", "")
    stem = Path(notebook).stem if notebook else ""
    cell = f"cell{execution_count}" if execution_count else "cell"
    return f"{stem}-{cell}" if stem else cell


@magics_class
class TorchrunMagics(Magics):
    @magic_arguments()
    @argument("-n", "--nproc-per-node", type=int, default=1, help="ranks per node")
    @argument("--backend", default="auto", choices=["auto", "gloo", "nccl"], help="auto: NCCL when every local rank has a GPU, else gloo")
    @argument("--timeout", type=float, default=launch.DEFAULT_TIMEOUT,
              help="seconds after which ranks that all wait (a deadlock) are stopped and their stacks shown; "
                   "ranks still computing go on until --hard-timeout")
    @argument("--hard-timeout", type=float, default=None,
              help=f"seconds after which ranks are stopped even if still computing (default {launch.HARD_TIMEOUT_FACTOR:g} x --timeout)")
    @argument("--ranks", default="all", help="whose output to show: all, 0, or 0,2")
    @argument("--nnodes", type=int, default=1, help="number of nodes")
    @argument("--node-rank", type=int, default=None, help="this node's index (static multi-node rendezvous)")
    @argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous for several nodes")
    @argument("--slurm", action="store_true", help="run on every node of the current Slurm allocation (srun)")
    @cell_magic
    def torchrun(self, line: str, cell: str):
        """Run the cell under torchrun on N ranks; see `megalab.lab.launch.run`."""
        args = parse_argstring(self.torchrun, line)
        nodes = len(launch.slurm_nodes()) if args.slurm else args.nnodes  # --slurm: every node of the allocation
        world = args.nproc_per_node * nodes
        status = display({"text/plain": ""}, raw=True, display_id=True)

        def on_progress(elapsed: float, last: str) -> None:
            shown = f" · {last[:200]}" if last else " · starting"  # room for the overload note
            status.update({"text/plain": f"running on {world} rank{'s' if world != 1 else ''}, {elapsed:.0f} s{shown}"},
                          raw=True)

        try:
            result = launch.run(
                "\n" + cell,  # line numbers in tracebacks then match the cell's, magic line included
                args.nproc_per_node,
                backend=args.backend,
                timeout=args.timeout,
                hard_timeout=args.hard_timeout,
                ranks=args.ranks,
                nnodes=args.nnodes,
                node_rank=args.node_rank,
                rdzv_endpoint=args.rdzv_endpoint,
                slurm=args.slurm,
                on_progress=on_progress,
                name=step_name(self.shell.execution_count),
            )
        finally:
            status.update({"text/plain": ""}, raw=True)  # the saved output equals the first display
        sys.stdout.write(result.text("stdout"))
        sys.stdout.flush()
        err = result.text("stderr")
        if err:
            sys.stderr.write(err)
            sys.stderr.flush()
        self.shell.user_ns.update(result.results)
