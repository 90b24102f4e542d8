"""Token dispatchers: bring each token to the ranks of its experts and back (all-gather or all-to-all).

Megatron: megatron/core/transformer/moe/token_dispatcher.py (MoEAllGatherTokenDispatcher,
MoEAlltoAllTokenDispatcher).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalab.core.tensor_parallel.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megalab.core.transformer.moe.moe_utils import permute, sort_chunks_by_idxs, unpermute


# ------------------------------------------------------------------ token dispatchers
class MoEAllGatherTokenDispatcher:
    """Every rank gets every token of the EP group, keeps those routed to its experts, and the
    outputs are reduce-scattered back (summing the contributions of all ranks' experts)."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], ep_group=None):
        self.num_local_experts, self.local_expert_indices, self.ep_group = (
            num_local_experts, local_expert_indices, ep_group)
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1

    def token_permutation(self, hidden, probs, routing_map):  # [T, h], [T, E], [T, E]
        if self.ep_size > 1:
            hidden = gather_from_sequence_parallel_region(hidden, group=self.ep_group)  # [ep T, h]
            probs = gather_from_sequence_parallel_region(probs, group=self.ep_group)  # [ep T, E]
            with torch.no_grad():
                routing_map = gather_from_sequence_parallel_region(routing_map.float(), group=self.ep_group).bool()
        local = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)
        self.num_tokens = hidden.shape[0]
        permuted, self.permuted_probs, self.sorted_indices = permute(hidden, routing_map[:, local], probs[:, local])
        return permuted, routing_map[:, local].sum(dim=0)  # [N, h], tokens per local expert [L]

    def token_unpermutation(self, expert_output):  # [N, h] -> [T, h]
        output = unpermute(expert_output, self.sorted_indices, self.num_tokens, self.permuted_probs)
        if self.ep_size > 1:
            output = reduce_scatter_to_sequence_parallel_region(output, group=self.ep_group)
        return output


class MoEAlltoAllTokenDispatcher:
    """permute -> all-to-all (uneven splits) -> sort by local expert; and back. Only the tokens
    routed to another rank's experts travel, once each way (a2a_bytes counts them)."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], ep_group=None):
        self.num_local_experts, self.local_expert_indices, self.ep_group = (
            num_local_experts, local_expert_indices, ep_group)
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        self.a2a_bytes = 0  # bytes this rank sent to other ranks, dispatch + combine, last forward

    def token_permutation(self, hidden, probs, routing_map):  # [T, h], [T, E], [T, E]
        ep, L = self.ep_size, self.num_local_experts
        self.num_tokens = hidden.shape[0]
        num_local_tokens_per_expert = routing_map.sum(dim=0)  # [E]
        permuted, self.permuted_probs, self.sorted_indices = permute(hidden, routing_map, probs)
        # EXERCISE moe.alltoall_dispatch: exchange counts, a2a the permuted tokens, sort the chunks by local expert
        ### BEGIN SOLUTION
        # HINT 1: Before the all-to-all every rank must know how many rows it sends to and receives from
        #         each rank; afterwards the received rows are ordered [source rank][local expert] and the experts want
        #         them [local expert][source rank].
        # HINT 2: all_gather the per-expert counts over the EP group -> [ep, E]; my columns
        #         (local_expert_indices) give what each rank sends me; input_splits = my counts summed per destination
        #         rank, output_splits = my columns summed per source rank; all_to_all(group, tokens, output_splits,
        #         input_splits); then sort_chunks_by_idxs to regroup by local expert.
        # HINT 3: all_to_all takes the OUTPUT splits first; swapping them works only when they happen to be
        #         equal.
        if ep > 1:
            counts = [torch.empty_like(num_local_tokens_per_expert) for _ in range(ep)]
            dist.all_gather(counts, num_local_tokens_per_expert, group=self.ep_group)
            counts = torch.stack(counts)  # [ep, E]: what each rank sends to each expert
        else:
            counts = num_local_tokens_per_expert.unsqueeze(0)
        per_local = counts[:, self.local_expert_indices]  # [ep, L]: rows from rank r for my expert l
        self.input_splits = num_local_tokens_per_expert.view(ep, L).sum(dim=1).tolist()
        self.output_splits = per_local.sum(dim=1).tolist()
        self.num_global_tokens_per_local_expert = per_local
        if ep > 1:
            permuted = all_to_all(self.ep_group, permuted, self.output_splits, self.input_splits)
        if L > 1:  # received [rank][expert] -> [expert][rank]
            permuted = sort_chunks_by_idxs(permuted, per_local.reshape(-1),
                                           torch.arange(ep * L).view(ep, L).t().reshape(-1).tolist())
        ### END SOLUTION
        sent = sum(n for r, n in enumerate(self.input_splits) if r != self.ep_rank)
        self.a2a_bytes = 2 * sent * hidden.shape[-1] * hidden.element_size()
        return permuted, self.num_global_tokens_per_local_expert.sum(dim=0)  # [N, h], [L]

    def token_unpermutation(self, expert_output):  # [N, h] -> [T, h]
        ep, L = self.ep_size, self.num_local_experts
        if L > 1:  # [expert][rank] -> [rank][expert]
            expert_output = sort_chunks_by_idxs(expert_output, self.num_global_tokens_per_local_expert.t().reshape(-1),
                                                torch.arange(L * ep).view(L, ep).t().reshape(-1).tolist())
        if ep > 1:
            expert_output = all_to_all(self.ep_group, expert_output, self.input_splits, self.output_splits)
        return unpermute(expert_output, self.sorted_indices, self.num_tokens, self.permuted_probs)


DISPATCHERS = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher}
