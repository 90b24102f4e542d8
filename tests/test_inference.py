"""KV caches, the cached forward, sampling and the batching engine against independent references:
the model's own full forward (recompute, no cache), brute-force sorting for top-k/top-p, the
softmax for sampled frequencies, and the single-process model for tensor-parallel inference."""

import functools
from functools import partial

import pytest
import torch

from megalab.core.inference import (
    ContiguousKVCache,
    InferenceEngine,
    KVBlockAllocator,
    PagedKVCache,
    SamplingParams,
    Segment,
    filter_logits,
    forward_step,
    generate_by_recompute,
    sample,
)
from megalab.core.inference.text_generation_controllers.text_generation_controller import attend
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.lab import launch
from megalab.lab.checks import mistake
from tests.feedback import close, equal, require

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=64,
            hidden_dropout=0.0, attention_dropout=0.0)
VARIANTS = {
    "gpt": dict(),
    "llama-gqa": dict(position_embedding_type="rope", num_query_groups=2, normalization="RMSNorm",
                      activation_func="silu", gated_linear_unit=True, add_bias_linear=False,
                      share_embeddings_and_output_weights=False, attention_backend="unfused"),
}
LENGTHS = [(3, 10), (9, 4), (5, 20), (12, 8), (7, 15)]  # (prompt, tokens to generate)


def _model(variant="gpt"):
    config = TransformerConfig(**BASE, **VARIANTS[variant])
    torch.manual_seed(0)
    return GPTModel(config).eval()


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n, _ in LENGTHS]


def _equal_naming(got, expected, what, mistakes):
    """equal(got, expected, what); when they differ and `got` is what a typical mistake gives ({name: its result}),
    the verdict names that mistake first."""
    if got != expected:
        for name, result in mistakes.items():
            if got == result:
                return mistake(name, f"{what} is {got!r}, expected {expected!r}")
    return equal(got, expected, what)


def _caches(config):
    return {"contiguous": ContiguousKVCache(config, max_batch_size=4),
            "paged": PagedKVCache(config, num_blocks=40, block_size=4)}


