"""Process groups for 5-D parallelism, laid out exactly as Megatron-LM lays them out.

Every rank has one coordinate per kind of parallelism. With Megatron's default order
"tp-cp-ep-dp-pp" the LEFT-most name varies FASTEST:

    global_rank = tp_rank + tp * (cp_rank + cp * (ep_rank + ep * (dp_rank + dp * pp_rank)))

so TP neighbours are adjacent ranks (same node, fastest links) and PP stages are far apart.
A "tp" group holds the ranks that differ only in tp_rank; a "tp-pp" group those that differ
only in tp_rank and pp_rank; and so on for any set of names. 8 ranks, tp=2, pp=2, dp=2:

    rank:   0  1  2  3  4  5  6  7
    tp:    [0  1][2  3][4  5][6  7]        get_ranks("tp") = [[0,1],[2,3],[4,5],[6,7]]
    dp:     0     2  |  4     6            get_ranks("dp") = [[0,2],[1,3],[4,6],[5,7]]
    pp:     0           4                  get_ranks("pp") = [[0,4],[1,5],[2,6],[3,7]]

Dense layers (attention, dense MLP) use a generator with ep=1; expert layers (MoE) use a
second generator over the same ranks with cp=1, expert-TP in place of TP and expert-DP in
place of DP, so the same GPU can be "dp rank 1" for attention and "ep rank 1" for experts.

`initialize_model_parallel(...)` builds every group once and keeps them in one `ParallelState`
object; the module-level functions (`get_tensor_model_parallel_group`, ...) read the current
one, with the names Megatron-LM uses in megatron/core/parallel_state.py.

One rule for every `group=` argument in megalab.core (`resolve_group`): the group you pass, else the
current state's group of that kind. With no state current the layout is the trivial one, every rank a
data-parallel replica: the data-parallel groups are the whole world, and a model-parallel group
(tp, pp, cp, ep, ...) is this process alone: None, nothing is communicated, where a module can run
alone (an MoE layer, grad clipping); a module that cannot (TP mappings, CP attention, pipeline p2p)
says to initialize a state or pass a group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

PARALLEL_NAMES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def _prefix_product(sizes: list[int]) -> list[int]:
    """[1, s0, s0*s1, ...]: the stride of each dimension when the first one varies fastest."""
    out = [1]
    for s in sizes:
        out.append(out[-1] * s)
    return out


def _decompose(index: int, shape: list[int]) -> list[int]:
    """Coordinates of `index` in `shape`, first coordinate fastest (mixed-radix digits)."""
    return [(index // stride) % size for size, stride in zip(shape, _prefix_product(shape))]


def generate_masked_orthogonal_rank_groups(world_size: int, parallel_size: list[int], mask: list[bool]) -> list[list[int]]:
    """Rank groups spanned by the masked dimensions; Megatron's function of the same name.

    `parallel_size` lists the size of each dimension in order (first varies fastest) and
    `mask[i]` says whether dimension i is part of the group. Ranks in one group share their
    coordinates in the unmasked dimensions; groups are listed in the order of those shared
    coordinates (first unmasked fastest), and ranks inside a group in the order of their masked
    coordinates (first masked fastest).

        sizes [tp, dp, pp] = [2, 3, 4], mask [False, True, False]  ("dp" groups):
        [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11], ..., [19, 21, 23]]
    """
    # EXERCISE parallel_state.get_ranks: one group per combination of unmasked coordinates
    ### BEGIN SOLUTION
    # HINT 1: A global rank is a mixed-radix number whose digits are the rank's coordinates, the FIRST dimension
    #         fastest. The ranks of one group agree on every unmasked coordinate and run over all masked ones.
    # HINT 2: Take the strides of the full shape (_prefix_product) and split shape and strides into masked and
    #         unmasked parts. For group g, _decompose g over the unmasked shape: these coordinates times their strides
    #         give the group's first rank; member i adds _decompose(i) over the masked shape times the masked strides.
    # HINT 3: The strides always come from the FULL shape, not from the masked or unmasked sizes alone.
    stride = _prefix_product(parallel_size)  # global_rank = sum(coordinate[i] * stride[i])
    masked_shape = [s for s, m in zip(parallel_size, mask) if m]
    masked_stride = [d for d, m in zip(stride, mask) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]
    unmasked_stride = [d for d, m in zip(stride, mask) if not m]
    group_size = _prefix_product(masked_shape)[-1]
    groups = []
    for group_index in range(world_size // group_size):
        base = sum(c * d for c, d in zip(_decompose(group_index, unmasked_shape), unmasked_stride))
        groups.append(
            [base + sum(c * d for c, d in zip(_decompose(i, masked_shape), masked_stride)) for i in range(group_size)]
        )
    return groups
    ### END SOLUTION


class RankGenerator:
    """Rank groups for any combination of tp/cp/ep/dp/pp, as Megatron-LM's `RankGenerator`.

    `order` names the dimensions, fastest first; names missing from it must have size 1 and
    are appended at the end. `get_ranks("tp-pp")` returns the groups spanned by TP and PP.
    As in Megatron, one generator cannot have both ep > 1 and cp > 1: CP lives in the dense
    generator, EP in the expert one.
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str = DEFAULT_ORDER, rank_offset: int = 0):
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        for name, size in self.name_to_size.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} size must be a positive integer, got {size!r}")
        if ep > 1 and cp > 1:
            raise ValueError(
                f"ep={ep} and cp={cp}: one RankGenerator holds either CP (the dense generator) or EP "
                "(the expert generator), as in Megatron-LM; use initialize_model_parallel for both"
            )
        names = order.lower().split("-")
        unknown = [n for n in names if n not in self.name_to_size]
        if unknown or len(set(names)) != len(names):
            raise ValueError(f"order {order!r} must list distinct names from {'-'.join(PARALLEL_NAMES)}")
        for name, size in self.name_to_size.items():
            if name not in names:
                if size != 1:
                    raise ValueError(f"{name} has size {size} but is missing from order {order!r}; add it")
                names.append(name)
        self.order = "-".join(names)
        self.ordered_size = [self.name_to_size[n] for n in names]
        self.world_size = tp * ep * dp * pp * cp
        self.rank_offset = rank_offset

    def get_mask(self, order: str, token: str) -> list[bool]:
        """[name in token for name in order]: which dimensions the requested groups span."""
        names, wanted = order.split("-"), token.lower().split("-")
        missing = [t for t in wanted if t not in names]
        if missing:
            raise ValueError(f"token {token!r}: {missing} not in order {order!r}")
        return [n in wanted for n in names]

    def get_ranks(self, token: str) -> list[list[int]]:
        """The rank groups spanned by the '-'-joined names in `token`, e.g. "tp", "dp-cp", "tp-ep-pp"."""
        mask = self.get_mask(self.order, token)
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, mask)
        return [[r + self.rank_offset for r in g] for g in groups]


