"""Uneven pipeline stages from one string: Megatron's `pipeline_model_parallel_layout`.

One character per layer, "|" between stages, stages in virtual-stage order (all ranks' first chunks,
then all ranks' second chunks, ...):

    "E"  the embedding          "t"  a transformer (decoder) layer
    "L"  the loss (final norm, output layer, cross-entropy)      "m"  a multi-token-prediction layer
    "x*n" and "(...)*n" repeat; "," is cosmetic.

    "Et*3|(tt|)*29,m|L"  with pp = 16  ->  32 stages, v = 2 chunks per rank:

                     chunk 0 (vp_stage 0)     chunk 1 (vp_stage 1)
        pp rank 0    embedding, decoder*3     decoder*2
        pp rank 1-13 decoder*2                decoder*2
        pp rank 14   decoder*2                mtp
        pp rank 15   decoder*2                loss

The string's stage count must be a multiple of pp (it fixes v = stages / pp); the layout must hold
exactly num_layers "t", one "E" first and one "L" last. A stage may hold only the embedding or only
the loss: large-vocabulary models give the first and last rank fewer layers (or none) because the
embedding's memory and the output layer's logits are worth about a layer or more.

Megatron: megatron/core/transformer/pipeline_parallel_layer_layout.py (PipelineParallelLayerLayout:
parse_str_to_list, get_num_stages_from_str, validate_layer_layout, get_num_layers_to_build,
get_layer_offset, get_layer_id_list, pretty_repr) and LayerType in megatron/core/transformer/enums.py.
Here a bad layout raises ValueError naming what to change (Megatron asserts).
"""

from __future__ import annotations

import enum
import re


class LayerType(enum.Enum):
    """What one character of a layout stands for (Megatron: transformer/enums.py, LayerType)."""

    encoder = 1
    decoder = 2
    embedding = 3
    loss = 4
    mtp = 5


CHAR_TO_LAYER_TYPE = {"E": LayerType.embedding, "L": LayerType.loss, "t": LayerType.decoder, "m": LayerType.mtp}


