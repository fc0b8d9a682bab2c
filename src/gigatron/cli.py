"""The `gigatron` command: one subcommand per step of the workflow.

Each subcommand lives in its own module as `main(argv) -> int`; this file only dispatches, so
that `gigatron preprocess` never imports the model code (and the reverse).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from gigatron import __version__
from gigatron.console import one_line_warnings
from gigatron.errors import GigatronError
from gigatron.faults import report_error

# name -> (module:function, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": (
        "gigatron.quickstart:main",
        "train a small GPT on a built-in corpus, end to end",
    ),
    "preprocess": ("gigatron.data.preprocess:main", "tokenize JSON lines into .bin/.idx datasets"),
    "data": (
        "gigatron.data.corpus.command:main",
        "corpus tools: gigatron data wikipedia|clean|dedup|decontaminate|blacklist",
    ),
    "retro-preprocess": (
        "gigatron.tasks.retro_preprocess:main",
        "Retro: chunk database, BERT embeddings, Faiss index and neighbours (docs/retro.md)",
    ),
    "merge": ("gigatron.data.merge:main", "concatenate indexed datasets into one"),
    "train-tokenizer": (
        "gigatron.data.train_tokenizer:main",
        "train a BPE or WordPiece tokenizer on JSON lines",
    ),
    "pretrain": (
        "gigatron.training.pretrain:main",
        "pretrain a model: gigatron pretrain gpt [flags]",
    ),
    "generate": (
        "gigatron.tasks.retro_generate:generate_main",
        "generate text from a checkpoint: gigatron generate --load DIR --prompt TEXT",
    ),
    "serve": (
        "gigatron.tasks.retro_generate:serve_main",
        "serve a checkpoint over HTTP (Megatron's PUT /api and OpenAI's /v1 API)",
    ),
    "text-generation-cli": (
        "gigatron.inference.client:main",
        "interactive client of a generation server: gigatron text-generation-cli HOST:PORT",
    ),
    "evaluate": (
        "gigatron.tasks.evaluate:main",
        "zero-shot WikiText perplexity or LAMBADA accuracy of a checkpoint (--task ...)",
    ),
    "quantize": (
        "gigatron.quantize.command:main",
        "weight-only int8/int4 quantization of a checkpoint: gigatron quantize --load DIR ...",
    ),
    "finetune": (
        "gigatron.tasks.finetune_command:main",
        "fine-tune a BERT checkpoint on MNLI, QQP or RACE (--task ...)",
    ),
    "detoxify": (
        "gigatron.tasks.detoxify.command:main",
        "detoxification by self-generation: gigatron detoxify generate|score|filter|evaluate",
    ),
    "lm-eval": (
        "gigatron.integrations.lm_eval:main",
        "lm-evaluation-harness with gigatron checkpoints: gigatron lm-eval --model gigatron ...",
    ),
    "plot": (
        "gigatron.training.plot_command:main",
        "plot a run's training and validation loss: gigatron plot metrics.jsonl",
    ),
    "presets": ("gigatron.models.presets:main", "list the named model shapes"),
    "convert-checkpoint": (
        "gigatron.checkpoint.convert:main",
        "re-split a torch checkpoint for another tensor/pipeline-parallel layout",
    ),
    "convert": (
        "gigatron.checkpoint.hf_convert:main",
        "convert checkpoints: --from hf|gigatron|megatron --to gigatron|hf|megatron",
    ),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [
        "usage: gigatron <command> [flags]   (gigatron <command> --help for its flags)",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {description}" for name, (_, description) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        print(f"gigatron {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"gigatron: unknown command '{name}'\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, function_name = COMMANDS[name][0].split(":")
    try:
        with one_line_warnings():
            function = getattr(importlib.import_module(module_name), function_name)
            return int(function(rest) or 0)
    except GigatronError as error:
        # Under torchrun every rank may hit the same error: it is printed once.
        return report_error(
            name,
            str(error),
            exit_code=getattr(error, "exit_code", 2),
            report_key=getattr(error, "report_key", None),
            exit_quietly=True,
        )
    except KeyboardInterrupt:
        print(f"gigatron {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