def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """The stages holding the word embeddings: first and last (they tie input and output)."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Only the first stage adds learned position embeddings."""
    return [pp_ranks[0]]


@dataclass(frozen=True)
class ParallelSizes:
    """Every size of one layout; `expert_data_parallel_size` follows from the others."""

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: same as tensor_model_parallel_size (Megatron's default)
    order: str = DEFAULT_ORDER

    def __post_init__(self):
        tp, pp, cp, ep = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                          self.context_parallel_size, self.expert_model_parallel_size)
        if self.expert_tensor_parallel_size is None:
            object.__setattr__(self, "expert_tensor_parallel_size", tp)
        etp = self.expert_tensor_parallel_size
        for name, size in [("world_size", self.world_size), ("tensor_model_parallel_size", tp),
                           ("pipeline_model_parallel_size", pp), ("context_parallel_size", cp),
                           ("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)]:
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive integer, got {size!r}")
        if self.world_size % (tp * pp * cp):
            raise ValueError(
                f"world_size {self.world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}; "
                "the data-parallel size would not be a whole number"
            )
        if self.world_size % (etp * ep * pp):
            raise ValueError(
                f"world_size {self.world_size} is not divisible by expert_tp*ep*pp = {etp}*{ep}*{pp} = {etp * ep * pp}; "
                "the expert data-parallel size would not be a whole number"
            )
        if pp > 1 and not self.order.endswith("pp") and self.expert_data_parallel_size != self.data_parallel_size:
            raise ValueError(
                f"order {self.order!r} does not end in pp, so attention and expert layers need the same "
                f"data-parallel size (got {self.data_parallel_size} and {self.expert_data_parallel_size})"
            )

    @property
    def data_parallel_size(self) -> int:
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        return self.world_size // (tp * pp * cp)

    @property
    def expert_data_parallel_size(self) -> int:
        etp, ep, pp = self.expert_tensor_parallel_size, self.expert_model_parallel_size, self.pipeline_model_parallel_size
        return self.world_size // (etp * ep * pp)

    def dense_generator(self) -> RankGenerator:
        return RankGenerator(tp=self.tensor_model_parallel_size, ep=1, dp=self.data_parallel_size,
                             pp=self.pipeline_model_parallel_size, cp=self.context_parallel_size, order=self.order)

    def expert_generator(self) -> RankGenerator:
        return RankGenerator(tp=self.expert_tensor_parallel_size, ep=self.expert_model_parallel_size,
                             dp=self.expert_data_parallel_size, pp=self.pipeline_model_parallel_size, cp=1,
                             order=self.order)


def rank_groups(sizes: ParallelSizes) -> dict[str, list[list[int]]]:
    """Every group of a layout, by name, in the order initialize_model_parallel creates them.

    Dense: dp-cp, dp, cp, tp-pp (model parallel), tp, pp, embd, pos_embd, tp-dp-cp, tp-dp, tp-cp.
    Expert: ep, etp (expert tensor parallel), tp-ep, tp-ep-pp, edp (expert data parallel).
    Needs no processes: the rank-grid figures use it too.
    """
    dense, expert = sizes.dense_generator(), sizes.expert_generator()
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        raise ValueError("pipeline groups differ between the dense and the expert layout; put pp last in the order")
    groups = {name: dense.get_ranks(name) for name in ("dp-cp", "dp", "cp", "tp-pp", "tp", "pp")}
    groups["embd"] = [default_embedding_ranks(r) for r in groups["pp"]]
    groups["pos_embd"] = [default_position_embedding_ranks(r) for r in groups["pp"]]
    groups.update({name: dense.get_ranks(name) for name in ("tp-dp-cp", "tp-dp", "tp-cp")})
    groups.update({"ep": expert.get_ranks("ep"), "etp": expert.get_ranks("tp"), "tp-ep": expert.get_ranks("tp-ep"),
                   "tp-ep-pp": expert.get_ranks("tp-ep-pp"), "edp": expert.get_ranks("dp")})
    return groups


def create_groups(all_ranks: list[list[int]], rank: int) -> tuple[dist.ProcessGroup | None, list[int] | None]:
    """new_group for every group in `all_ranks`; returns (group, ranks) of the one holding `rank`.

    Every process must call `dist.new_group` for every group, in the same order, even for the
    groups it is not in (it is a collective over the default group).
    """
    # EXERCISE parallel_state.create_groups: call new_group for every group, keep the one holding this rank
    ### BEGIN SOLUTION
    # HINT 1: dist.new_group is a collective over the default group: every process must call it for every group of
    #         all_ranks, in the same order, even for the groups it is not a member of.
    # HINT 2: Loop over all_ranks, create each group, and remember the (group, ranks) pair of the one that contains
    #         `rank` (if none does, return None, None); don't stop the loop early.
    mine = (None, None)
    for ranks in all_ranks:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = (group, ranks)
    return mine
    ### END SOLUTION


def hierarchical_context_parallel_ranks(cp_ranks: list[int], sizes: list[int]) -> list[list[list[int]]]:
    """The sub-groups of one CP group, level by level, as Megatron's `create_hierarchical_groups`
    (megatron/core/parallel_state.py, einops "(l s u) -> (l u) s"): level i's groups hold sizes[i] ranks,
    prod(sizes[:i]) apart. CP ranks 0..3, sizes [2, 2]
    (a2a size, p2p size: `hierarchical_context_parallel_sizes`): level 0 [[0, 1], [2, 3]] (all-to-all,
    neighbours), level 1 [[0, 2], [1, 3]] (the p2p ring, across)."""
    total = 1
    for size in sizes:
        total *= size
    if total != len(cp_ranks):
        raise ValueError(f"hierarchical_context_parallel_sizes {list(sizes)} multiply to {total}, not to "
                         f"context_parallel_size = {len(cp_ranks)}: give [a2a size, p2p size] with a2a * p2p = cp")
    levels = []
    for level, size in enumerate(sizes):
        stride = 1
        for inner in sizes[:level]:
            stride *= inner
        block = stride * size  # one block of the (l s u) layout: s groups-of-u ranks
        levels.append([[cp_ranks[start + u + stride * i] for i in range(size)]
                       for start in range(0, len(cp_ranks), block) for u in range(stride)])
    return levels


@dataclass
class ParallelState:
    """This rank's process groups (and their global ranks), built by `initialize_model_parallel`.

    `group(name)` / `ranks(name)` take the names of `rank_groups`; the methods below are the
    accessors Megatron-LM exposes as module-level functions.
    """

    sizes: ParallelSizes
    rank: int
    groups: dict[str, dist.ProcessGroup] = field(repr=False)
    global_ranks: dict[str, list[int]]

    def group(self, name: str) -> dist.ProcessGroup:
        if name not in self.groups:
            raise KeyError(f"no {name!r} group; known: {sorted(self.groups)}")
        return self.groups[name]

    def ranks(self, name: str) -> list[int]:
        self.group(name)
        return self.global_ranks[name]

    def rank_in(self, name: str) -> int:
        return self.ranks(name).index(self.rank)

    def size_of(self, name: str) -> int:
        return len(self.ranks(name))

    # tensor model parallel
    def get_tensor_model_parallel_group(self):
        return self.group("tp")

    def get_tensor_model_parallel_rank(self) -> int:
        return self.rank_in("tp")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.size_of("tp")

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.ranks("tp")[0]

    # pipeline model parallel
    def get_pipeline_model_parallel_group(self):
        return self.group("pp")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.rank_in("pp")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.size_of("pp")

    def is_pipeline_first_stage(self) -> bool:
        return self.get_pipeline_model_parallel_rank() == 0

    def is_pipeline_last_stage(self) -> bool:
        return self.get_pipeline_model_parallel_rank() == self.get_pipeline_model_parallel_world_size() - 1

    def get_pipeline_model_parallel_first_rank(self) -> int:
        return self.ranks("pp")[0]

    def get_pipeline_model_parallel_last_rank(self) -> int:
        return self.ranks("pp")[-1]

    def get_pipeline_model_parallel_next_rank(self) -> int:
        ranks = self.ranks("pp")
        return ranks[(self.rank_in("pp") + 1) % len(ranks)]

    def get_pipeline_model_parallel_prev_rank(self) -> int:
        ranks = self.ranks("pp")
        return ranks[(self.rank_in("pp") - 1) % len(ranks)]

    # data parallel (with_context_parallel: the DP x CP group that averages gradients)
    def get_data_parallel_group(self, with_context_parallel: bool = False):
        return self.group("dp-cp" if with_context_parallel else "dp")

    def get_data_parallel_rank(self, with_context_parallel: bool = False) -> int:
        return self.rank_in("dp-cp" if with_context_parallel else "dp")

    def get_data_parallel_world_size(self, with_context_parallel: bool = False) -> int:
        return self.size_of("dp-cp" if with_context_parallel else "dp")

    def get_data_parallel_src_rank(self, with_context_parallel: bool = False) -> int:
        return self.ranks("dp-cp" if with_context_parallel else "dp")[0]

    # context parallel
    def get_context_parallel_group(self):
        return self.group("cp")

    def get_context_parallel_rank(self) -> int:
        return self.rank_in("cp")

    def get_context_parallel_world_size(self) -> int:
        return self.size_of("cp")

    def get_context_parallel_global_ranks(self) -> list[int]:
        return self.ranks("cp")

    def get_hierarchical_context_parallel_groups(self) -> list:
        """[a2a group, p2p group] of cp_comm_type "a2a+p2p" (hierarchical_context_parallel_sizes)."""
        levels = sorted(name for name in self.groups if name.startswith("hcp"))
        if not levels:
            raise RuntimeError("no hierarchical context-parallel groups: pass hierarchical_context_parallel_sizes="
                               "[a2a size, p2p size] to initialize_model_parallel")
        return [self.groups[name] for name in levels]

    # combinations
    def get_model_parallel_group(self):
        return self.group("tp-pp")

    def get_tensor_and_data_parallel_group(self, with_context_parallel: bool = False):
        return self.group("tp-dp-cp" if with_context_parallel else "tp-dp")

    def get_tensor_and_context_parallel_group(self):
        return self.group("tp-cp")

    def get_embedding_group(self):
        return self.group("embd")

    def get_position_embedding_group(self):
        return self.group("pos_embd")

    def is_rank_in_embedding_group(self) -> bool:
        return "embd" in self.global_ranks  # middle pipeline stages hold no embedding

    # experts
    def get_expert_model_parallel_group(self):
        return self.group("ep")

    def get_expert_model_parallel_rank(self) -> int:
        return self.rank_in("ep")

    def get_expert_model_parallel_world_size(self) -> int:
        return self.size_of("ep")

    def get_expert_tensor_parallel_group(self):
        return self.group("etp")

    def get_expert_tensor_parallel_rank(self) -> int:
        return self.rank_in("etp")

    def get_expert_tensor_parallel_world_size(self) -> int:
        return self.size_of("etp")

    def get_expert_tensor_and_model_parallel_group(self):
        return self.group("tp-ep")

    def get_expert_tensor_model_pipeline_parallel_group(self):
        return self.group("tp-ep-pp")

    def get_expert_data_parallel_group(self):
        return self.group("edp")

    def get_expert_data_parallel_rank(self) -> int:
        return self.rank_in("edp")

    def get_expert_data_parallel_world_size(self) -> int:
        return self.size_of("edp")


_STATE: ParallelState | None = None  # the "current" state the module-level accessors read


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    order: str = DEFAULT_ORDER,
    hierarchical_context_parallel_sizes: list[int] | None = None,
) -> ParallelState:
    """Create every dense and expert group (collective: all ranks call it) and make it current.
    `hierarchical_context_parallel_sizes` ([a2a size, p2p size], product cp) adds the "hcp0", "hcp1" groups of
    cp_comm_type "a2a+p2p" (hierarchical_context_parallel_ranks).

    torch.distributed must be initialized; the data-parallel sizes follow from the world size.
    Raises ValueError for layouts that do not fit the world, RuntimeError if a state is current.
    """
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("initialize torch.distributed first (megalab.lab.dist.init() or dist.init_process_group)")
    if _STATE is not None:
        raise RuntimeError("model parallel groups are already initialized; call destroy_model_parallel() first")
    sizes = ParallelSizes(dist.get_world_size(), tensor_model_parallel_size, pipeline_model_parallel_size,
                          context_parallel_size, expert_model_parallel_size, expert_tensor_parallel_size, order)
    rank = dist.get_rank()
    groups, global_ranks = {}, {}
    for name, all_ranks in rank_groups(sizes).items():
        group, ranks = create_groups(all_ranks, rank)
        if ranks is not None:
            groups[name], global_ranks[name] = group, ranks
    if hierarchical_context_parallel_sizes:
        by_cp_group = [hierarchical_context_parallel_ranks(r, hierarchical_context_parallel_sizes)
                       for r in rank_groups(sizes)["cp"]]
        for level in range(len(hierarchical_context_parallel_sizes)):
            group, ranks = create_groups([sub for levels in by_cp_group for sub in levels[level]], rank)
            groups[f"hcp{level}"], global_ranks[f"hcp{level}"] = group, ranks
    _STATE = ParallelState(sizes, rank, groups, global_ranks)
    return _STATE


def destroy_model_parallel() -> None:
    """Destroy the process groups of the current state and forget it (every rank calls it).

    Each group holds threads and sockets (gloo) or a communicator (NCCL) until destroyed; a loop
    that initializes again and again would otherwise pile them up until it hangs. Layers built
    under the state keep references to groups that no longer work: build new ones after the next
    initialize_model_parallel. Megatron: destroy_model_parallel (megatron/core/parallel_state.py).
    """
    global _STATE
    state, _STATE = _STATE, None
    if state is None:
        return
    for group in {id(g): g for g in state.groups.values() if g is not None}.values():
        dist.destroy_process_group(group)


@contextmanager
def no_model_parallel() -> Iterator[None]:
    """Inside, no state is current: build and run a model as on one process (the single-process
    reference a parallel run is compared with) while this rank's groups stay alive."""
    global _STATE
    saved, _STATE = _STATE, None
    try:
        yield
    finally:
        _STATE = saved


_DATA_PARALLEL = ("dp", "dp-cp", "edp")


def resolve_group(group, name: str, *, alone: bool = True):
    """What a `group=None` argument means (the module docstring's rule): `group` if given, else the
    current state's group `name` (a rank_groups name: "tp", "pp", "dp-cp", "ep", "tp-pp", ...). With no
    state: the world for a data-parallel name; None (this process alone) for the others if `alone`,
    else a RuntimeError that says what to do."""
    if group is not None:
        return group
    if _STATE is not None:
        return _STATE.group(name)
    if name in _DATA_PARALLEL and dist.is_initialized():
        return dist.group.WORLD
    if alone:
        return None
    raise RuntimeError(f"no {name!r} process group: pass group=... or call initialize_model_parallel(...) first")


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialized; call initialize_model_parallel(...) first")
    return _STATE


# Megatron-LM's module-level accessors, reading the current state.
def get_tensor_model_parallel_group():
    return get_parallel_state().get_tensor_model_parallel_group()


def get_tensor_model_parallel_rank() -> int:
    return get_parallel_state().get_tensor_model_parallel_rank()


def get_tensor_model_parallel_world_size() -> int:
    return get_parallel_state().get_tensor_model_parallel_world_size()


def get_pipeline_model_parallel_group():
    return get_parallel_state().get_pipeline_model_parallel_group()


def get_pipeline_model_parallel_rank() -> int:
    return get_parallel_state().get_pipeline_model_parallel_rank()


def get_pipeline_model_parallel_world_size() -> int:
    return get_parallel_state().get_pipeline_model_parallel_world_size()


def is_pipeline_first_stage() -> bool:
    return get_parallel_state().is_pipeline_first_stage()


def is_pipeline_last_stage() -> bool:
    return get_parallel_state().is_pipeline_last_stage()


def get_data_parallel_group(with_context_parallel: bool = False):
    return get_parallel_state().get_data_parallel_group(with_context_parallel)


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return get_parallel_state().get_data_parallel_rank(with_context_parallel)


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return get_parallel_state().get_data_parallel_world_size(with_context_parallel)


def get_context_parallel_group():
    return get_parallel_state().get_context_parallel_group()


def get_context_parallel_rank() -> int:
    return get_parallel_state().get_context_parallel_rank()


def get_context_parallel_world_size() -> int:
    return get_parallel_state().get_context_parallel_world_size()


def get_hierarchical_context_parallel_groups():
    return get_parallel_state().get_hierarchical_context_parallel_groups()


def get_model_parallel_group():
    return get_parallel_state().get_model_parallel_group()


def get_embedding_group():
    return get_parallel_state().get_embedding_group()


def get_expert_model_parallel_group():
    return get_parallel_state().get_expert_model_parallel_group()


def get_expert_model_parallel_rank() -> int:
    return get_parallel_state().get_expert_model_parallel_rank()


def get_expert_model_parallel_world_size() -> int:
    return get_parallel_state().get_expert_model_parallel_world_size()


def get_expert_tensor_parallel_group():
    return get_parallel_state().get_expert_tensor_parallel_group()


def get_expert_data_parallel_group():
    return get_parallel_state().get_expert_data_parallel_group()
