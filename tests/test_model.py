"""The model package against an independent plain-PyTorch GPT, recomputation, and calc's counts."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.tensor_parallel.random import checkpoint
from megalab.core.transformer.dot_product_attention import CoreAttention
from megalab.core.transformer.mlp import MLP
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.torch_norm import RMSNorm
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.transformer.transformer_layer import TransformerLayer
from megalab.extras import calc
from megalab.extras.profiling import SavedTensorsMeter
from megalab.lab.checks import mistake
from tests.feedback import close, equal, require

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=61, seq_length=12,
            hidden_dropout=0.0, attention_dropout=0.0)
VARIANTS = {
    "gpt": dict(),
    "gpt-untied-unfused": dict(share_embeddings_and_output_weights=False, attention_backend="unfused"),
    "llama": dict(normalization="RMSNorm", activation_func="silu", gated_linear_unit=True, add_bias_linear=False,
                  position_embedding_type="rope", num_query_groups=2, share_embeddings_and_output_weights=False),
    "llama-mqa-unfused": dict(normalization="RMSNorm", activation_func="silu", gated_linear_unit=True,
                              position_embedding_type="rope", rotary_percent=0.5, num_query_groups=1,
                              attention_backend="unfused", add_bias_linear=False, add_qkv_bias=True),
    "relu-nopos": dict(activation_func="squared_relu", position_embedding_type="none", ffn_hidden_size=48),
}


# ------------------------------------------------------------------ the independent reference
def ref_norm(x, sd, prefix, c):
    if c.normalization == "LayerNorm":
        return F.layer_norm(x, (c.hidden_size,), sd[prefix + ".weight"], sd[prefix + ".bias"], c.layernorm_epsilon)
    return F.rms_norm(x, (c.hidden_size,), sd[prefix + ".weight"], c.layernorm_epsilon)


def ref_rope(x, c):
    """x [b, s, heads, hn]: rotate channel pairs (i, i + d/2) by pos * base^(-2i/d), as complex numbers."""
    d = int(c.kv_channels * c.rotary_percent)
    pos = torch.arange(x.shape[1], dtype=torch.float64)
    angle = pos[:, None] * c.rotary_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [s, d/2]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2: d].double()) * torch.polar(
        torch.ones_like(angle), angle)[None, :, None, :]
    return torch.cat([z.real.float(), z.imag.float(), x[..., d:]], dim=-1)


def ref_attention(q, k, v, *, causal=True, scale=True, softmax_dim=-1, diagonal=0):
    """q [b, s, np, hn], k/v [b, s, np, hn] -> [b, s, np*hn], causal. The keywords build typical wrong answers:
    no causal mask, no 1/sqrt(hn), the softmax over another dim, the mask's diagonal (-1: a token can't see itself)."""
    b, s, n, hn = q.shape
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (math.sqrt(hn) if scale is True else scale or 1.0)
    if causal:
        scores = scores.masked_fill(~torch.tril(torch.ones(s, s, dtype=torch.bool), diagonal), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(softmax_dim), v).reshape(b, s, n * hn)


ATTENTION_MISTAKES = {  # name -> the keywords of ref_attention that give what the mistake gives
    "forgot the causal mask (a query must not see later keys)": dict(causal=False),
    "softmax over the wrong dim (it normalises over the keys, the last dim)": dict(softmax_dim=-2),
    "forgot the 1/sqrt(hn) scale of the scores": dict(scale=False),
    "scaled the scores by 1/hn, not 1/sqrt(hn)": dict(scale=8),  # hn = 8 in the test
    "the mask hides the diagonal too (triu(1), not triu(0): a token sees itself)": dict(diagonal=-1),
}


def ref_mlp(x, sd, prefix, c, mistake=None):
    """fc2(act(fc1(x))), gated: fc2(act(gate) * up); `mistake` gives a typical wrong answer instead:
    "swapped" (act(up) * gate), "after" (the activation after fc2), "both" (the activation on both halves),
    "none" (no activation at all)."""
    act = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "squared_relu": lambda t: F.relu(t) ** 2}[c.activation_func]
    y = F.linear(x, sd[prefix + ".linear_fc1.weight"], sd.get(prefix + ".linear_fc1.bias"))
    first, second = (y[..., : c.ffn_hidden_size], y[..., c.ffn_hidden_size:]) if c.gated_linear_unit else (y, None)
    if mistake == "swapped":
        first, second = second, first
    if mistake == "both":
        first, second = act(first), act(second)
    elif mistake not in ("after", "none"):
        first = act(first)
    y = first if second is None else first * second
    y = F.linear(y, sd[prefix + ".linear_fc2.weight"], sd.get(prefix + ".linear_fc2.bias"))
    return act(y) if mistake == "after" else y


MLP_MISTAKES = {
    "gated: the halves swapped (fc1's output is [gate; up]: act(gate) * up)": "swapped",
    "the activation after linear_fc2 (it goes between the two linears)": "after",
    "gated: the activation on both halves (only the gate goes through it)": "both",
    "no activation between the two linears (fc2(fc1(x)) is one linear map)": "none",
}


def ref_layer(x, sd, p, c, mistake=None):
    """The pre-norm layer; `mistake` gives a typical wrong answer: "normed_residual" (adds the norm's output
    back), "input_residual" (the MLP's residual is the layer's input), "twice" (the MLP's residual added twice),
    "same_norm" (the MLP reads input_layernorm)."""
    b, s, _ = x.shape
    n, ng, hn = c.num_attention_heads, c.num_query_groups, c.kv_channels
    g = n // ng
    h = ref_norm(x, sd, p + "input_layernorm", c)
    qkv = F.linear(h, sd[p + "self_attention.linear_qkv.weight"], sd.get(p + "self_attention.linear_qkv.bias"))
    qkv = qkv.view(b, s, ng, g + 2, hn)  # Megatron's layout: per group, its g query heads then k then v
    q, k, v = qkv[:, :, :, :g].reshape(b, s, n, hn), qkv[:, :, :, g], qkv[:, :, :, g + 1]
    if c.position_embedding_type == "rope":
        q, k = ref_rope(q, c), ref_rope(k, c)
    k, v = k[:, :, torch.arange(n) // g], v[:, :, torch.arange(n) // g]
    a = F.linear(ref_attention(q, k, v), sd[p + "self_attention.linear_proj.weight"],
                 sd.get(p + "self_attention.linear_proj.bias"))
    layer_input = x
    x = (h if mistake in ("normed_residual", "normed_attention_residual") else x) + a
    h = ref_norm(x, sd, p + ("input_layernorm" if mistake == "same_norm" else "pre_mlp_layernorm"), c)
    residual = {"normed_residual": h, "input_residual": layer_input, "twice": 2 * x}.get(mistake, x)
    return residual + ref_mlp(h, sd, p + "mlp", c)


LAYER_MISTAKES = {
    "added the normalised input as the residual (add the block's output to the un-normalised stream)":
        "normed_residual",
    "the MLP's residual is the layer's input (it is the stream after the attention block)": "input_residual",
    "added the residual twice": "twice",
    "the attention block's residual is the normalised input (add its output to the un-normalised stream)":
        "normed_attention_residual",
    "the MLP reads input_layernorm's output (its own norm is pre_mlp_layernorm)": "same_norm",
}


def ref_gpt(sd, c, ids, tied=None):
    """Logits [b, s, V]; `tied` overrides c.share_embeddings_and_output_weights (a typical wrong answer)."""
    tied = c.share_embeddings_and_output_weights if tied is None else tied
    x = sd["embedding.word_embeddings.weight"][ids]  # [b, s, h]
    if c.position_embedding_type == "learned_absolute":
        x = x + sd["embedding.position_embeddings.weight"][: ids.shape[1]]
    for i in range(c.num_layers):
        x = ref_layer(x, sd, f"decoder.layers.{i}.", c)
    x = ref_norm(x, sd, "decoder.final_layernorm", c)
    out = sd["embedding.word_embeddings.weight"] if tied else sd["output_layer.weight"]
    return x @ out.T


def randomize(module):
    """Non-trivial norms and biases too (they start at 1 and 0), so the comparison sees them."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return module


# ------------------------------------------------------------------ exercises, piece by piece
@pytest.mark.exercise("model.core_attention")
@pytest.mark.parametrize("groups", [4, 2, 1])
def test_core_attention_unfused_matches_sdpa_and_reference(groups):
    torch.manual_seed(0)
    c = TransformerConfig(**TINY, num_query_groups=groups)
    s, b, n, hn = 7, 3, 4, 8
    q = torch.randn(s, b, n, hn)
    k, v = torch.randn(s, b, groups, hn), torch.randn(s, b, groups, hn)
    unfused = CoreAttention(TransformerConfig(**{**TINY, "attention_backend": "unfused"})).eval()(q, k, v)
    sdpa = CoreAttention(c).eval()(q, k, v)
    idx = torch.arange(n) // (n // groups)
    qkv = q.transpose(0, 1), k[:, :, idx].transpose(0, 1), v[:, :, idx].transpose(0, 1)
    ref = ref_attention(*qkv).transpose(0, 1)
    where = f"{n} query heads, {groups} key/value group{'s' * (groups > 1)}"
    require(equal(tuple(unfused.shape), (s, b, n * hn), f"the shape of the unfused CoreAttention's output ({where}; "
                                                         "[s, b, np * hn])"))
    require(close(unfused, ref, f"the unfused CoreAttention's output ({where}) vs causal softmax(q k^T / sqrt(hn)) v",
                  atol=1e-5, rtol=1e-5, mistakes={name: lambda kw=kw: ref_attention(*qkv, **kw).transpose(0, 1)
                                                  for name, kw in ATTENTION_MISTAKES.items()}))
    require(close(sdpa, ref, f"the sdpa CoreAttention's output ({where}) vs causal softmax(q k^T / sqrt(hn)) v",
                  atol=1e-5, rtol=1e-5))


@pytest.mark.exercise("model.norm")
def test_rmsnorm_names_typical_mistakes():
    """Tokens of very different sizes (one tiny, where eps matters) and a large eps, so that each typical
    mistake gives a visibly different answer."""
    torch.manual_seed(0)
    eps = 1e-2
    norm = randomize(RMSNorm(16, eps=eps))
    x = torch.randn(4, 3, 16) * torch.tensor([1.0, 0.05, 3.0])[None, :, None] + 0.5  # [s, b, h]
    w = norm.weight.detach()
    with torch.no_grad():
        out = norm(x)

    def rms(t, dim=-1, eps=eps):
        return t * torch.rsqrt(t.pow(2).mean(dim=dim, keepdim=True) + eps) * w

    centred = x - x.mean(-1, keepdim=True)
    require(close(out, F.rms_norm(x, (16,), w, eps), f"RMSNorm(16, eps={eps})'s output vs F.rms_norm "
                  "(tokens of size 0.05 to 3)", atol=1e-6, rtol=1e-5, mistakes={
                      "forgot eps (inside the square root: rsqrt(mean(x^2) + eps))": lambda: rms(x, eps=0.0),
                      "the mean of the squares over the wrong dim (the hidden one is the last)": lambda: rms(x, dim=0),
                      "subtracted the mean: that is LayerNorm; RMSNorm does not centre": lambda: rms(centred),
                      "eps outside the square root (x / (sqrt(mean(x^2)) + eps)): it goes inside, "
                      "rsqrt(mean(x^2) + eps)": lambda: x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * w,
                      "eps added after the root (rsqrt(mean(x^2)) + eps): it goes inside, rsqrt(mean(x^2) + eps)":
                          lambda: x * (x.pow(2).mean(-1, keepdim=True).rsqrt() + eps) * w,
                      "one RMS for the whole tensor (the mean of the squares is per token, over the last dim only)":
                          lambda: x * torch.rsqrt(x.pow(2).mean() + eps) * w,
                  }))


@pytest.mark.exercise("model.norm")
def test_rmsnorm_statistics_in_float32():
    """The task says "statistics in float32": in fp16, x^2 overflows to inf once |x| > 256, so a norm that squares
    in the input's dtype returns rows of zeros for activations of a few hundred (common in a trained model's
    residual stream)."""
    torch.manual_seed(0)
    norm = randomize(RMSNorm(16, eps=1e-5)).half()
    x = (torch.randn(3, 2, 16) * 300).half()  # [s, b, h], |x| ~ 300: x^2 ~ 9e4 > 65504, fp16's largest
    with torch.no_grad():
        out = norm(x)
    ref = F.rms_norm(x.float(), (16,), norm.weight.detach().float(), 1e-5).half()
    require(equal(out.dtype, torch.float16, "the dtype of RMSNorm's output for an fp16 input"))
    zero_rows = int((out.float().abs().amax(-1) == 0).sum())
    verdict = close(out.float(), ref.float(), "RMSNorm's output for fp16 activations of size ~300 vs F.rms_norm in "
                    "float32", atol=1e-2, rtol=1e-2)
    if not verdict and zero_rows:  # the evidence: whole rows of zeros, where x^2 overflowed to inf
        verdict = mistake(f"statistics in the input's dtype: {zero_rows} of {out[..., 0].numel()} rows came out all "
                          "zeros because x^2 overflowed to inf in fp16 — upcast to float32 (x.float()) for the mean of "
                          "the squares, cast back at the end", verdict.reason)
    require(verdict)


@pytest.mark.exercise("model.norm")
def test_rmsnorm_matches_torch():
    torch.manual_seed(0)
    norm = randomize(RMSNorm(16, eps=1e-6))
    x = torch.randn(5, 3, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, ref = norm(x), F.rms_norm(x_ref, (16,), norm.weight.detach(), 1e-6)
    require(close(out, ref, "RMSNorm's output vs F.rms_norm", atol=1e-6, rtol=1e-5))
    out.square().sum().backward()
    ref.square().sum().backward()
    require(close(x.grad, x_ref.grad, "the input gradient through RMSNorm vs through F.rms_norm", atol=1e-5, rtol=1e-5))
    dtype = norm.to(torch.bfloat16)(x.to(torch.bfloat16)).dtype
    require(equal(dtype, torch.bfloat16, "the dtype of RMSNorm's output for a bf16 input and weight (compute the "
                                         "statistics in float32, return the input's dtype)"))


@pytest.mark.exercise("model.mlp")
@pytest.mark.parametrize("variant", ["gpt", "llama", "relu-nopos"])
def test_mlp_matches_reference(variant):
    c = TransformerConfig(**TINY, **VARIANTS[variant])
    mlp = randomize(MLP(c, LayerSpec()))
    x = torch.randn(5, 2, c.hidden_size)
    sd = {"m." + k: v for k, v in mlp.state_dict().items()}
    kind = f"{c.activation_func}{', gated' if c.gated_linear_unit else ''}"
    with torch.no_grad():
        out = mlp(x)
    mistakes = {name: ref_mlp(x, sd, "m", c, mistake=m) for name, m in MLP_MISTAKES.items()
                if c.gated_linear_unit or m in ("after", "none")}
    require(close(out, ref_mlp(x, sd, "m", c), f"the MLP's output ({variant}: {kind}) vs fc2(act(fc1(x)))",
                  atol=1e-5, rtol=1e-5, mistakes=mistakes))


@pytest.mark.exercise("model.layer_forward")
@pytest.mark.parametrize("variant", ["gpt", "gpt-untied-unfused", "llama"])
def test_transformer_layer_matches_reference(variant):
    c = TransformerConfig(**TINY, **VARIANTS[variant])
    torch.manual_seed(0)
    layer = randomize(TransformerLayer(c)).eval()
    x = torch.randn(c.seq_length, 2, c.hidden_size)
    rotary = None
    if c.position_embedding_type == "rope":
        from megalab.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        rotary = RotaryEmbedding(c.kv_channels, c.rotary_percent, c.rotary_base)(c.seq_length)
    sd = {"l." + k: v for k, v in layer.state_dict().items()}
    ref = ref_layer(x.transpose(0, 1), sd, "l.", c).transpose(0, 1)
    with torch.no_grad():
        out = layer(x, rotary)
        mistakes = {name: ref_layer(x.transpose(0, 1), sd, "l.", c, mistake=m).transpose(0, 1)
                    for name, m in LAYER_MISTAKES.items()}
    require(close(out, ref, f"the TransformerLayer's output ({variant}) vs x + attn(norm(x)), then "
                            "+ mlp(norm(.)) (plain PyTorch)", atol=1e-5, rtol=1e-5, mistakes=mistakes))
    if variant == "gpt":  # eval mode: hidden_dropout must not drop anything
        layer.hidden_dropout = 0.5
        with torch.no_grad():
            again = layer(x, rotary)
        verdict = close(again, ref, "the TransformerLayer's output in eval mode with hidden_dropout=0.5 vs the same "
                        "layer without dropout", atol=1e-5, rtol=1e-5)
        if not verdict:
            zeros = int(((again - out).abs() > 1e-6).sum())
            verdict = mistake("dropout applied in eval mode: pass training=self.training to F.dropout", f"{zeros} of "
                              f"{out.numel()} elements changed once hidden_dropout became 0.5 — {verdict.reason}")
        require(verdict)


@pytest.mark.exercise("model.gpt_forward")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpt_logits_match_plain_pytorch_reference(variant):
    c = TransformerConfig(**TINY, **VARIANTS[variant])
    torch.manual_seed(0)
    model = randomize(GPTModel(c)).eval()
    ids = torch.randint(0, c.vocab_size, (3, c.seq_length))
    logits = model(ids)
    shape = (3, c.seq_length, c.vocab_size)
    if tuple(logits.shape) == (c.seq_length, 3, c.vocab_size):
        require(mistake("returned the logits as [s, b, V]: transpose them to [b, s, V]",
                        f"GPTModel's logits ({variant}) have shape {tuple(logits.shape)}, expected {shape}"))
    require(equal(tuple(logits.shape), shape, f"the shape of GPTModel's logits ({variant}; [b, s, vocab_size])"))
    sd = model.state_dict()
    with torch.no_grad():
        ref = ref_gpt(sd, c, ids)
    mistakes = {}
    if c.position_embedding_type == "rope":
        mistakes["never passed the rotary angles (rotary_pos_emb) to the decoder"] = \
            lambda: ref_gpt(sd, TransformerConfig(**{**c.__dict__, "position_embedding_type": "none"}), ids)
    if not c.share_embeddings_and_output_weights:
        mistakes["used the word embeddings as the output layer in an untied model (use self.output)"] = \
            lambda: ref_gpt(sd, c, ids, tied=True)
    require(close(logits, ref, f"GPTModel's logits ({variant}) vs the plain-PyTorch GPT's", atol=1e-5, rtol=1e-5,
                  mistakes=mistakes))
    loss = model(ids, labels=ids)
    if tuple(loss.shape) == shape:
        require(mistake("returned the logits even with labels: with labels, return the per-token loss [b, s]",
                        f"GPTModel(ids, labels=ids) ({variant}) has shape {tuple(loss.shape)}, expected "
                        f"{tuple(ids.shape)}"))
    require(close(loss, F.cross_entropy(ref.transpose(1, 2), ids, reduction="none"),
                  f"GPTModel's per-token loss with labels ({variant}) vs F.cross_entropy(reduction='none') of the "
                  "plain-PyTorch logits", atol=1e-5, rtol=1e-5))


@pytest.mark.exercise("model.gpt_forward")
@pytest.mark.parametrize("variant", ["gpt", "llama"])
def test_gpt_chunks_pass_hidden_states_and_only_the_last_one_gives_logits(variant):
    """The forward is also a pipeline chunk's: without pre_process it takes the previous chunk's [s, b, h],
    without post_process it returns its hidden states. Two chunks of one model, one after the other, must
    give the whole model's logits and loss (one process, no pipeline needed to check it)."""
    c = TransformerConfig(**TINY, **VARIANTS[variant])
    torch.manual_seed(0)
    model = randomize(GPTModel(c)).eval()
    first, last = model.chunk(0, 1, pre_process=True, post_process=False), model.chunk(1, 2, False, True)
    ids = torch.randint(0, c.vocab_size, (3, c.seq_length))
    hidden = first(ids)
    try:
        last(hidden)
    except TypeError as e:
        import traceback

        line = traceback.extract_tb(e.__traceback__)[-1].line or ""
        if "embedding" in line:
            require(mistake("a chunk without pre_process called the embedding (it has none): it takes the previous "
                            "chunk's hidden states [s, b, h] in place of input_ids", f"{e}, at `{line.strip()}`"))
        raise
    require(equal(tuple(hidden.shape), (c.seq_length, 3, c.hidden_size),
                  f"the output of a first chunk (pre_process, not post_process; {variant}): its hidden states [s, b, h]"))
    require(close(last(hidden), model(ids), f"chunk 2 of 2 fed chunk 1's output vs the whole model's logits ({variant})",
                  atol=1e-5, rtol=1e-5))
    require(close(last(hidden, labels=ids), model(ids, labels=ids),
                  f"chunk 2 of 2 with labels vs the whole model's per-token loss ({variant})", atol=1e-5, rtol=1e-5))


@pytest.mark.exercise("model.gpt_forward")
def test_gpt_is_causal_and_checks_length():
    c = TransformerConfig(**TINY)
    model = GPTModel(c).eval()
    ids = torch.randint(0, c.vocab_size, (1, c.seq_length))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % c.vocab_size
    require(close(model(changed)[:, :-1], model(ids)[:, :-1], "the logits of positions 0..s-2 after changing only the "
                                                                "last token (a causal model ignores later tokens)"))
    with pytest.raises(ValueError, match="longer than config.seq_length"):
        model(torch.zeros(1, c.seq_length + 1, dtype=torch.long))


def test_parameter_count_matches_narayanan_eq_2():
    c = TransformerConfig(**TINY)
    n = sum(p.numel() for p in GPTModel(c).parameters())
    formula = calc.num_parameters(c.num_layers, c.hidden_size, c.vocab_size, c.seq_length)
    assert n == round(formula) + 2 * c.hidden_size  # + the final LayerNorm, which Eq. 2 leaves out


# ------------------------------------------------------------------ recomputation
DROPOUT = dict(TINY, hidden_dropout=0.1, attention_dropout=0.1, attention_backend="unfused", num_layers=4)
RECOMPUTE = {
    "selective": dict(recompute_granularity="selective"),
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-3": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
}


def _train_step(config, variant=None):
    torch.manual_seed(0)
    model = GPTModel(config).train()
    ids = torch.randint(0, config.vocab_size, (2, config.seq_length))
    torch.manual_seed(123)  # same dropout masks in every run
    with SavedTensorsMeter(exclude=model.parameters()) as meter:
        loss = model(ids, labels=ids).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, meter.bytes


@pytest.mark.exercise("model.recompute")
def test_checkpoint_replays_dropout_and_passes_non_tensors():
    torch.manual_seed(0)
    x = torch.randn(6, 5, requires_grad=True)
    w = torch.randn(5, 5, requires_grad=True)

    def region(t, scale):
        return F.dropout(t @ w, 0.5, training=True) * scale

    torch.manual_seed(7)
    expected = region(x, 3.0)
    expected.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    torch.manual_seed(7)
    out = checkpoint(region, x, 3.0)
    torch.rand(3)  # other random draws between forward and backward (the next micro-batch's dropout, say)
    before_backward = torch.get_rng_state()
    try:
        out.sum().backward()
    except RuntimeError as e:
        if "does not require grad" in str(e) or "grad_fn" in str(e):
            require(mistake("replayed the region without torch.enable_grad (backward runs with grad off, so the "
                            "replay builds no graph)", str(e).splitlines()[0]))
        raise
    require(close(out, expected, "checkpoint(region)'s output vs region's (bit for bit)", rtol=0, atol=0))
    if x.grad is None:
        require(mistake("replayed the region without torch.enable_grad (backward runs with grad off, so no "
                        "gradient reaches the inputs)", "x.grad is None after backward"))
    # what a replay that does not restore the forward's RNG state gives: the mask drawn from the state at backward
    x_again = x.detach().clone().requires_grad_()
    with torch.random.fork_rng():
        torch.set_rng_state(before_backward)
        (new_mask_grad,) = torch.autograd.grad(region(x_again, 3.0).sum(), x_again)
    require(close(x.grad, gx, "the input gradient through checkpoint vs without it (bit for bit: the replayed "
                              "dropout mask must be the forward's)", rtol=0, atol=0, mistakes={
                                  "the replay drew a new dropout mask: restore the forward's RNG state "
                                  "(ctx.cpu_rng_state) before re-running": new_mask_grad}))
    require(close(w.grad, gw, "the gradient of a weight the region uses (not an argument) through checkpoint vs "
                              "without it", rtol=0, atol=0))
    if not torch.equal(torch.get_rng_state(), before_backward):
        require(mistake("restored the RNG state without torch.random.fork_rng: after backward the random draws "
                        "repeat the forward's (fork_rng puts the state back afterwards)",
                        "checkpoint's backward changed the CPU RNG state"))


@pytest.mark.exercise("model.recompute")
@pytest.mark.parametrize("variant", ["gpt", "llama"])
def test_recompute_gives_identical_gradients_and_saves_memory(variant):
    base = {**DROPOUT, **VARIANTS[variant], "hidden_dropout": 0.1, "attention_dropout": 0.1,
            "attention_backend": "unfused"}
    loss, grads, saved = _train_step(TransformerConfig(**base))
    for name, settings in RECOMPUTE.items():
        r_loss, r_grads, r_saved = _train_step(TransformerConfig(**base, **settings))
        where = f"{variant}, recompute {name}"
        require(close(r_loss, loss, f"{where}: the loss vs without recomputation (bit for bit: the same dropout "
                                    "masks)", rtol=0, atol=0))
        for p in grads:
            require(close(r_grads[p], grads[p], f"{where}: the gradient of {p} vs without recomputation (bit for "
                                                "bit: the replay must use the forward's RNG state)", rtol=0, atol=0))
        assert r_saved < saved, (f"{where}: autograd keeps {r_saved} bytes of activations, no fewer than the "
                                 f"{saved} without recomputation (only the checkpoints' inputs should be kept)")


class PaperCoreAttention(torch.nn.Module):
    """The unfused core attention as Korthikanti et al. count it: scores, softmax and dropout all in the
    activation dtype (bf16 here), so autograd keeps q, k, v, the softmax output, its dropout mask and
    the dropped-out probabilities. The saved-bytes test below runs the layer with it (and PaperMLP):
    the learner's own CoreAttention may keep more, e.g. a softmax upcast to fp32, and be correct."""

    def __init__(self, config):
        super().__init__()
        self.attention_dropout = config.attention_dropout

    def forward(self, query, key, value):
        s, b, np_, hn = query.shape
        q, k, v = (t.reshape(s, b * np_, hn).transpose(0, 1) for t in (query, key, value))
        scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(hn))
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = F.dropout(torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1), self.attention_dropout,
                          training=self.training)
        return torch.bmm(probs, v).transpose(0, 1).reshape(s, b, np_ * hn)


