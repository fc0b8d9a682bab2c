"""Write tests/data/retro-fixture/ with Megatron-Core 0.12.3's RetroModel on CPU (run offline, once).

    git -C <Megatron-LM git dir> archive core_v0.12.3 megatron/core | tar -x -C /tmp/mc0123
    PYTHONPATH=/tmp/mc0123 python tests/tools/make_retro_fixture.py tests/data/retro-fixture

Megatron-Core's local (non Transformer Engine) layer specs, torch norms (no Apex), one process
on Gloo. The model: 6 layers (layer 6 has the chunked cross-attention and the 2-layer neighbour
encoder), hidden 32, 4 heads, ffn 64, learned absolute positions, tied output layer; chunks of 4
tokens, 2 neighbours of 2 chunks. Saved: the weights under Megatron's names, the tokens, the
neighbour tokens [b, l, k, r] and Megatron's logits (model.safetensors), the shape (config.json).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPE = dict(
    num_layers=6, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=96,
    seq_length=16, chunk_length=4, num_neighbors=2, num_retrieved_chunks=2, batch=2,
)  # fmt: skip


def build():
    from megatron.core import parallel_state
    from megatron.core import utils as core_utils
    from megatron.core.models.retro import RetroConfig, RetroModel, get_retro_decoder_block_spec
    from megatron.core.models.retro import config as retro_config
    from megatron.core.tensor_parallel import random as core_random

    # RetroConfig asks Transformer Engine's version (to check its attention backends' variables);
    # without Transformer Engine installed that import fails: there is no TE here to check.
    retro_config.is_te_min_version = lambda version: False
    # The unfused attention's scratch buffer is allocated on the current CUDA device; on a CPU
    # an empty CPU tensor serves (baddbmm reads it with beta 0).
    core_utils.GlobalMemoryBuffer.get_tensor = lambda self, shape, dtype, name: torch.empty(
        shape, dtype=dtype
    )
    # Dropout is 0 and the CUDA generator the attention forks does not exist on a CPU.
    core_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    s = SHAPE
    config = RetroConfig(
        num_layers=s["num_layers"], hidden_size=s["hidden_size"],
        num_attention_heads=s["num_attention_heads"], ffn_hidden_size=s["ffn_hidden_size"],
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        init_method_std=0.2, bias_dropout_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        retro_chunk_length=s["chunk_length"], retro_num_neighbors=s["num_neighbors"],
        retro_num_retrieved_chunks=s["num_retrieved_chunks"], retro_encoder_num_layers=2,
        retro_encoder_hidden_dropout=0.0, retro_encoder_attention_dropout=0.0,
        retro_split_preprocessing="98,2,0",
    )  # fmt: skip
    torch.manual_seed(1234)
    model = RetroModel(
        config=config,
        transformer_layer_spec=get_retro_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=s["vocab_size"],
        max_sequence_length=s["seq_length"],
        position_embedding_type="learned_absolute",
    ).eval()
    with torch.no_grad():  # biases and norms away from 0 / 1, so a misplaced one shows
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.normal_(1.0 if "layernorm" in name and "weight" in name else 0.0, 0.1)
    return model


def main(out: Path) -> None:
    s = SHAPE
    model = build()
    g = torch.Generator().manual_seed(0)
    batch, seq, chunk = s["batch"], s["seq_length"], s["chunk_length"]
    retrieved = chunk * s["num_retrieved_chunks"]
    tokens = torch.randint(0, s["vocab_size"], (batch, seq), generator=g)
    neighbours = torch.randint(
        0, s["vocab_size"], (batch, seq // chunk, s["num_neighbors"], retrieved), generator=g
    )
    # As pretrain_retro.py's get_batch: positions 0.., a causal mask (True = masked), the
    # neighbours as [b * l * k, r] with positions 0..r-1 and no mask.
    positions = torch.arange(seq).expand(batch, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    context = neighbours.reshape(-1, retrieved)
    context_positions = torch.arange(retrieved).expand_as(context)
    with torch.no_grad():
        logits = model(
            tokens, positions, mask, context_input_ids=context,
            context_position_ids=context_positions, context_mask=None,
        )  # fmt: skip
    tensors = {
        f"weights/{k}": v.detach().contiguous()
        for k, v in model.state_dict().items()
        if "_extra_state" not in k and v is not None
    }
    tensors.update(tokens=tokens, neighbour_tokens=neighbours, logits=logits.contiguous())
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(SHAPE, indent=1) + "\n")
    print(f"wrote {out}: logits {tuple(logits.shape)}, {len(tensors)} tensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
