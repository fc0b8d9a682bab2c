"""`gigatron convert`: checkpoints between gigatron, Hugging Face and Megatron-LM, streamed.

    gigatron convert --from hf --to gigatron --load HF_DIR --save CKPT [--target-...-size N]
    gigatron convert --from gigatron --to hf --load CKPT --save HF_DIR
    gigatron convert --from megatron --to gigatron ... / --from gigatron --to megatron ...
    gigatron convert --from gigatron --to gigatron|hf --merge-lora --load LORA_RUN --save DIR
    gigatron convert --from gigatron --to peft --load LORA_RUN --save DIR

Hugging Face: the family comes from `config.json`'s `model_type` (or `--family`) through the
families' adapters (checkpoint/hf_adapter.py); weights are read from safetensors one layer at a
time and written to every target rank's file at once (gigatron_io.py), or to safetensors shards
(safetensors_io.py). The imported checkpoint keeps the Hugging Face `config.json` (`hf_config`),
so exporting it writes the same config; tokenizer files are copied both ways, and an export of a
trained model writes the run's tokenizer (hf_tokenizer_export.py).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gigatron.checkpoint.gigatron_io import CheckpointSource, write_checkpoint
from gigatron.checkpoint.hf_adapter import WindowedMap, adapter_for, call_map
from gigatron.checkpoint.hf_input_checks import cleaned_on_failure, config_values, read_config_file
from gigatron.checkpoint.hf_layouts import canonical_source, model_folder
from gigatron.checkpoint.hf_tokenizer_export import (
    TOKENIZER_FILES,
    TOKENIZER_FLAGS,
    plan_tokenizer_export,
)
from gigatron.checkpoint.layout import (
    WORD_EMBEDDING,
    build_target_layout,
    check_target,
    true_vocab_size,
)
from gigatron.checkpoint.lora_convert import export_peft, merge_lora
from gigatron.checkpoint.megatron_convert import gigatron_to_megatron, whole_to_megatron_dist
from gigatron.checkpoint.pipeline import Target, convert
from gigatron.checkpoint.retro_decoder import retro_to_gpt
from gigatron.checkpoint.safetensors_io import SafetensorsFolder, write_safetensors
from gigatron.checkpoint.torch_format import (
    CHECKPOINT_FILENAME,
    locate_iteration,
    safe_load,
)
from gigatron.config import config_from_dict
from gigatron.config.parser import command_parser
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.models.mup import refuse_hf_export

CONFIG_FILE = "config.json"
# Hugging Face tensors that are not weights (buffers some versions saved).
IGNORED_HF = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq|position_ids)$")
FORMATS = ["hf", "gigatron", "megatron", "peft"]  # peft: a LoRA run's adapters (target only)
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMG]?B)?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'5GB' -> bytes (also KB, MB, B)."""
    match = _SIZE.match(text.strip())
    if not match:
        raise GigatronError(f"--max-shard-size {text}: not a size; give e.g. 5GB or 500MB")
    scale = {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}[(match.group(2) or "B").upper()]
    return int(float(match.group(1)) * scale)


def copy_tokenizer_files(source: Path, target: Path) -> list[str]:
    copied = []
    for entry in sorted(source.iterdir()):
        if entry.is_file() and TOKENIZER_FILES.match(entry.name):
            shutil.copy2(entry, target / entry.name)
            copied.append(entry.name)
    return copied


def decoded(raw: dict[str, Any]) -> dict[str, Any]:
    """A config.json's values with transformers' JSON markers for non-finite floats
    (`{"__float__": "Infinity"}`) turned into floats."""

    def value(v: Any) -> Any:
        if isinstance(v, dict):
            if set(v) == {"__float__"}:
                return float(v["__float__"])
            return {k: value(x) for k, x in v.items()}
        if isinstance(v, list):
            return [value(x) for x in v]
        return v

    return value(raw)


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise GigatronError(
            f"--load {folder}: has no {CONFIG_FILE}; give a Hugging Face model folder "
            "(save_pretrained output)"
        )
    return read_config_file(path)


