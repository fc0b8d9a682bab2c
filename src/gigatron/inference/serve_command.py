"""`gigatron serve`: its flags and start-up (parsed before the server's torch-heavy modules are
imported, so `--help` is quick); the application is inference/server.py's `create_app`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gigatron.config.parser import command_parser
from gigatron.errors import GigatronError
from gigatron.inference.arguments import (
    add_engine_arguments,
    add_load_arguments,
    check_engine_arguments,
)

if TYPE_CHECKING:
    from gigatron.inference.load import Attach


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "serve",
        "Serve a checkpoint over HTTP: Megatron's PUT /api and OpenAI's /v1 API.",
    )
    add_load_arguments(parser)
    add_engine_arguments(parser, mtp=False)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on: this machine only by default; 0.0.0.0 (Megatron's "
        "default) listens on every interface",
    )
    parser.add_argument("--port", type=int, default=5000, help="port (Megatron's default)")
    parser.add_argument("--model-name", default="gigatron", help="the model id in /v1/models")
    parser.add_argument(
        "--api-key", action="append", default=[],
        help="a key clients must send as 'Authorization: Bearer KEY' (OpenAI's); repeatable; "
        "default: none needed. The environment variable GIGATRON_API_KEY adds one",
    )  # fmt: skip
    parser.add_argument(
        "--max-request-bytes", type=int, default=1 << 20,
        help="the largest request body accepted (413 beyond it)",
    )  # fmt: skip
    return parser


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys of --api-key and GIGATRON_API_KEY; a blank key is refused."""
    keys = [*args.api_key]
    if os.environ.get("GIGATRON_API_KEY"):
        keys.append(os.environ["GIGATRON_API_KEY"])
    if any(not key.strip() for key in keys):
        raise GigatronError("--api-key: a key is empty; give a non-blank key")
    return tuple(key.strip() for key in keys)


def main(argv: Sequence[str], attach: Attach | None = None) -> int:
    """`gigatron serve --load DIR [--port 5000]`; `attach` as in generate.main."""
    args = build_parser().parse_args(list(argv))
    check_engine_arguments(args, mtp=False)
    # why here: torch-heavy modules load after the flags are parsed (a quick --help)
    from gigatron.inference.load import load_for_inference, run_on_engine

    if not 0 < args.port < 65536:
        raise GigatronError(f"--port {args.port}: not a TCP port; use 1-65535")
    if args.max_request_bytes < 1:
        raise GigatronError(f"--max-request-bytes {args.max_request_bytes}: must be positive")
    keys = api_keys(args)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise GigatronError(
            "gigatron serve needs FastAPI and uvicorn: pip install 'gigatron[serve]'"
        ) from None
    from gigatron.parallel.context import destroy

    loaded = load_for_inference(args)

    def serve(engine) -> int:
        from gigatron.inference.server import create_app

        prompt_format = loaded.cfg.data.sft_tokenizer_prompt_format  # the fine-tuning's
        app = create_app(
            engine, loaded.tokenizer, args.model_name, keys, args.max_request_bytes, prompt_format
        )
        print(
            f"gigatron serve: {args.load} (iteration {loaded.iteration}) on "
            f"http://{args.host}:{args.port}  (PUT /api, POST /v1/completions, "
            "POST /v1/chat/completions)",
            flush=True,
        )
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
        return 0

    try:
        if attach is not None:
            attach(loaded, args)
        return run_on_engine(loaded, args, serve)
    finally:
        destroy(loaded.pctx)
