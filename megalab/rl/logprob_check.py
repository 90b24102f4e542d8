"""The train/serve check: the trainer's log-probs of the sampled tokens against the engine's, per token.

The engine sampled each response token from its own distribution and returned its log-prob; the trainer
recomputes the same token's log-prob with its own forward. Same weights, same math: they differ only by
float rounding (the engine attends over a KV cache one new token at a time, the trainer runs causal attention
over the whole sequence, so sums run in another order). Measured on the GRPO loop's policy (float32, ragged
1-3 token responses, three training steps in): 4.8e-7 at most, on one process and with the trainer at tp2·pp2
against an engine at tp1 or tp2 (megalab/rl/parallel.py). TOLERANCE = 1e-4 leaves ~200x headroom and is still
below every planted bug: a refit sent in bf16 1.2e-3, a column-parallel weight's TP halves swapped 1.6, the
trainer applying temperature 0.7 0.48, the engine still on the initial weights 1.3 (max |difference| over a
batch). An honest bf16 engine sits near the
bf16 number: Megatron then corrects with an importance weight (calculate_grpo_loss's inference_logprobs,
is_truncation_coef) instead of refusing the batch.

`diagnose` names the cause of a mismatch by testing one hypothesis at a time:

    stale weights        the engine's weights are not the trainer's (a refit skipped; weights_version
                         behind): trl #5312 (vLLM weights not synchronized with sleep mode: the
                         engine kept generating with old weights, sampling_logp_difference 0.8)
    wrong slice          a parameter holds the trainer's values in another order (TP halves swapped, a
                         pipeline stage's layers under the wrong numbers): the weight-sync layout bugs of
                         AReaL #1560 (Megatron -> vLLM sync tied to matching PP sizes) that a resharding
                         plan exists to avoid
    precision            the engine's weights are the trainer's rounded to bf16 (a refit sent in bf16)
                         or the engine runs in another dtype: trl #3867 (truncated importance sampling
                         for the rollout/training mismatch)
    temperature          the engine's (or the trainer's) log-probs are of the logits / T: one side applies
                         the sampling temperature, the other does not: vllm #42259 (logprob semantics across
                         engines: raw vs processed), trl #4159
The loss normalisation bug (per-sequence where Megatron is per token: Megatron-LM #4590) changes no log-prob:
`check_loss_normalization` finds it from the loss itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalab.rl.rl_utils import compute_logprobs, reduce_loss

TOLERANCE = 1e-4

REPORTS = {
    "stale weights": "trl #5312",
    "wrong slice": "AReaL #1560",
    "precision": "trl #3867",
    "temperature (engine side only)": "vllm #42259",
    "temperature (trainer side only)": "vllm #42259",
    "per-sequence normalization": "Megatron-LM #4590",
}


class TrainServeMismatch(RuntimeError):
    """The trainer's and the engine's log-probs disagree beyond TOLERANCE: training on this batch would use a
    wrong importance ratio (or a policy other than the one that sampled)."""


@dataclass
class LogprobComparison:
    max_abs_diff: float
    mean_abs_diff: float
    num_tokens: int
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def compare_logprobs(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                     tolerance: float = TOLERANCE) -> LogprobComparison:
    """The two sides' log-probs of the same tokens (any shape, equal), compared element by element."""
    if trainer_logprobs.shape != engine_logprobs.shape:
        raise ValueError(f"trainer log-probs {tuple(trainer_logprobs.shape)} vs engine "
                         f"{tuple(engine_logprobs.shape)}: not the same tokens")
    diff = (trainer_logprobs.double() - engine_logprobs.double()).abs()
    return LogprobComparison(float(diff.max()) if diff.numel() else 0.0, float(diff.mean()) if diff.numel() else 0.0,
                             diff.numel(), tolerance)


