"""`gigatron serve`: its flags and start-up (parsed before the server's torch-heavy modules are
imported, so `--help` is quick); the application is inference/server.py's `create_app`."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
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


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use is refused at once
    (and no other process can take it while the model loads)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise GigatronError(
            f"--host {host} --port {port}: cannot listen there ({error.strerror or error}); "
            "give a free --port, or an address of this machine as --host"
        ) from None
    return sock


def main(argv: Sequence[str], attach: Attach | None = None) -> int:
    """`gigatron serve --load DIR [--port 5000]`; `attach` as in generate.main."""
    args = build_parser().parse_args(list(argv))
    check_engine_arguments(args, mtp=False)
    if not 0 < args.port < 65536:
        raise GigatronError(f"--port {args.port}: not a TCP port; use 1-65535")
    if args.max_request_bytes < 1:
        raise GigatronError(f"--max-request-bytes {args.max_request_bytes}: must be positive")
    keys = api_keys(args)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise GigatronError(
            "gigatron serve needs FastAPI and uvicorn: pip install 'gigatron[serve]'"
        ) from None
    # Rank 0 serves (torchrun's RANK; one process: 0); its port is taken before the model loads.
    sock = listening_socket(args.host, args.port) if os.environ.get("RANK", "0") == "0" else None
    with sock or contextlib.nullcontext():
        return _load_and_serve(args, keys, sock, attach)


def _load_and_serve(
    args: argparse.Namespace, keys: tuple[str, ...], sock: socket.socket | None,
    attach: Attach | None,
) -> int:  # fmt: skip
    """Load the checkpoint; rank 0 serves HTTP on `sock`, the other ranks follow."""
    # why here: torch-heavy modules load after the flags are parsed (a quick --help)
    import uvicorn

    from gigatron.inference.load import load_for_inference, run_on_engine
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
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
        uvicorn.Server(config).run(sockets=[sock])
        return 0

    try:
        if attach is not None:
            attach(loaded, args)
        return run_on_engine(loaded, args, serve)
    finally:
        destroy(loaded.pctx)
