"""Hybrid layer allocation: Megatron's ratio allocation (worked by hand) and the pattern rules."""

from __future__ import annotations

import pytest

from gigatron.errors import GigatronError
from gigatron.models.hybrid_layout import pattern_from_ratios, resolve_pattern


def test_ratio_allocation_by_hand():
    # 10 layers, 2 attention: 8 Mamba layers in 3 sections of 8/3; an attention layer goes where
    # less than half a Mamba layer is left of the section's budget.
    assert pattern_from_ratios(10, 0.2, 0.0) == "MMM*MM*MMM"
    # Then 3 MLP layers over the 7 Mamba positions, one per (7 - 3) / 3 Mamba layers.
    assert pattern_from_ratios(10, 0.3, 0.3) == "M-*MM*-*M-"
    assert pattern_from_ratios(8, 0.0, 0.0) == "MMMMMMMM"
    assert pattern_from_ratios(1, 1.0, 0.0) == "*"
    assert pattern_from_ratios(4, 0.0, 0.5) == "M-M-"  # right-justified


def test_pattern_sets_the_layer_count_and_kinds():
    assert resolve_pattern(None, layer_pattern="M-M*-M-") == "M-M*-M-"
    assert resolve_pattern(7, override_pattern="M-M*-M-") == "M-M*-M-"
    assert resolve_pattern(10, 0.2) == "MMM*MM*MMM"
    # A pattern with the counts the ratios allocate, in another order (Megatron allows it).
    assert resolve_pattern(10, 0.2, layer_pattern="*MMMMMMMM*") == "*MMMMMMMM*"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_layers=6, layer_pattern="M-M*-M-"), "has 7 layers but --num-layers is 6"),
        (dict(num_layers=None, layer_pattern="M*E"), "'E' .* not supported"),
        (dict(num_layers=None, layer_pattern="M*|M*"), "pipeline stage boundaries"),
        (dict(num_layers=None, layer_pattern="M*x"), "'x' is not a layer symbol"),
        (dict(num_layers=None, layer_pattern=""), "is empty"),
        (dict(num_layers=None, layer_pattern="M*", override_pattern="M*"), "both given"),
        (dict(num_layers=None), "--num-layers not set"),
        (dict(num_layers=4, attention_ratio=0.7, mlp_ratio=0.4), "add up to more than 1"),
        (dict(num_layers=4, attention_ratio=-0.1), "must be in"),
        (dict(num_layers=None, attention_ratio=0.5, layer_pattern="MMM*"), "counts differ"),
    ],
)
def test_bad_flags_are_refused(kwargs, message):
    with pytest.raises(GigatronError, match=message):
        resolve_pattern(**kwargs)