def _close(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    return compare_logprobs(a, b, tolerance).ok


@torch.no_grad()
def diagnose(trainer_model, engine, tokens: torch.Tensor, loss_mask: torch.Tensor, trainer_logprobs: torch.Tensor,
             engine_logprobs: torch.Tensor, temperature: float, trainer_version: int | None = None,
             tolerance: float = TOLERANCE) -> list[tuple[str, str, str]]:
    """What explains the mismatch, as (cause, public report, evidence) tuples; [] if nothing does.

    The weights are tested first, and the first weight cause found is returned alone (stale weights, wrong
    slice or precision: different weights explain any log-prob gap). Only when every weight equals the
    trainer's are the log-probs tested: one tuple per side whose log-probs are the tempered ones.

    tokens [b, s], loss_mask [b, s - 1] (the response positions); trainer_logprobs / engine_logprobs: the values
    at those positions, flat [n]. trainer_version: how many refits the engine should have had."""
    # EXERCISE rl.diagnose: test the weights first (stale, wrong slice, bf16), then temperature on either side; one (cause, REPORTS[cause], evidence) per hit
    ### BEGIN SOLUTION
    # HINT 1: Same weights and same math give the same log-probs, so look at the weights before the log-probs.
    #         A refit counter behind the trainer's, or weights that are simply other values, is stale. Weights
    #         that hold exactly the trainer's values but in another order are a wrong slice (a permutation
    #         keeps the sorted values). Weights equal to the trainer's rounded to bfloat16 are a precision bug.
    #         Only when every weight is equal can the log-probs differ by sampling parameters: recompute the
    #         trainer's log-probs at temperature 1 (Megatron's: raw logits) and at `temperature`, and see which
    #         side matches which.
    # HINT 2: Compare engine.model's and trainer_model's named_parameters with torch.equal. Order of the
    #         tests: weights_version != trainer_version (when given) -> "stale weights"; else a parameter in
    #         another dtype -> "precision"; then, on the first parameter that differs: equal to the trainer's
    #         .bfloat16() -> "precision", same sorted values -> "wrong slice"; any difference left unexplained
    #         -> "stale weights". Return as soon as a weight cause is found.
    # HINT 3: compute_logprobs(trainer_model, tokens, T)[loss_mask.bool()] gives the response tokens' log-probs
    #         in the order of the flat inputs. The engine side is at fault when its log-probs are NOT close to
    #         the temperature-1 ones but ARE close to the tempered ones (_close with `tolerance`); the same
    #         test on trainer_logprobs names the trainer side. Each hit is (cause, REPORTS[cause], a sentence of
    #         evidence); a batch with no explanation gives [].
    found = []
    trainer_params = dict(trainer_model.named_parameters())
    engine_params = dict(engine.model.named_parameters())
    different = [n for n, p in engine_params.items() if not torch.equal(p, trainer_params[n].to(p.dtype))]
    if trainer_version is not None and engine.weights_version != trainer_version:
        found.append(("stale weights", REPORTS["stale weights"],
                      f"the engine has had {engine.weights_version} refits, the trainer expects {trainer_version}"))
    elif any(engine_params[n].dtype != trainer_params[n].dtype for n in engine_params):
        found.append(("precision", REPORTS["precision"], "the engine's weights are in another dtype"))
    for n in different:
        mine, theirs = engine_params[n].float(), trainer_params[n].float()
        if torch.equal(mine, theirs.bfloat16().float()):
            found.append(("precision", REPORTS["precision"], f"{n}: the trainer's values rounded to bf16"))
            break
        if mine.shape == theirs.shape and torch.equal(mine.flatten().sort().values, theirs.flatten().sort().values):
            found.append(("wrong slice", REPORTS["wrong slice"], f"{n}: the trainer's values in another order"))
            break
    if different and not found:
        found.append(("stale weights", REPORTS["stale weights"],
                      f"{len(different)} parameters differ from the trainer's (first: {different[0]})"))
    if found:
        return found
    reference = compute_logprobs(trainer_model, tokens)[loss_mask.bool()]  # raw logits: Megatron's semantics
    tempered = compute_logprobs(trainer_model, tokens, temperature)[loss_mask.bool()]
    if not _close(reference, engine_logprobs, tolerance) and _close(tempered, engine_logprobs, tolerance):
        found.append(("temperature (engine side only)", REPORTS["temperature (engine side only)"],
                      f"the engine's log-probs are those of logits / {temperature}"))
    if not _close(reference, trainer_logprobs, tolerance) and _close(tempered, trainer_logprobs, tolerance):
        found.append(("temperature (trainer side only)", REPORTS["temperature (trainer side only)"],
                      f"the trainer's log-probs are those of logits / {temperature}"))
    return found
    ### END SOLUTION


def check_loss_normalization(loss_fn) -> list[tuple[str, str, str]]:
    """Run a learner's loss_fn(per_token [b, s], loss_mask [b, s]) -> scalar on rows of different lengths and
    say whether it normalises per token (Megatron's: Σ / number of tokens) or per sequence."""
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    got = float(loss_fn(per_token, mask))
    token, sequence = float(reduce_loss(per_token, mask, "token")), float(reduce_loss(per_token, mask, "sequence"))
    if abs(got - token) < 1e-6:
        return []
    if abs(got - sequence) < 1e-6:
        return [("per-sequence normalization", REPORTS["per-sequence normalization"],
                 f"loss {got:.4f} = the mean of each row's mean; Megatron's per-token loss is {token:.4f}")]
    return [("unknown normalization", "", f"loss {got:.4f}; per token {token:.4f}, per sequence {sequence:.4f}")]
