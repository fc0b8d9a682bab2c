"""A Hugging Face model imported straight into a tensor-parallel 2 x pipeline-parallel 2 layout
loads on 4 ranks (`load_checkpoint`) and gives Hugging Face's loss (1e-4 relative)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from gigatron.checkpoint.hf_convert import hf_to_gigatron
from gigatron.checkpoint.torch_format import load_checkpoint, safe_load
from gigatron.config import config_from_dict
from gigatron.families import get_family
from gigatron.families.gpt import token_losses
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.schedules import ScheduleConfig, forward_backward

VOCAB, SEQ, BATCH, MICROBATCHES = 100, 16, 2, 2
PADDED = 256  # a multiple of 128 x tp 2


def _tokens() -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (MICROBATCHES, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3)
    )


def _run(rank: int, world_size: int, ckpt: str, expected: float) -> None:
    state = safe_load(Path(ckpt) / "release" / "mp_rank_00_000" / "model_optim_rng.pt")
    cfg = config_from_dict(state["args"])
    cfg.model.attention_dropout = cfg.model.hidden_dropout = 0.0
    cfg.model.seq_length = SEQ
    cfg.training.micro_batch_size = BATCH
    pctx = ParallelContext.from_sizes(tp=2, pp=2)
    chunks = get_family("gpt").build_model(cfg, pctx, vocab_size=VOCAB)
    load_checkpoint(ckpt, chunks, None, None, pctx, cfg)
    for chunk in chunks:
        chunk.eval()
    data = _tokens()
    batches = iter(
        {
            "tokens": d[:, :-1],
            "labels": d[:, 1:],
            "position_ids": torch.arange(SEQ).expand(BATCH, SEQ),
        }
        for d in data
    )

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        output = chunk(batch["tokens"], batch["position_ids"])

        def loss_fn(logits):
            losses = token_losses(logits, batch["labels"], pctx).float()
            count = torch.tensor(float(losses.numel()))
            return losses.sum(), count, {"sum": losses.sum().detach(), "count": count}

        return output, loss_fn

    config = ScheduleConfig(
        seq_length=SEQ, micro_batch_size=BATCH, hidden_size=cfg.model.hidden_size
    )
    with torch.no_grad():
        reports = forward_backward(
            forward_step, batches, chunks, MICROBATCHES, pctx, config, forward_only=True
        )
    if pctx.is_pipeline_last_stage():
        loss = (sum(r["sum"] for r in reports) / sum(r["count"] for r in reports)).item()
        assert loss == pytest.approx(expected, rel=1e-4), (rank, loss, expected)


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2-tied"])
def test_tp2_pp2_import_gives_hugging_face_loss(tmp_path, name):
    torch.manual_seed(0)
    if name == "gpt2-tied":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32
        )
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    hf_to_gigatron(tmp_path / "hf", tmp_path / "ckpt", tp=2, pp=2, log=lambda _: None)
    data = _tokens()
    # gigatron's logits also cover the padding rows (zeros: logit 0), vocabulary 100 -> 256
    with torch.no_grad():
        losses = [
            F.cross_entropy(
                F.pad(hf(d[:, :-1]).logits, (0, PADDED - VOCAB)).reshape(-1, PADDED),
                d[:, 1:].reshape(-1),
            )
            for d in data
        ]
    expected = float(sum(losses) / len(losses))
    run_distributed(_run, 4, str(tmp_path / "ckpt"), expected)
