"""Resharding (refit): move weights between two parallel layouts of one model, e.g. trainer -> inference engine.

Megatron: megatron/core/resharding/ (planner.py, execution.py, refit.py, copy_services/gloo_copy_service.py).
"""

from megalab.core.resharding.execution import RefitStats, execute_reshard_plan
from megalab.core.resharding.planner import ReshardError, build_local_reshard_plan, build_plan_from_rosters
from megalab.core.resharding.refit import swap_model_weights
from megalab.core.resharding.utils import ParameterMetadata, ReshardPlan, TransferOp

__all__ = ["ParameterMetadata", "RefitStats", "ReshardError", "ReshardPlan", "TransferOp", "build_local_reshard_plan",
           "build_plan_from_rosters", "execute_reshard_plan", "swap_model_weights"]
