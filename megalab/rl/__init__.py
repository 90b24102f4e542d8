"""Chapter 07 project · the RL systems loop: GRPO (rl_utils.py), a verifiable task (agent/), the rollouts' batch
(rollouts.py), the train/serve log-prob check (logprob_check.py), the loop on tp·pp ranks with a refit after every
step (parallel.py); the loop on one process is megalab/train_rl.py, the refit megalab/core/resharding/.

Megatron: megatron/rl/ (rl_utils.py, agent/), train_rl.py.
"""
