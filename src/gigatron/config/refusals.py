"""Flags that gigatron parses (Megatron's scripts pass them) but whose feature is not built yet.

Each entry names a configuration field, the values that are refused and why; `validate_config`
reports every refused setting it finds, so no flag is accepted and then ignored. When the feature
lands, its code reads the field and the entry goes. tests/unit/test_flags.py checks that every
flag is either read by the code or listed here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gigatron.config.equivalents import KNOWN_SPEC_MODULES
from gigatron.config.fields import flag_name


@dataclass(frozen=True)
class Refusal:
    """`refused(value)` is True for the values that cannot work yet; `fix` says what to do."""

    refused: Callable[[Any], bool]
    fix: str


REFUSALS: dict[str, Refusal] = {
    "transformer_impl": Refusal(
        lambda value: value == "inference_optimized",
        "the inference-optimized layers are not available; use --transformer-impl local (or "
        "transformer_engine: gigatron's layers compute the same model)",
    ),
    "spec": Refusal(
        lambda value: bool(value) and value[0] not in KNOWN_SPEC_MODULES,
        "gigatron builds layers from its families, not from Megatron layer-spec modules; drop "
        f"--spec or name one of {', '.join(KNOWN_SPEC_MODULES)} with its family "
        "(`gigatron pretrain gpt|mamba`)",
    ),
    "fp8_amax_history_len": Refusal(
        lambda value: value != 1,
        "an amax history is delayed scaling (Transformer Engine); gigatron's fp8 (torchao) "
        "scales from each step's amax: drop it",
    ),
    "fp8_amax_compute_algo": Refusal(
        lambda value: value != "most_recent",
        "an amax history is delayed scaling (Transformer Engine); gigatron's fp8 (torchao) "
        "scales from each step's amax: drop it",
    ),
    "fp8_param_gather": Refusal(bool, "gathering parameters in fp8 is not available; drop it (fp8 GEMMs still run)"),
    "nccl_ub": Refusal(
        bool,
        "NCCL user-buffer registration is a Megatron-FSDP tuning gigatron's FSDP (PyTorch "
        "FSDP2) does not have; drop it",
    ),
    "fsdp_double_buffer": Refusal(
        bool,
        "Megatron-FSDP's double buffer is not part of PyTorch FSDP2, which gigatron's FSDP uses; drop it",
    ),
    "fsdp_manual_registration": Refusal(
        bool,
        "manual NCCL buffer registration is a Megatron-FSDP tuning PyTorch FSDP2 does not have; drop it",
    ),
    "megatron_fsdp_main_grads_dtype": Refusal(
        lambda value: value != "auto",
        "FSDP2 keeps sharded gradients in the reduce dtype; set that with "
        "--megatron-fsdp-grad-comm-dtype (or drop this flag)",
    ),
    "moe_router_force_load_balancing": Refusal(
        bool,
        "forced load balancing (a benchmarking mode) is not available; drop it",
    ),
    "moe_token_dispatcher_type": Refusal(
        lambda value: value == "flex",
        "the flex token dispatcher (DeepEP / HybridEP kernels) is not available; use "
        "--moe-token-dispatcher-type alltoall",
    ),
    "moe_flex_dispatcher_backend": Refusal(
        lambda value: value is not None,
        "the flex token dispatcher (DeepEP / HybridEP kernels) is not available; use "
        "--moe-token-dispatcher-type alltoall and drop this flag",
    ),
    "muon_scalar_optimizer": Refusal(
        lambda value: value == "lion",
        "Lion is not available; use --muon-scalar-optimizer adam (AdamW for the parameters Muon does not update)",
    ),
    "muon_use_syrk": Refusal(
        bool,
        "the Triton SYRK kernel is not available; drop it (the Gram matrix is a plain matmul, the same numbers)",
    ),
    "exp_avg_dtype": Refusal(
        lambda value: value == "fp8",
        "fp8 optimizer state needs Transformer Engine's scaled kernels; use bf16 or fp16",
    ),
    "exp_avg_sq_dtype": Refusal(
        lambda value: value in ("fp8", "fp16"),
        "the second moment (squared gradients, often below fp16's smallest number) is kept in "
        "fp32 or bf16 only; use bf16",
    ),
    "main_params_dtype": Refusal(
        lambda value: value != "fp32",
        "main parameters are kept in fp32 (fp16 main parameters are not available); drop it",
    ),
    "main_grads_dtype": Refusal(
        lambda value: value != "fp32",
        "the optimizer reads fp32 gradients; drop it (--grad-reduce-in-bf16 lowers the reduction's precision)",
    ),
    "timing_log_level": Refusal(
        lambda value: value is not None and value > 1,
        "level 2 (fine-grained timers inside the schedule) is not available; use 1 for the "
        "forward-backward, optimizer and checkpoint timers",
    ),
}


def refused_settings(cfg: Any) -> list[str]:
    """One line per refused setting in `cfg` (a GigatronConfig: its sections are dataclasses)."""
    fields = {
        field.name: (section, field)
        for section in vars(cfg).values()
        if dataclasses.is_dataclass(section)
        for field in dataclasses.fields(section)
    }
    problems = []
    for name, refusal in REFUSALS.items():
        section, field = fields[name]
        value = getattr(section, name)
        if refusal.refused(value):
            if isinstance(value, bool):
                shown = ""
            elif isinstance(value, list):
                shown = " " + " ".join(str(v) for v in value)
            else:
                shown = f" {value}"
            problems.append(f"{flag_name(field)}{shown}: {refusal.fix}")
    return problems
