"""One typed configuration: dataclass sections, Megatron-LM flag names, YAML files, one validation pass.

cfg = parse_config(["--num-layers", "2", ...])      # flags (and --config file.yaml)
cfg.model.hidden_size, cfg.parallel.tensor_model_parallel_size, ...
"""

from gigatron.config.checkpoint import CheckpointConfig
from gigatron.config.data import DataConfig
from gigatron.config.logging import LoggingConfig
from gigatron.config.model import ModelConfig
from gigatron.config.moe import MoEConfig
from gigatron.config.optimizer import OptimizerConfig
from gigatron.config.parallel import ParallelConfig
from gigatron.config.root import (
    SECTIONS,
    GigatronConfig,
    add_config_arguments,
    config_from_dict,
    config_to_dict,
    parse_config,
)
from gigatron.config.tokenizer import TokenizerConfig
from gigatron.config.training import TrainingConfig
from gigatron.config.validate import finalize_config, freeze_config, validate_config

__all__ = [
    "SECTIONS",
    "CheckpointConfig",
    "DataConfig",
    "GigatronConfig",
    "LoggingConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "TokenizerConfig",
    "TrainingConfig",
    "add_config_arguments",
    "config_from_dict",
    "config_to_dict",
    "finalize_config",
    "freeze_config",
    "parse_config",
    "validate_config",
]
