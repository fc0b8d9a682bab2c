"""Shared by the generation tests: a tiny GPT checkpoint with the GPT-2 tokenizer, the same model
in-process, and a `gigatron serve` process on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import torch

from gigatron.checkpoint.formats import save_checkpoint
from gigatron.data.tokenizers import build_tokenizer
from gigatron.inference.load import build_engine
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext
from gigatron.training.pretrain import parse_pretrain_config
from helpers import DATA, env, gigatron_command

MODEL_FLAGS = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", str(DATA / "gpt2-vocab.json"), "--merge-file", str(DATA / "gpt2-merges.txt"),
    "--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "48", "--micro-batch-size", "1", "--global-batch-size", "1",
    "--train-iters", "1", "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--init-method-std", "0.2", "--seed", "5",
]  # fmt: skip


def save_tiny_checkpoint(
    directory: Path, ckpt_format: str = "torch", prompt_format: str | None = None
) -> None:
    """An untrained GPT with the GPT-2 tokenizer saved as a training checkpoint (iteration 1);
    `prompt_format`: recorded as its fine-tuning's chat template (what `serve` chats with)."""
    chat = (
        [] if prompt_format is None else ["--sft", "--sft-tokenizer-prompt-format", prompt_format]
    )
    cfg = parse_pretrain_config(MODEL_FLAGS + chat, world_size=1)
    pctx = ParallelContext.single()
    tokenizer = build_tokenizer(cfg.tokenizer)
    chunks = build_model(cfg, pctx, vocab_size=tokenizer.vocab_size)
    save_checkpoint(directory, 1, chunks, None, None, pctx, cfg, extra={"gigatron_family": "gpt"},
                    ckpt_format=ckpt_format)  # fmt: skip


def engine_from_checkpoint(directory: Path, max_batch_size: int = 4):
    """(engine, tokenizer) over the checkpoint's weights, in this process."""
    cfg = parse_pretrain_config(MODEL_FLAGS, world_size=1)
    tokenizer = build_tokenizer(cfg.tokenizer)
    chunks = build_model(cfg, ParallelContext.single(), vocab_size=tokenizer.vocab_size)
    path = directory / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    chunks[0].load_state_dict(torch.load(path, weights_only=True)["model"])
    engine = build_engine(chunks, ParallelContext.single(), tokenizer, max_batch_size)
    return engine, tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(load: Path, *flags: str, nproc: int = 1, timeout_s: float = 180.0):
    """(process, base url) of `gigatron serve` once /health answers; raises if it does not.
    A port another process took after `free_port` chose it (torchrun's and Gloo's listening
    sockets take ports too) is refused by the server at once: another port is tried."""
    for _ in range(2):
        try:
            return _start_server_on(free_port(), load, flags, nproc, timeout_s)
        except AssertionError as error:
            if "cannot listen there" not in str(error):
                raise
    return _start_server_on(free_port(), load, flags, nproc, timeout_s)


def _start_server_on(port: int, load: Path, flags: tuple, nproc: int, timeout_s: float):
    command = gigatron_command("serve", "--load", str(load), "--device", "cpu",
                               "--host", "127.0.0.1", "--port", str(port), *flags, nproc=nproc)  # fmt: skip
    process = subprocess.Popen(
        command, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited {process.returncode}:\n{process.stdout.read()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if json.loads(response.read())["ready"]:
                    return process, url
        except OSError:
            time.sleep(0.5)
    output = stop_server(process)
    raise AssertionError(f"the server did not answer /health in {timeout_s:g} s:\n{output}")


def stop_server(process: subprocess.Popen) -> str:
    process.terminate()
    try:
        output, _ = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate(timeout=30)
    return output or ""
