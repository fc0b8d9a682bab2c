"""Flags that choose between implementations of which gigatron has exactly one.

Megatron's scripts pass flags such as `--transformer-impl local` or `--no-rope-fusion` to pick a
kernel or a code path; the model they describe is the same either way. gigatron has one
implementation of each of those parts, so it accepts the values whose meaning it computes and
says here what each flag maps to (docs/training.md prints this table). A value that would ask
for something gigatron does not do is refused by config/refusals.py instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Equivalent:
    """`flag`: the Megatron flag; `maps_to`: what gigatron does for every accepted value."""

    flag: str
    maps_to: str


EQUIVALENTS: dict[str, Equivalent] = {
    "deprecated_use_mcore_models": Equivalent(
        "--use-mcore-models",
        "gigatron's models are Megatron-Core models (the legacy models do not exist); a no-op in Megatron too",
    ),
    "transformer_impl": Equivalent(
        "--transformer-impl local|transformer_engine",
        "gigatron's PyTorch layers, which compute the same functions as Megatron's local and "
        "Transformer Engine specs (transformer_engine: a fused RMSNorm kernel on CUDA, "
        "docs/performance.md; fp8 is --fp8-format)",
    ),
    "attention_backend": Equivalent(
        "--attention-backend",
        "torch.nn.functional.scaled_dot_product_attention, which chooses a flash, "
        "memory-efficient or math kernel itself (the explicit softmax path with "
        "--attention-softmax-in-fp32 / --apply-query-key-layer-scaling; flash-attn with "
        "--use-flash-attn)",
    ),
    "masked_softmax_fusion": Equivalent(
        "--no-masked-softmax-fusion",
        "the same masked softmax, inside scaled_dot_product_attention or the explicit path",
    ),
    "bias_gelu_fusion": Equivalent("--no-bias-gelu-fusion", "bias addition and GeLU as two PyTorch operations"),
    "bias_dropout_fusion": Equivalent(
        "--no-bias-dropout-fusion", "bias, dropout and residual addition as PyTorch operations"
    ),
    "gradient_accumulation_fusion": Equivalent(
        "--no-gradient-accumulation-fusion",
        "weight gradients are computed by autograd and added into the fp32 gradient buffer by "
        "a hook (what Megatron does without the fused kernel); the same sums either way",
    ),
    "moe_permute_fusion": Equivalent("--moe-permute-fusion", "token permutation by one index_select / index_add pair"),
    "mmap_bin_files": Equivalent(
        "--no-mmap-bin-files",
        ".bin files are memory-mapped read-only; the tokens read are the same either way",
    ),
    "enable_experimental": Equivalent(
        "--enable-experimental",
        "nothing to enable: gigatron has no feature behind Megatron's experimental switch",
    ),
    "spec": Equivalent(
        "--spec MODULE [FUNCTION]",
        "the layers of the family named on the command line (`gigatron pretrain mamba` for "
        "megatron.core.models.mamba / hybrid specs, `gpt` for the GPT specs); other specs are "
        "refused",
    ),
    "use_pytorch_profiler": Equivalent(
        "--use-pytorch-profiler", "--profile always uses torch.profiler (gigatron has no other)"
    ),
}

# Megatron layer-spec modules whose layers gigatron's families build.
KNOWN_SPEC_MODULES = (
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.mamba.mamba_layer_specs",
    "megatron.core.models.hybrid.hybrid_layer_specs",
)