def _family_adapter(model_type: str | None, family: str | None) -> tuple[str, Any]:
    if family is None:
        return adapter_for(str(model_type))

    adapter = get_family(family).hf_adapter
    if adapter is None:
        raise GigatronError(f"--family {family}: this family has no Hugging Face adapter")
    types = tuple(getattr(adapter, "model_types", ()) or ())
    if types and model_type not in types:
        raise GigatronError(
            f"--family {family}: reads model_type {', '.join(types)}, but config.json says "
            f"{model_type!r}; leave --family out to pick the family from config.json"
        )
    return family, adapter


def hf_to_gigatron(
    load: Path,
    save: Path,
    tp: int = 1,
    pp: int = 1,
    vp: int | None = None,
    ep: int = 1,
    family: str | None = None,
    log: Any = print,
) -> Path:
    """Import a Hugging Face folder as a gigatron `release` checkpoint for the target layout."""

    load = model_folder(load)  # in a sentence-transformers folder: the Transformer module's
    raw_config = read_hf_config(load)  # kept as written, for the export
    hf_config = decoded(raw_config)
    family, adapter = _family_adapter(hf_config.get("model_type"), family)
    values = config_values(adapter, hf_config, load / CONFIG_FILE)
    cfg = config_from_dict(values, source=f"{load / CONFIG_FILE} (as gigatron flags)")
    check_target(cfg, tp, pp, vp, ep, family)
    layout = build_target_layout(cfg, tp, pp, vp, ep, values["vocab_size"], family)
    padded = next(
        chunk.state_dict(keep_vars=True)[WORD_EMBEDDING].shape[0] * tp
        for chunks in layout.models.values()
        for chunk in chunks
        if WORD_EMBEDDING in chunk.state_dict(keep_vars=True)
    )
    model = cfg.model
    log(
        f"converting {load} ({hf_config.get('model_type')}, family {family}) to tensor-parallel "
        f"{tp}, pipeline-parallel {pp}" + (f", expert-parallel {ep}" if ep > 1 else "")
    )
    save.mkdir(parents=True, exist_ok=True)
    with SafetensorsFolder(load) as stored:
        source = canonical_source(stored, hf_config, load)  # base models, missing heads
        try:
            mapping = WindowedMap(
                lambda view: call_map(
                    adapter.from_hf,
                    view,
                    model.num_layers,
                    model.num_attention_heads,
                    padded,
                    hf_config=hf_config,
                ),
                source,
            )
        except KeyError as missing:
            raise GigatronError(
                f"--load {load}: has no tensor {missing} that a {hf_config.get('model_type')} "
                f"checkpoint holds; it holds {', '.join(source.names()[:8])}, ...: give a "
                "complete model folder"
            ) from None

        def check_all_used() -> None:
            unused = [
                n for n in source.names() if n not in mapping.used and not IGNORED_HF.search(n)
            ]
            if unused:
                more = f" (and {len(unused) - 20} more)" if len(unused) > 20 else ""
                raise GigatronError(
                    f"--load {load}: holds {len(unused)} tensor(s) gigatron has no place for: "
                    f"{', '.join(unused[:20])}{more}; this {hf_config.get('model_type')} "
                    "variant is not supported"
                )

        extra = {
            "gigatron_family": family,
            "converted_from": str(load),
            "hf_config": raw_config,
        }
        final = write_checkpoint(
            save, layout, mapping.outputs(), set(mapping.plan), extra, check=check_all_used
        )
    copied = copy_tokenizer_files(load, save)
    log(f"wrote {len(layout.positions)} file(s) to {final}; tokenizer files: {copied or 'none'}")
    return final


def _checkpoint_config(iteration_dir: Path) -> tuple[Any, str, dict[str, Any], dict]:
    first = next(iter(sorted(iteration_dir.glob(f"mp_rank_*/{CHECKPOINT_FILENAME}"))), None)
    if first is None:
        raise GigatronError(f"{iteration_dir}: holds no mp_rank_*/{CHECKPOINT_FILENAME}")
    state = safe_load(first, mmap=True)
    args = state.get("args")
    if not isinstance(args, dict) or not args:
        raise GigatronError(f"{first}: holds no gigatron configuration ('args')")
    cfg = config_from_dict(args, source=f"{first} args")
    return cfg, state.get("gigatron_family", "gpt"), state.get("hf_config") or {}, state


