"""Checks of what `gigatron convert` reads and leaves: a Hugging Face `config.json` that is not a
JSON object, shape values that are not positive whole numbers, and no half-written output when a
conversion fails (the --save folder it created is removed, a `release.tmp` in an existing one).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gigatron.checkpoint.torch_format import TMP_SUFFIX
from gigatron.errors import GigatronError

# gigatron values (from an adapter's config_from_hf) that count something.
COUNTS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "seq_length",
    "max_position_embeddings",
    "vocab_size",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
)


def read_config_file(path: Path) -> dict[str, Any]:
    """A `config.json` as a dict, or a GigatronError naming the file and the fix."""
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as error:
        raise GigatronError(
            f"{path}: not valid JSON ({error}); save the model again (save_pretrained) or "
            "download the file again"
        ) from None
    if not isinstance(config, dict):
        raise GigatronError(
            f"{path}: holds a JSON {type(config).__name__}, not an object of configuration "
            "values; give the config.json save_pretrained writes"
        )
    return config


def config_values(adapter: Any, hf_config: dict[str, Any], path: Path) -> dict[str, Any]:
    """The adapter's gigatron values for `hf_config`, each count a positive whole number."""
    try:
        values = adapter.config_from_hf(hf_config)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        what = f"has no {error}" if isinstance(error, KeyError) else f"holds a bad value ({error})"
        raise GigatronError(
            f"{path}: {what}; give the config.json the model was saved with"
        ) from None
    bad = {
        name: values[name]
        for name in COUNTS
        if values.get(name) is not None
        and (
            isinstance(values[name], bool) or not isinstance(values[name], int) or values[name] < 1
        )
    }
    if bad:
        raise GigatronError(
            f"{path}: {', '.join(f'{k} {v!r}' for k, v in bad.items())} (as gigatron values): "
            "must be positive whole numbers; correct the config.json"
        )
    return values


@contextmanager
def cleaned_on_failure(save: Path) -> Iterator[None]:
    """Run a conversion into `save`; if it fails, remove `save` when it did not exist before,
    else the temporary `release.tmp` and tracker it wrote there."""
    existed = save.exists()
    try:
        yield
    except BaseException:
        if not existed:
            shutil.rmtree(save, ignore_errors=True)
        else:
            shutil.rmtree(save / ("release" + TMP_SUFFIX), ignore_errors=True)
        raise