class PaperMLP(torch.nn.Module):
    """fc2(gelu(fc1(x))) on the layer's own linear layers, everything in the activation dtype."""

    def __init__(self, mlp):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = mlp.linear_fc1, mlp.linear_fc2

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


@pytest.mark.exercise("model.layer_forward")
def test_saved_bytes_of_one_layer_match_korthikanti_in_bf16():
    # 16-bit activations, 1-byte dropout masks: the paper's assumptions; MHA, unfused attention.
    # The layer's own forward (norms, dropouts, residual adds: the exercise) around the paper's core
    # attention and MLP, so a correct attention or MLP that keeps more (fp32 softmax) does not fail it.
    s, b, h, a = 32, 2, 64, 4
    c = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=a, vocab_size=10, seq_length=s,
                          attention_backend="unfused")
    for recompute, settings in [("none", {}), ("selective", RECOMPUTE["selective"])]:
        layer = TransformerLayer(TransformerConfig(**{**c.__dict__, **settings}),
                                 LayerSpec(core_attention=PaperCoreAttention))
        layer.mlp = PaperMLP(layer.mlp)
        layer = layer.to(torch.bfloat16).train()
        x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
        with SavedTensorsMeter(exclude=layer.parameters()) as meter:
            layer(x)
        formula = calc.activation_memory_per_layer(s, b, h, a, recompute=recompute)
        # The extras: LayerNorm statistics (mean and rstd per token, bf16 here), the s x s causal
        # mask, and the dropout masks' second byte: PyTorch's CPU dropout keeps its mask in the
        # activation dtype (CUDA keeps 1-byte masks, as the paper assumes).
        ln_stats = 2 * 2 * s * b * 2
        cpu_masks = 2 * s * b * h + (a * s * s * b if recompute == "none" else 0)
        extras = ln_stats + (s * s if recompute == "none" else 0) + cpu_masks
        expected = formula + extras
        off = meter.bytes - expected
        assert off == 0, (
            f"one bf16 TransformerLayer in training (s={s}, b={b}, h={h}, a={a}, recompute={recompute}): autograd "
            f"keeps {meter.bytes} bytes of activations, expected {expected:.0f} (Korthikanti's {formula:.0f} + "
            f"{extras} of LayerNorm statistics, causal mask and CPU dropout masks): {abs(off):.0f} bytes "
            f"= {abs(off) / (2 * s * b * h):.3g} x a bf16 [s, b, h] tensor) too {'many' if off > 0 else 'few'}; "
            "expected: a dropout after the attention and after the MLP (each keeps an [s, b, h] mask), nothing kept twice")


# ------------------------------------------------------------------ calc's FLOPs, counted by PyTorch
@pytest.mark.exercise("model.gpt_forward")
@pytest.mark.exercise("model.recompute")
@pytest.mark.parametrize("recompute", [False, True])
def test_flops_per_iteration_equals_pytorch_flop_count(recompute):
    settings = RECOMPUTE["full-uniform-1"] if recompute else {}
    c = TransformerConfig(**{**TINY, "attention_backend": "unfused"}, **settings)
    model = GPTModel(c).train()
    ids = torch.randint(0, c.vocab_size, (2, c.seq_length))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).mean().backward()
    expected = calc.flops_per_iteration(2, c.seq_length, c.num_layers, c.hidden_size, c.vocab_size, recompute)
    counted = counter.get_total_flops()
    what = "with full recomputation (one more forward)" if recompute else "without recomputation"
    assert counted == round(expected), (
        f"one training step of the GPT {what}: PyTorch counts {counted} matmul FLOPs, calc.flops_per_iteration "
        f"expects {round(expected)} ({counted / round(expected):.3g} times as many)")
