"""Which kind each layer of a hybrid stack is: Megatron's pattern strings and ratio allocation.

A pattern has one symbol per layer: `M` a Mamba layer, `*` an attention layer (norm + self
attention), `-` an MLP layer (norm + MLP); e.g. `M-M*-M-` is 7 layers. It comes from
`--hybrid-layer-pattern` (or its older name `--hybrid-override-pattern`), or is allocated from
`--num-layers`, `--hybrid-attention-ratio` and `--hybrid-mlp-ratio` as Megatron allocates it:
attention layers spread evenly with Mamba sections around them, then MLP layers spread evenly
over the remaining Mamba positions. A pattern given together with non-zero ratios must have the
layer counts that the ratios allocate (Megatron's rule).
"""

from __future__ import annotations

from gigatron.errors import GigatronError

MAMBA, ATTENTION, MLP = "M", "*", "-"
SYMBOLS = (MAMBA, ATTENTION, MLP)
# Megatron symbols for layer kinds gigatron does not build.
_UNSUPPORTED = {
    "E": "mixture-of-experts layers",
    "G": "gated delta-net layers",
    "D": "DeepSeek sparse attention layers",
    "+": "multi-latent attention layers",
    "|": "pipeline stage boundaries (use --decoder-first/last-pipeline-num-layers)",
    "/": "multi-token-prediction patterns",
}


def pattern_from_ratios(num_layers: int, attention_ratio: float, mlp_ratio: float) -> str:
    """Megatron's even allocation (e.g. 10 layers at 0.2 attention -> `MMM*MM*MMM`)."""
    kinds = [MAMBA] * num_layers
    attention = round(num_layers * attention_ratio)
    mamba = num_layers - attention
    # Walk the layers with a budget of Mamba layers per section: when less than half a layer
    # remains, the next layer is an attention layer (and the budget refills).
    section = mamba / (attention + 1)
    budget = section
    for i in range(num_layers):
        if budget < 0.5:
            kinds[i] = ATTENTION
            budget += section
        else:
            budget -= 1
    mlp = round(num_layers * mlp_ratio)
    if mlp > 0:
        per_mlp = (mamba - mlp) / mlp
        budget = per_mlp
        for i in range(num_layers):
            if kinds[i] != MAMBA:
                continue
            if budget < 0.5:
                kinds[i] = MLP
                budget += per_mlp
            else:
                budget -= 1
    return "".join(kinds)


def check_pattern(pattern: str, flag: str = "--hybrid-layer-pattern") -> None:
    """Refuse empty patterns and symbols other than M, * and -."""
    if not pattern:
        raise GigatronError(f"{flag} is empty; give one symbol per layer (M, * or -)")
    for symbol in pattern:
        if symbol in _UNSUPPORTED:
            raise GigatronError(
                f"{flag} {pattern}: '{symbol}' ({_UNSUPPORTED[symbol]}) is not supported by "
                "gigatron; use M (Mamba), * (attention) and - (MLP) only"
            )
        if symbol not in SYMBOLS:
            raise GigatronError(
                f"{flag} {pattern}: '{symbol}' is not a layer symbol; use M (Mamba), "
                "* (attention) and - (MLP)"
            )


def resolve_pattern(
    num_layers: int | None,
    attention_ratio: float = 0.0,
    mlp_ratio: float = 0.0,
    layer_pattern: str | None = None,
    override_pattern: str | None = None,
) -> str:
    """The stack's pattern from the flags (see the module docstring)."""
    for value, flag in (
        (attention_ratio, "--hybrid-attention-ratio"),
        (mlp_ratio, "--hybrid-mlp-ratio"),
    ):
        if not 0.0 <= value <= 1.0:
            raise GigatronError(f"{flag} {value}: must be in [0, 1]")
    if attention_ratio + mlp_ratio > 1.0:
        raise GigatronError(
            f"--hybrid-attention-ratio {attention_ratio} + --hybrid-mlp-ratio {mlp_ratio}: the "
            "ratios add up to more than 1; lower them"
        )
    if layer_pattern is not None and override_pattern is not None:
        raise GigatronError(
            "--hybrid-layer-pattern and --hybrid-override-pattern both given; they are the same "
            "option (the second is its older name), give one"
        )
    flag = "--hybrid-layer-pattern" if layer_pattern is not None else "--hybrid-override-pattern"
    pattern = layer_pattern if layer_pattern is not None else override_pattern
    if pattern is None:
        if num_layers is None:
            raise GigatronError("--num-layers not set; give it or --hybrid-layer-pattern")
        return pattern_from_ratios(num_layers, attention_ratio, mlp_ratio)
    check_pattern(pattern, flag)
    if num_layers is not None and num_layers != len(pattern):
        raise GigatronError(
            f"{flag} {pattern}: has {len(pattern)} layers but --num-layers is {num_layers}; "
            "make them agree or drop --num-layers"
        )
    if attention_ratio > 0.0 or mlp_ratio > 0.0:
        allocated = pattern_from_ratios(len(pattern), attention_ratio, mlp_ratio)
        if sorted(allocated) != sorted(pattern):
            raise GigatronError(
                f"{flag} {pattern}: its layer counts differ from those of the ratios "
                f"({allocated}); drop the ratios or change the pattern"
            )
    return pattern
