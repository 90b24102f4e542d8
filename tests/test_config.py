"""TransformerConfig: derived sizes and the messages for bad values."""

import pytest

from megalab.core.transformer.transformer_config import TransformerConfig

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=16)


def test_derived_sizes():
    c = TransformerConfig(**BASE)
    assert (c.ffn_hidden_size, c.kv_channels, c.num_query_groups) == (256, 16, 4)
    assert TransformerConfig(**BASE, num_query_groups=2, ffn_hidden_size=100).ffn_hidden_size == 100


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_attention_heads=5), "not divisible by num_attention_heads"),
        (dict(num_query_groups=3), "multiple of num_query_groups"),
        (dict(num_layers=0), "num_layers must be a positive integer"),
        (dict(normalization="BatchNorm"), "normalization must be one of"),
        (dict(activation_func="tanh"), "activation_func must be one of"),
        (dict(position_embedding_type="alibi"), "position_embedding_type"),
        (dict(hidden_dropout=1.0), "hidden_dropout must be in"),
        (dict(recompute_granularity="full"), "needs recompute_method"),
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3), "recompute_num_layers"),
        (dict(recompute_granularity="selective", recompute_method="uniform"), "only apply to"),
        (dict(position_embedding_type="rope", rotary_percent=0.1), "rotary_percent"),
        (dict(attention_backend="flash"), "attention_backend"),
    ],
)
def test_bad_values_say_what_to_do(change, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**{**BASE, **change})