def gigatron_to_hf(
    load: Path,
    save: Path,
    iteration: int | None = None,
    max_shard_bytes: int | None = None,
    log: Any = print,
    tokenizer: dict[str, str | None] | None = None,
    tokenizer_mode: str = "if-any",
) -> Path:
    """Export a gigatron checkpoint (any layout) as a Hugging Face folder. `tokenizer`: the
    convert command's tokenizer flags over the run's; `tokenizer_mode`: "required", "if-any"
    or "none" (checkpoint/hf_tokenizer_export.py)."""
    located = locate_iteration(load, iteration)
    if located is None:
        raise GigatronError(f"--load {load}: no latest_checkpointed_iteration.txt there")
    iteration_dir = located[0]
    cfg, family, hf_config, _ = _checkpoint_config(iteration_dir)
    refuse_hf_export(cfg, str(iteration_dir))

    adapter = get_family(family).hf_adapter
    if adapter is None:
        raise GigatronError(f"{iteration_dir}: family {family} has no Hugging Face adapter")
    source = CheckpointSource(iteration_dir, cfg, family)
    tokenizer_files = plan_tokenizer_export(
        load, getattr(cfg, "tokenizer", None), tokenizer, tokenizer_mode, str(iteration_dir)
    )
    if not hf_config:
        if not hasattr(adapter, "config_to_hf"):
            raise GigatronError(
                f"{iteration_dir}: was not imported from Hugging Face and the {family} adapter "
                "cannot write a config.json for it"
            )
        vocab = true_vocab_size(cfg) or source.meta(WORD_EMBEDDING).shape[0]
        hf_config = adapter.config_to_hf(cfg, vocab)
    raw_config, hf_config = hf_config, decoded(hf_config)
    vocab = hf_config["vocab_size"]
    model = cfg.model
    to_files = getattr(adapter, "to_hf_files", None)

    def export(view: Any) -> dict[str, Any]:
        out = call_map(
            adapter.to_hf,
            view,
            model.num_layers,
            model.num_attention_heads,
            vocab,
            hf_config=hf_config,
        )
        return to_files(out, hf_config) if to_files else out

    mapping = WindowedMap(export, source)
    save.mkdir(parents=True, exist_ok=True)
    log(f"exporting {iteration_dir} (family {family}) to {save}")
    files = write_safetensors(save, mapping.plan, mapping.outputs(), max_shard_bytes)
    (save / CONFIG_FILE).write_text(json.dumps(raw_config, indent=2) + "\n")
    copied = tokenizer_files.write(save)
    log(f"wrote {', '.join(files)} and {CONFIG_FILE}; tokenizer files: {copied or 'none'}")
    return save


def _parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "convert",
        "Convert checkpoints between gigatron, Hugging Face (safetensors) and "
        "Megatron-LM's torch format, one tensor at a time.",
    )
    parser.add_argument(
        "--from", dest="source", required=True, choices=FORMATS, help="format of --load"
    )
    parser.add_argument(
        "--to", dest="target", required=True, choices=FORMATS, help="format to write to --save"
    )
    parser.add_argument("--load", required=True, help="directory to read")
    parser.add_argument("--save", required=True, help="directory to write")
    family_help = (
        "model family (default: from config.json's model_type); --from gigatron --to gigatron "
        "--family gpt: a retro checkpoint's decoder alone as a gpt checkpoint"
    )
    parser.add_argument("--family", default=None, help=family_help)
    for flag, what in (
        ("--target-tensor-parallel-size", "tensor-parallel size"),
        ("--target-pipeline-parallel-size", "pipeline-parallel size"),
        ("--target-expert-parallel-size", "expert-parallel size"),
    ):
        parser.add_argument(
            flag,
            type=int,
            default=None,
            help=f"{what} of a gigatron target (default: 1 from hf, the saved one from megatron)",
        )
    parser.add_argument(
        "--target-num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="virtual pipeline stages per rank of a gigatron target (default: none)",
    )
    parser.add_argument(
        "--ckpt-step", type=int, default=None, help="iteration to export (default: the latest)"
    )
    _add_megatron_target_flags(parser)
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help="largest safetensors file of a Hugging Face target (default 5GB); larger models "
        "are sharded with an index file",
    )
    for flag, what in (
        ("--tokenizer-type", "tokenizer kind"),
        ("--vocab-file", "vocabulary file (GPT-2 vocab.json, BERT vocab.txt)"),
        ("--merge-file", "GPT-2 merges.txt"),
        ("--tokenizer-model", "Hugging Face tokenizer folder or tokenizer.json"),
    ):
        parser.add_argument(
            flag, default=None, help=f"--to hf: {what} to export (default: the run's)"
        )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="--load is a LoRA run's checkpoint: write its base with the adapters folded into "
        "the weights (--to gigatron or hf; docs/lora.md)",
    )
    parser.add_argument(
        "--pretrained-checkpoint",
        default=None,
        help="--merge-lora: the base checkpoint (default: the one the LoRA run trained on)",
    )
    parser.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="--to hf: export the weights without tokenizer files (default: the run's "
        "tokenizer is written, or the export is refused)",
    )
    return parser