class PipelineParallelLayerLayout:
    """A layout string (or list of stages) for `pipeline_model_parallel_size` ranks.

    layout[pp_rank][vp_stage]: the LayerTypes of that stage, in order; flatten_layout: every layer in
    model order (virtual stage 0, 1, ...); virtual_pipeline_model_parallel_size = stages / pp.
    """

    def __init__(self, layout: str | list, pipeline_model_parallel_size: int):
        self.input_data = layout
        stages = self.parse_str_to_list(layout) if isinstance(layout, str) else [list(s) for s in layout]
        pp = pipeline_model_parallel_size
        if pp < 1 or len(stages) % pp:
            raise ValueError(f"the layout {layout!r} has {len(stages)} stages ('|'-separated), not a multiple of "
                             f"pipeline_model_parallel_size={pp}: write pp * vpp stages (e.g. {pp} or {2 * pp}), or "
                             f"change pp to a divisor of {len(stages)}")
        vpp = len(stages) // pp
        stages = [[t if isinstance(t, LayerType) else self._layer_type(t) for t in s] for s in stages]
        # virtual stage k = vp_stage * pp + pp_rank (Megatron's interleaving order)
        self.layout = [[stages[vp * pp + rank] for vp in range(vpp)] for rank in range(pp)]
        self.flatten_layout = [t for s in stages for t in s]
        self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size = pp, vpp

    def __repr__(self) -> str:
        return str(self.input_data)

    @staticmethod
    def _layer_type(name: str) -> LayerType:
        key = name.strip().lower()
        if key not in LayerType.__members__:
            raise ValueError(f"{name!r} is not a layer type; use one of {list(LayerType.__members__)}")
        return LayerType[key]

    # ------------------------------------------------------------------ the string
    @staticmethod
    def unroll_str(layout_str: str) -> str:
        """"Et*2|(tt|)*2,L" -> "Ett|tt|tt|L": commas dropped, "(...)*n" then "x*n" unrolled (Megatron does this
        inside parse_str_to_list; here it is its own step so the planner can read the characters too)."""
        text = layout_str.replace(",", "")  # commas are cosmetic
        text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
        return re.sub(r"(.)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)

    @staticmethod
    def parse_str_to_list(layout_str: str) -> list[list[LayerType]]:
        """"Ettt|(tt|)*2,L" -> [[E, t, t, t], [t, t], [t, t], [L]]: unroll "(...)*n" then "x*n", split at "|"."""
        stages = []
        for stage in PipelineParallelLayerLayout.unroll_str(layout_str).split("|"):
            bad = sorted(set(stage) - set(CHAR_TO_LAYER_TYPE))
            if bad:
                raise ValueError(f"the layout {layout_str!r} has the character(s) {bad} in stage {stage!r}; a layout "
                                 f"uses {list(CHAR_TO_LAYER_TYPE)} ('E' embedding, 't' transformer layer, 'm' MTP "
                                 "layer, 'L' loss), '|' between stages, '*n' and '(...)*n' to repeat")
            stages.append([CHAR_TO_LAYER_TYPE[c] for c in stage])
        return stages

    @staticmethod
    def get_num_stages_from_str(layout: str) -> int:
        """pp * vpp: the number of stages the string describes."""
        return len(PipelineParallelLayerLayout.parse_str_to_list(layout))

    # ------------------------------------------------------------------ checks
    def validate_layer_layout(self, num_layers: int, mtp_num_layers: int | None = None) -> bool:
        """Raise ValueError (saying what to change) unless the layout holds exactly the model; return whether
        an MTP layer sits on a rank other than the last (Megatron's mtp_standalone)."""
        flat, count = self.flatten_layout, self.flatten_layout.count
        if not flat or flat[0] != LayerType.embedding or count(LayerType.embedding) != 1:
            raise ValueError(f"the layout {self!r} must start with the embedding 'E' and hold it once "
                             f"(it holds {count(LayerType.embedding)}): put one 'E' at the start of the first stage")
        if flat[-1] != LayerType.loss or count(LayerType.loss) != 1:
            raise ValueError(f"the layout {self!r} must end with the loss 'L' and hold it once "
                             f"(it holds {count(LayerType.loss)}): put one 'L' at the end of the last stage")
        if count(LayerType.decoder) != num_layers:
            diff = count(LayerType.decoder) - num_layers
            raise ValueError(f"the layout {self!r} holds {count(LayerType.decoder)} transformer layers 't' but the "
                             f"model has num_layers={num_layers}: {'remove' if diff > 0 else 'add'} {abs(diff)} 't' "
                             "(or change num_layers)")
        if count(LayerType.mtp) != (mtp_num_layers or 0):
            raise ValueError(f"the layout {self!r} holds {count(LayerType.mtp)} MTP layers 'm', the model "
                             f"mtp_num_layers={mtp_num_layers}: make them agree")
        if LayerType.mtp in flat and LayerType.decoder in flat[flat.index(LayerType.mtp):]:
            raise ValueError(f"the layout {self!r} puts a transformer layer after an MTP layer: the MTP layers "
                             "come after every 't'")
        for rank, chunks in enumerate(self.layout):
            for vp, stage in enumerate(chunks):
                if LayerType.mtp in stage and (vp != len(chunks) - 1 or stage.count(LayerType.mtp) != count(LayerType.mtp)):
                    raise ValueError(f"the layout {self!r} splits the MTP layers or puts them in an early chunk "
                                     f"(pp rank {rank}, vp stage {vp}): all 'm' go in one last-chunk stage")
        if LayerType.encoder in flat:
            raise NotImplementedError("encoder layers are not supported in a pipeline layout (nor in Megatron)")
        last = self.pipeline_model_parallel_size - 1
        return any(LayerType.mtp in chunks[-1] for rank, chunks in enumerate(self.layout) if rank != last)

    # ------------------------------------------------------------------ what each stage builds
    def get_num_layers_to_build(self, layer_type: LayerType = LayerType.decoder, vp_stage: int | None = None,
                                pp_rank: int = 0) -> int:
        """How many layers of `layer_type` stage (pp_rank, vp_stage) holds."""
        return self.layout[pp_rank][vp_stage or 0].count(layer_type)

    def get_layer_offset(self, layer_type: LayerType = LayerType.decoder, vp_stage: int | None = None,
                         pp_rank: int = 0) -> int:
        """The global index of the first `layer_type` layer of stage (pp_rank, vp_stage): how many such layers
        come before it in model order (every rank's earlier chunks, then this chunk's earlier ranks)."""
        vp_stage = vp_stage or 0
        # EXERCISE pp.layout_offset: count the layers of every virtual stage before (pp_rank, vp_stage)
        ### BEGIN SOLUTION
        # HINT 1: Model order is virtual-stage order: virtual stage vp_stage * pp + pp_rank. Before this stage
        #         come all pp ranks' stages of every earlier chunk, then the earlier ranks' stages of this chunk.
        # HINT 2: Sum self.layout[r][v].count(layer_type) over v < vp_stage for every rank r, and over r < pp_rank
        #         for v = vp_stage; count only layer_type (an 'E' or 'L' is not a transformer layer).
        offset = 0
        for vp in range(vp_stage + 1):
            for rank in range(self.pipeline_model_parallel_size if vp < vp_stage else pp_rank):
                offset += self.layout[rank][vp].count(layer_type)
        return offset
        ### END SOLUTION

    def get_layer_id_list(self, layer_type: LayerType = LayerType.decoder, vp_stage: int | None = None,
                          pp_rank: int = 0) -> list[int]:
        """The global indices of the `layer_type` layers of stage (pp_rank, vp_stage)."""
        offset = self.get_layer_offset(layer_type, vp_stage, pp_rank)
        return list(range(offset, offset + self.get_num_layers_to_build(layer_type, vp_stage, pp_rank)))

    def layers_per_stage(self, layer_type: LayerType = LayerType.decoder) -> list[int]:
        """`layer_type` layers of each virtual stage, in model order (not in Megatron: the course's table)."""
        pp, vpp = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        return [self.layout[k % pp][k // pp].count(layer_type) for k in range(pp * vpp)]

    def pretty_repr(self) -> str:
        """A table of what each stage holds, equal rows merged ("PP rank 1-13"), as Megatron logs it."""
        def stage_repr(stage):
            runs = []
            for t in stage:
                if runs and runs[-1][0] == t:
                    runs[-1][1] += 1
                else:
                    runs.append([t, 1])
            return ",".join(t.name + (f"*{n}" if n > 1 else "") for t, n in runs) or "(empty stage)"

        vpp = self.virtual_pipeline_model_parallel_size
        rows = [[""] + [f"VPP rank {v}" for v in range(vpp)]] if vpp > 1 else []
        start = 0
        for rank in range(1, self.pipeline_model_parallel_size + 1):
            here = [stage_repr(s) for s in self.layout[start]]
            if rank == self.pipeline_model_parallel_size or [stage_repr(s) for s in self.layout[rank]] != here:
                rows.append([f"PP rank {start}" + (f"-{rank - 1}" if rank - 1 > start else "")] + here)
                start = rank
        widths = [max(map(len, col)) for col in zip(*rows)]
        indent = " " * (8 if vpp <= 4 else 4)
        return "\n".join(indent.join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)