# ------------------------------------------------------------------ KV caches
@pytest.mark.exercise("inference.paged_slots")
def test_paged_slots_go_through_the_block_table_and_name_the_mistake():
    cache = PagedKVCache(TransformerConfig(**BASE), num_blocks=8, block_size=4)
    for length in (4, 8, 12, 16):  # two sequences growing in turns: sequence 0 holds every other block
        cache.reserve(0, length)
        cache.reserve(1, length)
    table, positions = torch.tensor(cache.block_tables[0]), torch.arange(3, 9)  # 4 blocks: any p % 4 indexes it
    got = torch.stack(cache.slots(0, 3, 6))
    require(close(got, torch.stack([table[positions // 4], positions % 4]),
                  f"PagedKVCache(block_size=4).slots(sequence 0, start 3, 6 positions) with block table "
                  f"{table.tolist()}: row 0 the blocks, row 1 the offsets", rtol=0, atol=0, mistakes={
                      "used position // block_size as the block id itself, not as an index into the block table":
                          torch.stack([positions // 4, positions % 4]),
                      "rounded the block index up (ceil, as in blocks_needed): off by one page":
                          torch.stack([table[-(-positions // 4)], positions % 4]),
                      "counted the positions from 0, not from start":
                          torch.stack([table[torch.arange(6) // 4], torch.arange(6) % 4]),
                      "swapped quotient and remainder: the block looked up by position % block_size, the offset "
                      "position // block_size": torch.stack([table[positions % 4], positions // 4]),
                  }))


@pytest.mark.exercise("inference.paged_slots")
def test_paged_cache_follows_the_block_table():
    config = TransformerConfig(**BASE)
    cache = PagedKVCache(config, num_blocks=8, block_size=4)
    for length in (2, 5, 9):  # two sequences growing in turns: their blocks interleave in the pool
        cache.reserve(0, length)
        cache.reserve(1, length + 3)
    blocks, offsets = cache.slots(0, 3, 6)
    table = cache.block_tables[0]
    where = f"PagedKVCache(block_size=4).slots(sequence 0, start 3, 6 positions) with block table {table}"
    require(equal(blocks.tolist(), [table[p // 4] for p in range(3, 9)],
                  f"the blocks of {where} (position p lies in block_table[p // block_size])"))
    require(equal(offsets.tolist(), [p % 4 for p in range(3, 9)],
                  f"the offsets of {where} (position p is at p % block_size in its block)"))
    assert table != list(range(table[0], table[0] + len(table))), (  # really scattered over the pool
        f"sequence 0's block table {table} is contiguous; two sequences growing in turns should interleave")
    keys = {s: torch.randn(n, 4, 8) for s, n in ((0, 9), (1, 12))}
    for s, k in keys.items():
        cache.write(1, s, 0, k[:5], -k[:5])
        cache.write(1, s, 5, k[5:], -k[5:])
    for s, k in keys.items():
        key, value = cache.read(1, s, len(k))
        where = f"PagedKVCache, layer 1, sequence {s}: reading back {len(k)} positions written in two parts (0..4, 5..)"
        require(close(key, k, f"{where}: the keys", rtol=0, atol=0))
        require(close(value, -k, f"{where}: the values", rtol=0, atol=0))


def test_paged_cache_holds_only_the_blocks_it_uses():
    config = TransformerConfig(**BASE)
    paged, contiguous = PagedKVCache(config, num_blocks=16, block_size=4), ContiguousKVCache(config, max_batch_size=4)
    for cache in (paged, contiguous):
        cache.reserve(0, 6)
    assert paged.block_tables[0] and len(paged.block_tables[0]) == 2
    assert contiguous.bytes_reserved() == 64 / 8 * paged.bytes_reserved()  # 64 positions vs 2 blocks of 4
    paged.free(0)
    assert len(paged.allocator.free_blocks) == 16
    assert paged.fits([16] * 4) and not paged.fits([16] * 4 + [1])
    with pytest.raises(RuntimeError, match="out of KV-cache blocks"):
        paged.reserve(1, 100)


# ------------------------------------------------------------------ the cached forward
def _attend_by_loops(query, keys, values, last_key, group_of):
    """[n, np * hn]: query i, head h, softmax over keys 0..last_key(i) of key/value group group_of(h)."""
    n, np_, hn = query.shape
    out = torch.zeros(n, np_, hn)
    for i in range(n):
        for h in range(np_):
            k, v = keys[: last_key(i) + 1, group_of(h)], values[: last_key(i) + 1, group_of(h)]
            out[i, h] = torch.softmax(query[i, h] @ k.T / hn**0.5, -1) @ v
    return out.reshape(n, np_ * hn)


@pytest.mark.exercise("inference.cached_attention")
def test_attend_sees_the_cache_up_to_its_own_position_and_names_the_mistake():
    g = torch.Generator().manual_seed(3)
    n, np_, ng, hn, start = 3, 4, 2, 8, 5  # 3 new queries at positions 5, 6, 7; GQA: 2 heads per key/value group
    query, keys, values = torch.randn(n, np_, hn, generator=g), *torch.randn(2, start + n, ng, hn, generator=g)
    by_loops = partial(_attend_by_loops, query, keys, values)
    require(close(attend(query, keys, values, start), by_loops(lambda i: start + i, lambda h: h // 2),
                  "attend(3 new queries at positions 5..7, 8 cached keys, 4 heads, 2 key/value groups)", mistakes={
                      "causal mask without the cache offset: query i sees keys 0..i, not 0..start+i":
                          lambda: by_loops(lambda i: i, lambda h: h // 2),
                      "no causal mask: the new queries see later keys of the same step":
                          lambda: by_loops(lambda i: start + n - 1, lambda h: h // 2),
                      "GQA heads mapped with repeat (h % ng), not repeat_interleave (h // (np / ng))":
                          lambda: by_loops(lambda i: start + i, lambda h: h % 2),
                  }))


@pytest.mark.exercise("inference.cached_attention")
@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_forward_equals_the_full_forward(variant):
    model = _model(variant)
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(2))
    full = model(ids)  # [2, 11, V], no cache
    for name, cache in _caches(model.config).items():
        # one ragged step: prefill 7 tokens of sequence 0 and 4 of sequence 1; then the rest of both
        for s in (0, 1):
            cache.reserve(s, 11)
        first = forward_step(model, torch.cat([ids[0, :7], ids[1, :4]]), torch.tensor([*range(7), *range(4)]),
                             [Segment(0, 0, 7), Segment(1, 0, 4)], cache)
        second = forward_step(model, torch.cat([ids[0, 7:], ids[1, 4:]]), torch.tensor([*range(7, 11), *range(4, 11)]),
                              [Segment(0, 7, 4), Segment(1, 4, 7)], cache)
        ours = torch.stack([torch.cat([first[:7], second[:4]]), torch.cat([first[7:], second[4:]])])
        require(close(ours, full, f"{variant}, {name} cache: the logits of a cached forward (prefill 7 and 4 tokens, "
                                  "then the rest) vs the full forward without a cache", atol=1e-5, rtol=1e-5))


@pytest.mark.integration
@pytest.mark.exercise("inference.cached_attention")
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_with_cache_equals_recompute_token_for_token(variant):
    model, prompts = _model(variant), _prompts()
    params = [SamplingParams(top_k=1, num_tokens_to_generate=n) for _, n in LENGTHS]
    expected = [generate_by_recompute(model, p, sp) for p, sp in zip(prompts, params)]
    for name, cache in _caches(model.config).items():
        for mode in ("continuous", "static"):
            engine = InferenceEngine(model, cache, max_batch_size=3, max_tokens=24, mode=mode)
            got = [r.generated_tokens for r in engine.generate(prompts, params)]
            for i, (g, e) in enumerate(zip(got, expected)):
                first = next((j for j, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
                assert g == e, (f"{variant}, {name} cache, {mode} batching: request {i}'s greedy tokens differ from "
                                f"recomputing the whole sequence each step from token {first} on: got {g[first:first + 5]}, "
                                f"expected {e[first:first + 5]} ({len(g)} vs {len(e)} tokens)")
            require(equal(len(got), len(expected), f"{variant}, {name} cache, {mode} batching: the number of results"))


# ------------------------------------------------------------------ sampling
def _filter_reference_ties(logits, top_k, top_p):
    """The rule as the task states it: top-k drops logits below the k-th largest value (ties stay), then top-p
    keeps the shortest most-likely prefix of what is left with mass >= top_p."""
    keep = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k:
        kth = sorted(logits.tolist(), reverse=True)[min(top_k, len(logits)) - 1]
        keep = [i for i in keep if logits[i] >= kth]
    if top_p:
        probs = torch.softmax(logits[keep], 0).tolist()
        total, n = 0.0, 0
        while total < top_p and n < len(keep):
            total, n = total + probs[n], n + 1
        keep = keep[:n]
    return set(keep)


def _filter_reference(logits, top_k, top_p):
    """Brute force: rank the tokens, keep the first top_k, then the shortest prefix with mass >= top_p."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    keep = order[:top_k] if top_k else order
    if top_p:
        probs = torch.softmax(logits[keep], 0).tolist() if top_k else torch.softmax(logits, 0)[keep].tolist()
        total, n = 0.0, 0
        while total < top_p and n < len(keep):
            total, n = total + probs[n], n + 1
        keep = keep[:n]
    return set(keep)


@pytest.mark.exercise("inference.filter_logits")
def test_filter_logits_keeps_ties_and_the_crossing_token_and_names_the_mistake():
    def kept(logits, top_k, top_p):
        before = logits.clone()
        out = filter_logits(logits, top_k, top_p)
        changed = (logits != before).nonzero().flatten().tolist()
        if changed:
            require(mistake("filtered the caller's logits in place (clone them first)",
                            f"filter_logits(top_k={top_k}, top_p={top_p}) changed its input at positions {changed}"))
        return sorted(torch.nonzero(out > float("-inf")).flatten().tolist())

    distinct = torch.tensor([0.5, 3.0, 1.0, 2.0, -1.0], dtype=torch.float64)
    ties = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0, 2.0, -1.0], dtype=torch.float64)  # three logits tie at the 2nd place
    nucleus = torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=torch.float64).log()  # probabilities, in vocabulary order
    then = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64).log()
    cases = {"top_k=2": (distinct, 2, 0.0), "top_k=2 with ties": (ties, 2, 0.0), "top_p=0.6": (nucleus, 0, 0.6),
             "top_k=2 then top_p=0.5": (then, 2, 0.5)}
    got = {name: kept(*case) for name, case in cases.items()}
    expected = {"top_k=2": [1, 3], "top_k=2 with ties": [0, 2, 3, 5], "top_p=0.6": [1, 3], "top_k=2 then top_p=0.5": [0]}

    def with_k(shift):  # what a top-k that keeps k + shift gives in every case (ties kept, as the rule says)
        return {name: sorted(_filter_reference_ties(logits, k + shift if k else 0, p))
                for name, (logits, k, p) in cases.items()}

    what = ("the tokens filter_logits keeps (top_k=2 of [0.5, 3, 1, 2, -1]; top_k=2 of [3, 1, 2, 2, 0, 2, -1]; "
            "top_p=0.6 of probabilities [0.15, 0.5, 0.05, 0.3]; top_k=2 then top_p=0.5 of probabilities "
            "[0.4, 0.3, 0.2, 0.1])")
    require(_equal_naming(got, expected, what, {
        "top-k kept k + 1 tokens (an off-by-one in the k-th largest: topk(...).values[k - 1] is the k-th)": with_k(1),
        "top-k kept k - 1 tokens (an off-by-one in the k-th largest: topk(...).values[k - 1] is the k-th)": with_k(-1),
        "top-k kept exactly k indices and dropped the ties of the k-th largest logit (compare with its value: "
        "drop logits < the k-th largest, as Megatron does)":
            {**expected, "top_k=2 with ties": sorted(torch.topk(ties, 2).indices.tolist())},
        "top-p dropped the token that crosses top_p (the nucleus must reach top_p: drop only when the mass "
        "before a token reached it)": {**expected, "top_p=0.6": [1]},
        "top-p summed the probabilities in vocabulary order, not sorted by probability":
            {**expected, "top_p=0.6": [0, 1]},
        "top-p ran on the logits before top-k (top-k's -inf ignored)": {**expected, "top_k=2 then top_p=0.5": [0, 1]},
    }))


@pytest.mark.exercise("inference.filter_logits")
@pytest.mark.parametrize("top_k,top_p", [(0, 0.0), (5, 0.0), (0, 0.5), (0, 0.9), (10, 0.8), (1, 0.0), (0, 1e-6)])
def test_filter_logits_keeps_the_top_k_and_the_nucleus(top_k, top_p):
    logits = torch.randn(50, generator=torch.Generator().manual_seed(top_k + int(100 * top_p)), dtype=torch.float64)
    original = logits.clone()
    filtered = filter_logits(logits, top_k, top_p)
    changed = (logits != original).nonzero().flatten().tolist()
    if changed:
        require(mistake("filtered the caller's logits in place (clone them first)",
                        f"filter_logits(50 logits, top_k={top_k}, top_p={top_p}) changed {len(changed)} of its input's "
                        f"values, the first at positions {changed[:5]}"))
    logits = original
    kept = set(torch.nonzero(filtered > float("-inf")).flatten().tolist())
    expected = _filter_reference(logits, top_k, top_p)
    assert kept == expected, (
        f"filter_logits(50 logits, top_k={top_k}, top_p={top_p}) keeps {len(kept)} tokens, expected {len(expected)} "
        f"(top-k first, then the smallest set of the most likely with mass >= top_p); wrongly kept "
        f"{sorted(kept - expected)[:5]}, wrongly dropped {sorted(expected - kept)[:5]}")
    require(close(filtered[list(kept)], logits[list(kept)],
                  f"filter_logits(top_k={top_k}, top_p={top_p}): the kept logits vs the input's (unchanged)", rtol=0, atol=0))


def test_sampling_frequencies_follow_the_tempered_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.7)
    counts = torch.bincount(torch.tensor([sample(logits, params, generator) for _ in range(20000)]), minlength=4)
    torch.testing.assert_close(counts / 20000, torch.softmax(logits / 0.7, 0), atol=0.015, rtol=0)
    assert sample(logits, SamplingParams(temperature=0)) == 0 == sample(logits, SamplingParams(top_k=1))


def test_seeded_sampling_does_not_depend_on_the_batch():
    model, prompts = _model(), _prompts()
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=i, num_tokens_to_generate=n)
              for i, (_, n) in enumerate(LENGTHS)]
    alone = [generate_by_recompute(model, p, sp) for p, sp in zip(prompts, params)]
    engine = InferenceEngine(model, PagedKVCache(model.config, 40, 4), max_batch_size=4, max_tokens=32)
    assert [r.generated_tokens for r in engine.generate(prompts, params)] == alone
    assert len({tuple(a) for a in alone}) == len(alone)


@pytest.mark.parametrize("bad,message", [
    (dict(temperature=-0.1), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_p=1.5), "top_p"),
    (dict(num_tokens_to_generate=0), "num_tokens_to_generate"),
])
def test_sampling_params_reject_bad_values(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


# ------------------------------------------------------------------ the engine
def _admissions(waiting, running=(), max_batch_size=8, max_tokens=16, num_blocks=40, block_size=4, *, fifo=True,
                count_decode_tokens=True, budget_with_the_prompt=True, check_cache=True, batch_counts_running=True,
                fill_budget=True):
    """The indices of `waiting` ((prompt length, final length) pairs) schedule() admits beside `running` (final
    lengths), by the rule, or under one typical mistake (the keyword flags)."""
    admitted, tokens = [], len(running) if count_decode_tokens else 0
    for i, (prompt, final) in enumerate(waiting):
        if (len(running) if batch_counts_running else 0) + len(admitted) >= max_batch_size:
            break
        over_budget = tokens + prompt > max_tokens if budget_with_the_prompt else tokens > max_tokens
        over_budget |= not fill_budget and tokens + prompt == max_tokens
        blocks = sum(-(-length // block_size) for length in [*running, *(waiting[j][1] for j in admitted), final])
        if over_budget or (check_cache and blocks > num_blocks):
            if fifo:
                break
            continue
        admitted.append(i)
        tokens += prompt
    return admitted


@pytest.mark.exercise("inference.schedule")
def test_schedule_keeps_every_budget_and_names_the_mistake():
    model = _model()
    scenarios = {  # name: (prompts of the running requests, prompts waiting, engine settings); 4 tokens to generate
        "prompts 5, 9, 6, 1 and max_tokens=16": ((), (5, 9, 6, 1), dict(max_tokens=16)),
        "prompts 7, 9 and max_tokens=16 (exactly full)": ((), (7, 9), dict(max_tokens=16)),
        "2 running and prompts 6, 9 (max_tokens=16)": ((3, 3), (6, 9), dict(max_tokens=16)),
        "2 running, 3 waiting, max_batch_size=3": ((3, 3), (3, 3, 3), dict(max_batch_size=3, max_tokens=64)),
        "3 waiting needing 4 KV blocks each, 10 blocks": ((), (4, 4, 4), dict(max_tokens=64, num_blocks=10)),
    }
    got, rules = {}, {}
    for name, (running, waiting, settings) in scenarios.items():
        settings = {"max_batch_size": 8, "num_blocks": 40, **settings}
        generate = 12 if "KV" in name else 4
        engine = InferenceEngine(model, PagedKVCache(model.config, settings["num_blocks"], 4),
                                 max_batch_size=settings["max_batch_size"], max_tokens=settings["max_tokens"])
        requests = [engine.add_request([1] * n, SamplingParams(num_tokens_to_generate=generate))
                    for n in (*running, *waiting)]
        for _ in running:
            engine.waiting.popleft()
        engine.active = requests[:len(running)]
        got[name] = [requests.index(r) - len(running) for r in engine.schedule()]
        rules[name] = partial(_admissions, [(n, n + generate) for n in waiting], [n + generate for n in running],
                              **settings)
    expected = {name: rule() for name, rule in rules.items()}
    require(_equal_naming(got, expected, "the waiting requests schedule() admits, by scenario", {
        "admitted past the token budget: check tokens + the prompt against max_tokens BEFORE admitting":
            {name: rule(budget_with_the_prompt=False) for name, rule in rules.items()},
        "skipped a request that does not fit and admitted later ones (first come, first served: stop there)":
            {name: rule(fifo=False) for name, rule in rules.items()},
        "forgot the decode tokens of the running requests in the token budget":
            {name: rule(count_decode_tokens=False) for name, rule in rules.items()},
        "max_batch_size counted only the new requests, not the running ones":
            {name: rule(batch_counts_running=False) for name, rule in rules.items()},
        "did not check that the KV cache fits every admitted request (cache.fits)":
            {name: rule(check_cache=False) for name, rule in rules.items()},
        "refused a request that fills max_tokens exactly (tokens + prompt == max_tokens fits: compare with >)":
            {name: rule(fill_budget=False) for name, rule in rules.items()},
    }))


@pytest.mark.exercise("inference.schedule")
def test_scheduler_admits_in_order_within_every_budget():
    model = _model()
    # token budget: prompts of 5 + 9 fit 16, the third (6) does not; FIFO: the fourth (1) must not overtake it
    engine = InferenceEngine(model, PagedKVCache(model.config, 40, 4), max_batch_size=8, max_tokens=16)
    requests = [engine.add_request([1] * n, SamplingParams(num_tokens_to_generate=4)) for n in (5, 9, 6, 1)]

    def admitted():  # the scheduled requests, by their index in `requests`
        return [requests.index(r) if r in requests else r for r in engine.schedule()]

    require(equal(admitted(), [0, 1],
                  "the requests schedule() admits (prompts of 5, 9, 6, 1 tokens, max_tokens=16: 5 + 9 fit, 6 does not, "
                  "and the 1 must not overtake it)"))
    engine.active = requests[:2]  # next step: 2 decode tokens + 6 + 1 prompt tokens fit
    require(equal(admitted(), [2, 3], "the requests schedule() admits at the next step (requests 0 and 1 "
                                                 "running: 2 decode tokens + prompts of 6 and 1 fit max_tokens=16)"))
    # batch size
    engine = InferenceEngine(model, PagedKVCache(model.config, 40, 4), max_batch_size=2, max_tokens=64)
    requests = [engine.add_request([1] * 3) for _ in range(3)]
    require(equal(admitted(), [0, 1], "the requests schedule() admits (3 waiting, max_batch_size=2)"))
    # KV cache: 10 blocks of 4; each request needs ceil((4 + 12) / 4) = 4 blocks, so two fit
    engine = InferenceEngine(model, PagedKVCache(model.config, 10, 4), max_batch_size=8, max_tokens=64)
    requests = [engine.add_request([1] * 4, SamplingParams(num_tokens_to_generate=12)) for _ in range(3)]
    require(equal(admitted(), [0, 1], "the requests schedule() admits (3 waiting, each needs ceil((4 + 12) / "
                                                "4) = 4 KV blocks, the cache has 10)"))


@pytest.mark.exercise("inference.schedule")
def test_continuous_batching_lets_requests_join_each_step_and_takes_fewer_steps():
    model, prompts = _model(), _prompts()
    params = [SamplingParams(top_k=1, num_tokens_to_generate=n) for _, n in LENGTHS]
    steps, joined_late = {}, {}
    for mode in ("continuous", "static"):
        engine = InferenceEngine(model, PagedKVCache(model.config, 40, 4), max_batch_size=2, max_tokens=64, mode=mode,
                                 admission="final_length")  # schedule(): the exercise's rule
        requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        joined_late[mode] = False
        while engine.has_unfinished_requests():
            running, waiting = len(engine.active), len(engine.waiting)
            engine.step()
            joined_late[mode] |= running > 0 and len(engine.waiting) < waiting  # admitted beside running ones
        steps[mode] = engine.steps
        for i, (r, (_, n)) in enumerate(zip(requests, LENGTHS)):
            require(equal((r.status, len(r.generated_tokens)), ("completed", n),
                          f"{mode} batching: request {i}'s (status, number of generated tokens) at the end"))
        require(equal(len(engine.cache.allocator.free_blocks), 40,
                      f"{mode} batching: the free KV blocks after every request finished (all 40 should come back)"))
    # static: batches {10, 4}, {20, 8}, {15} -> 10 + 20 + 15 steps; continuous fills each freed slot at once
    require(equal(steps["static"], 10 + 20 + 15, "the steps static batching takes (batches of 2: the longest of "
                                                 "{10, 4}, {20, 8}, {15} each)"))
    assert steps["continuous"] < steps["static"], (
        f"continuous batching takes {steps['continuous']} steps, not fewer than static batching's {steps['static']}")
    assert joined_late["continuous"], "continuous batching never admitted a request while others were running"
    assert not joined_late["static"], "static batching admitted a request while others were still running"


@pytest.mark.parametrize("prompt,params,message", [
    ([], SamplingParams(), "empty"),
    ([300], SamplingParams(), "vocab_size"),
    ([1] * 60, SamplingParams(num_tokens_to_generate=10), "seq_length"),
    ([1] * 40, SamplingParams(num_tokens_to_generate=4), "max_tokens"),
])
def test_engine_rejects_requests_it_cannot_serve(prompt, params, message):
    model = _model()
    engine = InferenceEngine(model, PagedKVCache(model.config, 40, 4), max_batch_size=2, max_tokens=32)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished_requests() and len(engine.cache.allocator.free_blocks) == 40
    with pytest.raises(ValueError, match="mode"):
        InferenceEngine(model, engine.cache, mode="dynamic")


def test_engine_refuses_a_request_that_can_never_fit_its_kv_cache():
    model = _model()
    for admission in ("growing", "final_length"):  # 6 blocks of 4 = 24 tokens; 10 + 20 = 30 needs 8 blocks
        engine = InferenceEngine(model, PagedKVCache(model.config, 6, 4), admission=admission)
        with pytest.raises(ValueError, match="can never fit in the KV cache .*6 blocks of 4 tokens"):
            engine.add_request([1] * 10, SamplingParams(num_tokens_to_generate=20))
        assert not engine.has_unfinished_requests() and engine.cache.allocator.get_referenced_count() == 0
    with pytest.raises(ValueError, match="admission='growing'"):
        InferenceEngine(model, PagedKVCache(model.config, 6, 4), admission="final_length", enable_chunked_prefill=True)


# ------------------------------------------------------------------ growing, pausing, chunked prefill, prefix caching
SHARED = [3, 9, 1, 6, 14, 2]  # each prompt: a shared 12-token prefix (3 blocks of 4) + this many tokens
GENERATE = [16, 9, 20, 12, 6, 18]


@functools.cache
def _tiny_gpt():
    """The course's tiny GPT (the shipped checkpoint, trained on the corpus) and its tokenizer."""
    from megalab.extras.tiny_gpt import load_tiny_gpt
    from megalab.training.tokenizer.tokenizer import Tokenizer

    return load_tiny_gpt(), Tokenizer.from_file()


def _shared_prefix_requests():
    """Prompts of Shakespeare that share their first line's 12 tokens; greedy and seeded-sampling requests alternate."""
    _, tokenizer = _tiny_gpt()
    system = tokenizer.tokenize("HAMLET. To be, or not to be, that is the question:\n")[:12]
    rest = tokenizer.tokenize("Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous "
                              "fortune, ROMEO. But soft, what light through yonder window breaks? It is the east.")
    prompts = [system + rest[5 * i:5 * i + n] for i, n in enumerate(SHARED)]
    params = [SamplingParams(top_k=1, num_tokens_to_generate=m) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_k=20, seed=i, num_tokens_to_generate=m)
              for i, m in enumerate(GENERATE)]
    return prompts, params


@functools.cache
def _shared_prefix_expected() -> list[list[int]]:
    """The reference tokens of _shared_prefix_requests: recompute (no cache, no engine), each request alone."""
    (model, _), (prompts, params) = _tiny_gpt(), _shared_prefix_requests()
    return [generate_by_recompute(model, p, sp) for p, sp in zip(prompts, params)]


def _tokens_equal(engine_requests, expected, what):
    for i, (r, e) in enumerate(zip(engine_requests, expected)):
        first = next((j for j, (a, b) in enumerate(zip(r.generated_tokens, e)) if a != b), None)
        assert r.generated_tokens == e, (f"{what}: request {i}'s tokens differ from the engine without pausing, "
                                         f"chunks or a prefix cache (recompute) from token {first} on")


def test_growing_engine_pauses_resumes_and_evicts_with_the_same_tokens():
    """The tiny GPT, 14 blocks for 6 requests that need up to 11 each: they start on their prompt's blocks, grow one block at a
    time, pause when none is left, resume as others finish, and beyond paused_limit get evicted and recomputed."""
    (model, _), (prompts, params), expected = _tiny_gpt(), _shared_prefix_requests(), _shared_prefix_expected()
    engine = InferenceEngine(model, PagedKVCache(model.config, 14, 4, paused_limit=4), max_batch_size=6, max_tokens=64)
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished_requests():
        before = list(engine.paused)
        engine.step()
        left = [r for r in before if r not in engine.paused]  # resumed or evicted in this step
        assert left == before[len(before) - len(left):], (
            f"paused requests {[r.request_id for r in before]}: {[r.request_id for r in left]} left the paused list; "
            "Megatron resumes (and evicts) from the right, the most recently paused first")
    _tokens_equal(requests, expected, "growing engine, 14 blocks")
    counts = dict(paused=engine.pause_count, resumed=engine.resume_count, evicted=engine.evicted_request_count)
    assert all(counts.values()), f"the small cache should make requests pause, resume and be evicted: {counts}"
    assert engine.cache.allocator.get_referenced_count() == 0 and len(engine.cache.allocator.free_blocks) == 14
    old = InferenceEngine(model, PagedKVCache(model.config, 14, 4), max_batch_size=6, max_tokens=64,
                          admission="final_length")
    _tokens_equal(old.generate(prompts, params), expected, "final-length admission, 14 blocks")
    assert old.steps > engine.steps, (f"admitting by final length should run fewer requests at once and take more "
                                      f"steps: {old.steps} vs {engine.steps} growing")


def _allocator_story(policy):
    """Request A takes blocks [0, 1, 2] (0 and 1 full prompt blocks, registered), B shares 0 and 1 and takes 3;
    A finishes, then B. The allocator's (free blocks, ref counts, hash map) after each release."""
    a = KVBlockAllocator(6, enable_prefix_caching=True, prefix_caching_eviction_policy=policy)
    mine = a.allocate_memory_blocks(3)
    a.register_kv_block_hashes(mine[:2], [11, 22])
    a.retain_memory_blocks(mine[:2])
    theirs = a.allocate_memory_blocks(1)

    def state():
        return sorted(a.free_blocks), list(a.block_ref_counts), dict(sorted(a.kv_hash_to_block_id.items()))

    a.release_memory_blocks(mine)
    after_a = state()
    try:
        a.release_memory_blocks(mine[:2] + theirs)
    except RuntimeError as exc:  # checked after A's release: that is where a wrong count shows first
        return a, after_a, (f"RuntimeError: {exc}", None, None)
    return a, after_a, state()


def test_paused_requests_resume_newest_first_and_the_overflow_is_evicted_from_the_right():
    """Megatron's order, step by step: 8 blocks of 4, three requests of 8 prompt tokens (2 blocks each)."""
    model = _model()
    engine = InferenceEngine(model, PagedKVCache(model.config, 8, 4, paused_limit=7), max_batch_size=4, max_tokens=64)
    r0, r1, r2 = (engine.add_request([i + 1] * 8, SamplingParams(top_k=1, num_tokens_to_generate=12)) for i in range(3))
    engine.step()  # the three prefills: 6 blocks held, 2 free
    assert engine.cache.allocator.get_referenced_count() == 6 and not engine.paused
    engine.step()  # all three need a 3rd block, two are free: the right end of the paused list resumes first
    require(equal([r.request_id for r in engine.paused], [r0.request_id],
                  "the paused requests after three needed a block and two were free (Megatron resumes from the right "
                  "of its paused list: the last to need one gets one first)"))
    assert [r.request_id for r in engine.active] == [r2.request_id, r1.request_id]  # in the order they resumed
    for _ in range(4):  # r2 and r1 fill their 3rd block and need a 4th: none is free
        engine.step()
    # they join the paused list's right end in batch order: [r0 (2 blocks), r2 (3), r1 (3)] hold 8 > paused_limit 7,
    # so r1, the right end, is evicted (its 3 blocks released); then r2 and r0 resume, the right end first
    require(equal(([r.request_id for r in engine.paused], [r.request_id for r in engine.waiting], r1.kv_length),
                  ([], [r1.request_id], 0), "(paused, waiting, r1's cached tokens) once the paused requests "
                  "outgrew paused_limit=7 (the right-most overflow is evicted, queued first, recomputed later)"))
    assert engine.evicted_request_count == 1 and r0.status == r2.status == "active"
    while engine.has_unfinished_requests():
        engine.step()
    expected = [generate_by_recompute(model, r.prompt_tokens, r.sampling_params) for r in (r0, r1, r2)]
    require(equal([r.generated_tokens for r in (r0, r1, r2)], expected, "the tokens after pausing and eviction"))


@pytest.mark.exercise("inference.release_blocks")
def test_release_drops_one_reference_and_keeps_cached_prefixes_and_names_the_mistake():
    for policy in ("lru", "ref_zero"):
        allocator, (free_a, refs_a, hashes_a), (free_b, refs_b, hashes_b) = _allocator_story(policy)
        story = (f"{policy}: A holds blocks [0, 1, 2] (0, 1 registered prompt blocks), B shares 0, 1 and holds 3; "
                 f"release_memory_blocks(A's [0, 1, 2])")
        if {0, 1} & set(free_a):
            require(mistake("returned a block to the free list while another request still holds it (drop ONE "
                            "reference; a block leaves only at ref count 0)", f"{story}: free list {free_a}"))
        if refs_a[:2] == [0, 0] and not {0, 1} & set(free_a):
            require(mistake("dropped every reference of a shared block at once (its count set to 0; drop ONE per "
                            "release)", f"{story}: ref counts {refs_a}, B still holds blocks 0 and 1"))
        if 2 not in free_a:
            require(mistake("kept a block without a hash cached at ref count 0: it never returns to the free list "
                            "(a leak)", f"{story}: block 2 (unregistered, nobody holds it) is not free: {free_a}"))
        require(equal((free_a, refs_a, hashes_a), ([2, 4, 5], [1, 1, 0, 1, 0, 0], {11: 0, 22: 1}),
                      f"{story}: (free blocks, ref counts, hash -> block)"))
        story += ", then B's [0, 1, 3]"
        if policy == "lru" and ({0, 1} & set(free_b) or hashes_b != {11: 0, 22: 1}):
            require(mistake("freed a registered block at ref count 0 under LRU: its cached prefix is lost (keep it "
                            "cached, evictable)", f"{story}: free list {free_b}, hash map {hashes_b}"))
        if policy == "ref_zero" and hashes_b:
            require(mistake("kept a block's hash at ref count 0 under ref_zero (forget it, then free the block)",
                            f"{story}: hash map {hashes_b}"))
        expected = ([2, 3, 4, 5], {11: 0, 22: 1}) if policy == "lru" else ([0, 1, 2, 3, 4, 5], {})
        require(equal((free_b, refs_b, hashes_b), (expected[0], [0] * 6, expected[1]),
                      f"{story}: (free blocks, ref counts, hash -> block)"))
        try:
            allocator.release_memory_blocks([3])
        except (RuntimeError, ValueError, AssertionError):  # refused, however (the text names no exception type)
            continue
        require(mistake("released a block nobody holds without complaint (a double free: refuse a ref count of 0)",
                        f"{policy}: release_memory_blocks([3]) after its only holder released it"))


@pytest.mark.exercise("inference.release_blocks")
@pytest.mark.parametrize("policy", ["lru", "ref_zero"])
def test_chunked_prefill_and_prefix_caching_give_the_same_tokens(policy):
    """max_tokens=10 < the prompts (13..26 tokens): chunked prefill; the shared 12-token prefix: cache hits; 16 blocks:
    under LRU the cached blocks get evicted for room. A second round of the same prompts hits the cache under LRU
    (the blocks outlived their requests), not under ref_zero (forgotten at ref count 0)."""
    (model, _), (prompts, params), expected = _tiny_gpt(), _shared_prefix_requests(), _shared_prefix_expected()
    cache = PagedKVCache(model.config, 16, 4, enable_prefix_caching=True, prefix_caching_eviction_policy=policy)
    engine = InferenceEngine(model, cache, max_batch_size=4, max_tokens=10, enable_chunked_prefill=True)
    _tokens_equal(engine.generate(prompts, params), expected, f"chunked prefill + prefix caching ({policy})")
    assert engine.chunked_prefill_chunks > 0 and engine.prefix_cache_hit_tokens > 0, (
        engine.chunked_prefill_chunks, engine.prefix_cache_hit_tokens)
    allocator, hits = cache.allocator, engine.prefix_cache_hit_tokens
    assert allocator.get_referenced_count() == 0, "blocks still held after every request finished"
    require(equal(len(allocator.free_blocks) + allocator.get_evictable_block_count(), 16,
                  f"{policy}: free + cached blocks after every request finished (all 16: none leaked)"))
    _tokens_equal(engine.generate(prompts[:1], params[:1]), expected[:1], f"the first prompt again ({policy})")
    again = engine.prefix_cache_hit_tokens - hits
    if policy == "lru":
        assert allocator.evicted_block_count > 0, "16 blocks should force LRU evictions of cached blocks"
        assert again > 0, "the same prompt again should reuse its cached blocks (LRU keeps them after release)"
    else:
        require(equal((again, allocator.get_evictable_block_count()), (0, 0),
                      "ref_zero: (prefix tokens reused by the same prompt again, cached blocks) (nothing outlives "
                      "its last holder)"))


def test_update_weights_replaces_in_place_and_refuses_mismatches():
    (model, _), (prompts, params) = _tiny_gpt(), _shared_prefix_requests()
    model = GPTModel(model.config).eval()  # a copy to refit: the shared tiny GPT stays as shipped
    model.load_state_dict(_tiny_gpt()[0].state_dict())
    cache = PagedKVCache(model.config, 40, 4, enable_prefix_caching=True)
    engine = InferenceEngine(model, cache, max_tokens=64)
    engine.generate(prompts[:2], params[:2])
    assert cache.allocator.get_evictable_block_count() > 0  # cached prefix blocks of the old weights
    torch.manual_seed(1)
    other = GPTModel(model.config).state_dict()
    weight = model.embedding.word_embeddings.weight
    engine.update_weights(other)
    assert weight is model.embedding.word_embeddings.weight and torch.equal(weight, other["embedding.word_embeddings.weight"])
    assert cache.allocator.get_evictable_block_count() == 0, "stale prefix blocks (old weights' K/V) must be forgotten"
    fresh = generate_by_recompute(model, prompts[0], params[0])
    assert engine.generate(prompts[:1], params[:1])[0].generated_tokens == fresh != _shared_prefix_expected()[0]
    bad = dict(other, **{"embedding.word_embeddings.weight": torch.zeros(8320, 64)})  # a padded vocabulary
    with pytest.raises(ValueError, match=r"shape mismatch.*word_embeddings.*\(8320, 64\).*\(8192, 64\)"):
        engine.update_weights(bad)
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights({k: v for k, v in other.items() if "layers.1." not in k})
    assert torch.equal(weight, other["embedding.word_embeddings.weight"])  # a refused update changed nothing
    engine.add_request(prompts[0], params[0])
    with pytest.raises(RuntimeError, match="in flight"):
        engine.update_weights(other)


# ------------------------------------------------------------------ tensor-parallel inference
def _tp_generate(variants, prompts, lengths):
    from megalab.core import parallel_state as ps
    from megalab.core.models.gpt.gpt_layer_specs import tensor_parallel_layer_spec
    from megalab.core.models.gpt.gpt_model import GPTModel
    from megalab.lab import dist as mdist

    _, world = mdist.init()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    out = {}
    for variant in variants:
        config = TransformerConfig(**BASE, **VARIANTS[variant])
        torch.manual_seed(0)  # the same draws as the single-process model, then split across the ranks
        model = GPTModel(config, tensor_parallel_layer_spec())
        engine = InferenceEngine(model, PagedKVCache(config, 40, 4, tp_size=world), max_batch_size=3, max_tokens=24)
        params = [SamplingParams(top_k=1, num_tokens_to_generate=n) for n in lengths]
        out[variant] = [r.generated_tokens for r in engine.generate(prompts, params)]
    ps.destroy_model_parallel()
    torch.distributed.barrier()
    return out


def test_tensor_parallel_inference_on_two_ranks_equals_single_process():
    prompts, lengths = _prompts(), [n for _, n in LENGTHS]
    result = launch.run_function(_tp_generate, 2, list(VARIANTS), prompts, lengths, launch=dict(timeout=300))
    for variant in VARIANTS:
        model = _model(variant)
        engine = InferenceEngine(model, PagedKVCache(model.config, 40, 4), max_batch_size=3, max_tokens=24)
        expected = [r.generated_tokens for r in engine.generate(
            prompts, [SamplingParams(top_k=1, num_tokens_to_generate=n) for n in lengths])]
        for rank in (0, 1):
            assert result.returns[rank][variant] == expected, f"{variant} rank {rank}"


# ------------------------------------------------------------------ the shipped tiny checkpoint
def test_shipped_tiny_checkpoint_is_trained_on_the_corpus():
    from megalab.extras.tiny_gpt import CHECKPOINT, load_tiny_gpt
    from megalab.training.tokenizer.tokenizer import Tokenizer

    assert CHECKPOINT.stat().st_size < 2.5e6
    model, tokenizer = load_tiny_gpt(), Tokenizer.from_file()
    text = "HAMLET. To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"
    ids = torch.tensor([tokenizer.tokenize(text)])
    with torch.no_grad():
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean().item()
    assert loss < 0.75 * torch.log(torch.tensor(8192.0)).item()  # far below guessing uniformly (9.0 nats)


@pytest.mark.parametrize("cache_kind", ["paged", "contiguous"])
def test_the_engine_keeps_its_cache_where_the_model_runs(cache_kind):
    """A cache built with the default (CPU) device for a model on another device (a GPU; here `meta`) moves there."""
    model = _model().to("meta")
    cache = PagedKVCache(model.config, 8, 4) if cache_kind == "paged" else ContiguousKVCache(model.config, 2)
    InferenceEngine(model, cache)
    assert cache.key.device.type == cache.value.device.type == "meta"


# ------------------------------------------------------------------ on a GPU (make gpu-test runs these)
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_on_one_gpu(variant):
    """The inference path on CUDA (model, paged cache, continuous batching): the same greedy tokens as recomputing
    the whole sequence each step on the GPU, and as the CPU where the top two logits are far apart."""
    model, prompts = _model(variant), _prompts()
    params = [SamplingParams(top_k=1, num_tokens_to_generate=n) for _, n in LENGTHS]
    gpu = model.cuda()
    expected = [generate_by_recompute(gpu, p, sp) for p, sp in zip(prompts, params)]
    cache = PagedKVCache(gpu.config, num_blocks=40, block_size=4, device="cuda")
    got = [r.generated_tokens for r in InferenceEngine(gpu, cache, max_batch_size=3, max_tokens=24).generate(prompts, params)]
    assert got == expected
    logits = gpu(torch.tensor([prompts[0]], device="cuda"))[0, -1].float().cpu()
    top2 = logits.topk(2).values
    if top2[0] - top2[1] > 1e-3:  # no near-tie: the CPU picks the same first token
        assert generate_by_recompute(model.cpu(), prompts[0], params[0])[0] == got[0][0]