def _add_megatron_target_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a `--to megatron` target."""
    parser.add_argument(
        "--ckpt-format",
        choices=("torch", "torch_dist"),
        default="torch",
        help="--to megatron: Megatron-LM's checkpoint format to write",
    )
    parser.add_argument(
        "--megatron-te-names",
        action="store_true",
        help="--to megatron: Transformer Engine layer names (norms fused into the next linear) "
        "instead of the local spec's",
    )


_TARGET_FLAGS = (
    "target_tensor_parallel_size",
    "target_pipeline_parallel_size",
    "target_expert_parallel_size",
    "target_num_virtual_stages_per_pipeline_rank",
)


def _refuse_unused_flags(args: argparse.Namespace) -> None:
    """Each flag given must mean something for this pair of formats."""
    unused = []
    if args.target != "gigatron":
        unused += [f for f in _TARGET_FLAGS if getattr(args, f) is not None]
    retro_decoder = (args.source, args.target) == ("gigatron", "gigatron") and not args.merge_lora
    if args.source != "hf" and args.family is not None and not retro_decoder:
        unused.append("family")
    if args.target != "megatron" and args.megatron_te_names:
        unused.append("megatron_te_names")
    if args.target != "megatron" and args.ckpt_format != "torch":
        unused.append("ckpt_format")
    if args.target != "hf" and args.max_shard_size is not None:
        unused.append("max_shard_size")
    if args.source == "hf" and args.ckpt_step is not None:
        unused.append("ckpt_step")
    lora_pairs = (("gigatron", "gigatron"), ("gigatron", "hf"))
    if args.merge_lora and (args.source, args.target) not in lora_pairs:
        unused.append("merge_lora")
    if args.pretrained_checkpoint is not None and not args.merge_lora:
        unused.append("pretrained_checkpoint")
    if args.target != "hf":
        unused += [f for f in TOKENIZER_FLAGS if getattr(args, f) is not None]
        unused += ["no_tokenizer"] if args.no_tokenizer else []
    elif args.no_tokenizer:
        unused += [f for f in TOKENIZER_FLAGS if getattr(args, f) is not None]
    if unused:
        flags = ", ".join("--" + name.replace("_", "-") for name in unused)
        raise GigatronError(
            f"{flags}: no meaning for --from {args.source} --to {args.target}; drop "
            + ("it" if len(unused) == 1 else "them")
            + " (--to megatron keeps the saved layout: re-split first with convert-checkpoint)"
        )


def main(argv: Sequence[str]) -> int:
    parser = _parser()
    args, model_flags = parser.parse_known_args(list(argv))
    if model_flags and args.source != "megatron":
        parser.error(f"unrecognized arguments: {' '.join(model_flags)}")
    args.model_flags = tuple(model_flags)  # --from megatron: a file's model flags, if no args
    load, save = Path(args.load), Path(args.save)
    if not load.is_dir():
        raise GigatronError(f"--load {load}: no such directory")
    if save.exists() and save.resolve() == load.resolve():
        raise GigatronError(f"--save {save}: is the --load directory; give a new directory")
    log = lambda text: print(text, flush=True)  # noqa: E731
    pair = (args.source, args.target)
    _refuse_unused_flags(args)
    with cleaned_on_failure(save):  # no half-written --save left behind
        _convert(args, pair, load, save, log)
    return 0


def _convert(
    args: argparse.Namespace, pair: tuple[str, str], load: Path, save: Path, log: Any
) -> None:
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    if args.merge_lora or pair == ("gigatron", "peft"):
        _convert_lora(args, pair, load, save, log)
    elif pair == ("hf", "gigatron"):
        hf_to_gigatron(
            load,
            save,
            tp or 1,
            pp or 1,
            args.target_num_virtual_stages_per_pipeline_rank,
            args.target_expert_parallel_size or 1,
            args.family,
            log,
        )
    elif pair == ("gigatron", "hf"):
        gigatron_to_hf(
            load,
            save,
            args.ckpt_step,
            parse_size(args.max_shard_size or "5GB"),
            log,
            {f: getattr(args, f) for f in TOKENIZER_FLAGS},
            "none" if args.no_tokenizer else "required",
        )
    elif pair == ("gigatron", "megatron") and args.ckpt_format == "torch_dist":
        with tempfile.TemporaryDirectory(prefix="gigatron-whole-") as tmp:
            whole = Path(tmp) / "whole"  # one tp = pp = 1 file: Megatron reshards on load
            convert("gigatron", load, "gigatron", whole, Target(1, 1, None, 1), log, args.ckpt_step)
            whole_to_megatron_dist(whole, save, log)
    elif pair == ("gigatron", "megatron"):
        gigatron_to_megatron(load, save, args.ckpt_step, args.megatron_te_names, log)
    elif pair == ("gigatron", "gigatron") and args.family is not None:
        _convert_retro_decoder(args, load, save, log)
    elif pair == ("megatron", "gigatron"):
        vp, ep = args.target_num_virtual_stages_per_pipeline_rank, args.target_expert_parallel_size
        target = Target(tp, pp, vp, ep or 1)
        convert(
            "megatron", load, "gigatron", save, target, log, args.ckpt_step,
            model_flags=args.model_flags,
        )  # fmt: skip
    else:
        raise GigatronError(
            f"--from {args.source} --to {args.target}: not a conversion; supported: hf -> "
            "gigatron, gigatron -> hf, megatron -> gigatron, gigatron -> megatron, gigatron -> "
            "peft (a LoRA run's adapters), gigatron -> gigatron or hf with --merge-lora, "
            "gigatron -> gigatron with --family gpt (a retro checkpoint's decoder)"
        )


def _convert_retro_decoder(args: argparse.Namespace, load: Path, save: Path, log: Any) -> None:
    """--family gpt: the decoder of a retro checkpoint as a gpt checkpoint (docs/retro.md)."""
    if args.family != "gpt":
        raise GigatronError(
            f"--family {args.family}: --from gigatron --to gigatron writes a retro checkpoint's "
            "decoder as --family gpt only; give --family gpt"
        )
    vp, ep = args.target_num_virtual_stages_per_pipeline_rank, args.target_expert_parallel_size
    target = Target(args.target_tensor_parallel_size, args.target_pipeline_parallel_size, vp, ep)
    retro_to_gpt(load, save, target, log, args.ckpt_step)


def _convert_lora(
    args: argparse.Namespace, pair: tuple[str, str], load: Path, save: Path, log: Any
) -> None:
    """A LoRA run's checkpoint: its adapters as PEFT's, or merged into its base (docs/lora.md)."""
    if pair == ("gigatron", "peft"):
        export_peft(load, save, log, args.ckpt_step)
        return
    vp, ep = args.target_num_virtual_stages_per_pipeline_rank, args.target_expert_parallel_size
    target = Target(args.target_tensor_parallel_size, args.target_pipeline_parallel_size, vp, ep)
    if pair == ("gigatron", "gigatron"):
        merge_lora(load, save, args.pretrained_checkpoint, target, log, args.ckpt_step)
        return
    with tempfile.TemporaryDirectory(prefix="gigatron-merged-") as tmp:
        merge_lora(load, Path(tmp), args.pretrained_checkpoint, Target(), log, args.ckpt_step)
        gigatron_to_hf(
            Path(tmp),
            save,
            None,
            parse_size(args.max_shard_size or "5GB"),
            log,
            {f: getattr(args, f) for f in TOKENIZER_FLAGS},
            "none" if args.no_tokenizer else "required",
        )
