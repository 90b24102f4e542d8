"""Chapter 07 project · the RL systems loop: GRPO (rl_utils.py), a verifiable task (agent/), the train/serve
log-prob check (logprob_check.py); the loop itself is megalab/train_rl.py, the refit megalab/core/resharding/.

Megatron: megatron/rl/ (rl_utils.py, agent/), train_rl.py.
"""
