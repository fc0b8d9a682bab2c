"""The mamba family: Megatron's hybrid models, stacks of Mamba-2, attention and MLP layers
(`--hybrid-layer-pattern M-M*-M-`, or `--num-layers` with `--hybrid-attention-ratio` /
`--hybrid-mlp-ratio`), trained as language models exactly like GPT (same data, batches and
`lm_loss`).
"""

from __future__ import annotations

from gigatron.errors import GigatronError
from gigatron.families import gpt
from gigatron.families.mamba.hf_mamba import Mamba2HFAdapter
from gigatron.families.registry import ModelFamily
from gigatron.models.flops import forward_flops_per_token
from gigatron.models.hybrid import build_model, hybrid_pattern
from gigatron.models.hybrid_layout import ATTENTION, MAMBA, MLP
from gigatron.models.mamba import MambaSpec


def mamba_forward_flops_per_token(hidden_size: int, mamba: MambaSpec) -> float:
    """Megatron's estimate for one Mamba layer: in_proj and out_proj matmuls, plus 7 d_inner N
    for the scan."""
    d_inner, n = mamba.d_inner, mamba.state_dim
    in_proj = 2 * hidden_size * (2 * d_inner + 2 * mamba.num_groups * n + mamba.num_heads)
    return in_proj + 7 * d_inner * n + 2 * d_inner * hidden_size


def flops_per_iteration(cfg, global_batch_size: int, padded_vocab_size: int) -> float:
    """Training FLOPs (3x forward) of one iteration: each layer counted by its kind."""
    m = cfg.model
    pattern = hybrid_pattern(cfg)

    def transformer_part(ffn: int, with_attention: bool) -> float:
        # One layer of forward_flops_per_token, without the logits; attention removed by
        # counting zero heads.
        heads = m.num_attention_heads if with_attention else 0
        groups = m.num_query_groups if with_attention else 0
        return forward_flops_per_token(
            1, m.hidden_size, m.seq_length, 0, ffn, heads, groups, m.kv_channels, m.swiglu
        )

    per_kind = {
        MAMBA: mamba_forward_flops_per_token(m.hidden_size, MambaSpec.from_config(cfg)),
        ATTENTION: transformer_part(0, True),
        MLP: transformer_part(m.ffn_hidden_size, False),
    }
    per_token = sum(per_kind[kind] for kind in pattern) + 2 * m.hidden_size * padded_vocab_size
    return 3.0 * per_token * global_batch_size * m.seq_length


# Beyond the common core: the hybrid layer pattern, the Mamba layers' shape, and the GPT data
# options the shared data pipeline honours (supervised fine-tuning, per-token loss averaging).
ACCEPTED_FIELDS = frozenset(
    {
        "hybrid_layer_pattern",
        "hybrid_override_pattern",
        "hybrid_attention_ratio",
        "hybrid_mlp_ratio",
        "mamba_state_dim",
        "mamba_head_dim",
        "mamba_num_groups",
        "mamba_num_heads",
        "sft",
        "calculate_per_token_loss",
    }
)


def validate(cfg) -> None:
    """The pattern's rules, and what Mamba layers cannot do."""
    pattern = hybrid_pattern(cfg)
    mamba = MambaSpec.from_config(cfg)
    if MAMBA not in pattern:
        return
    tp = cfg.parallel.tensor_model_parallel_size
    for count, what in ((mamba.num_heads, "Mamba heads"), (mamba.num_groups, "Mamba groups")):
        if count % tp:
            raise GigatronError(
                f"--tensor-model-parallel-size {tp}: does not divide the {count} {what}; each "
                "rank needs whole heads and groups (see --mamba-num-heads, --mamba-num-groups)"
            )
    if cfg.parallel.context_parallel_size > 1:
        raise GigatronError(
            f"--context-parallel-size {cfg.parallel.context_parallel_size}: Mamba layers need "
            "the whole sequence on each rank in gigatron; use tensor/sequence parallelism"
        )
    if cfg.data.reset_attention_mask:
        raise GigatronError(
            "--reset-attention-mask: Mamba layers carry their state across document ends "
            "within a sample (the mask only stops attention); drop the flag"
        )


HF_ADAPTER = Mamba2HFAdapter()
# Trained and used like a GPT: its forward step, datasets, generation and default tokenizer.
GENERATION, DEFAULT_TOKENIZER_TYPE = gpt.GENERATION, gpt.DEFAULT_TOKENIZER_TYPE


FAMILY = ModelFamily.from_namespace(
    globals(),
    description="hybrid Mamba-2 / attention / MLP language model (Megatron's hybrid models)",
    build_model=build_model,
    make_forward_step=gpt.make_forward_step,
    loss_names=lambda cfg: ("lm_loss",),
    build_datasets=gpt.build_datasets,
)
