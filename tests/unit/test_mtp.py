"""Multi-token prediction: depth k's logits predict the token k + 1 ahead from tokens up to
position i + k only, the family loss adds scaling / D x the depths' mean losses (checked by
hand with torch's cross entropy) and reports `mtp_loss`; MTP layers follow the decoder's last
layer (an MoE layer there makes them MoE layers, reported after the decoder's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gigatron.config.root import GigatronConfig, parse_config
from gigatron.config.validate import finalize_config
from gigatron.errors import GigatronError
from gigatron.families.gpt import gpt_loss, loss_names
from gigatron.inference.kv_cache import KVCache
from gigatron.models import build_model
from gigatron.models.moe import MoESpec
from gigatron.parallel.context import ParallelContext

VOCAB, SEQ = 50, 8


def _model(depths: int = 2, **extra):
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, SEQ
    m.attention_dropout = m.hidden_dropout = 0.0
    m.mtp_num_layers, m.mtp_loss_scaling_factor = depths, 0.3
    m.position_embedding_type = "rope"
    for key, value in extra.items():
        setattr(cfg.moe if key.startswith(("num_experts", "moe_")) else m, key, value)
    finalize_config(cfg)
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    return cfg, model


def test_depth_logits_see_only_the_tokens_before_their_target():
    _, model = _model(depths=2)
    model.eval()
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 5] = (tokens[0, 5] + 1) % VOCAB
    with torch.no_grad():
        logits, (depth1, depth2) = model(tokens, None)
        other_logits, (other1, other2) = model(changed, None)
    # Depth k at position i reads tokens up to i + k: positions before 5 - k are unchanged.
    torch.testing.assert_close(other_logits[:, :5], logits[:, :5])
    torch.testing.assert_close(other1[:, :4], depth1[:, :4])
    assert not torch.allclose(other1[:, 4], depth1[:, 4])
    torch.testing.assert_close(other2[:, :3], depth2[:, :3])
    assert not torch.allclose(other2[:, 3], depth2[:, 3])


def test_mtp_loss_by_hand():
    cfg, model = _model(depths=2)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    loss_mask = torch.ones(2, SEQ)
    loss_mask[0, 6] = loss_mask[1, 2] = 0.0
    output = model(tokens, None)
    pctx = ParallelContext.single()
    loss, num_tokens, reports = gpt_loss(labels, loss_mask, pctx, 0.3, output)

    logits, depths = output

    def masked_ce(lg, target, mask):
        # The padded vocabulary rows take part in the softmax: the full logits.
        ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), target.reshape(-1), reduction="none")
        return (ce * mask.reshape(-1)).sum(), mask.sum()

    lm_sum, tokens_count = masked_ce(logits, labels, loss_mask)
    means, mtp_sum, mtp_tokens = [], 0.0, 0.0
    for k, depth_logits in enumerate(depths, start=1):
        s, n = masked_ce(depth_logits[:, : SEQ - k], labels[:, k:], loss_mask[:, k:])
        means.append(s / n)
        mtp_sum, mtp_tokens = mtp_sum + s, mtp_tokens + n
    assert num_tokens.item() == 14.0
    expected = lm_sum + 14.0 * 0.3 / 2 * (means[0] + means[1])
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(reports["lm_loss"], torch.stack([lm_sum, tokens_count]).detach())
    # Depth k has s - k targets per row, one of them masked in each row: 2 x 6 + 2 x 5.
    assert mtp_tokens.item() == 12.0 + 10.0
    torch.testing.assert_close(reports["mtp_loss"], torch.stack([mtp_sum, mtp_tokens]).detach())

    loss.backward()
    for name, param in model.named_parameters():
        if name.startswith("mtp."):
            assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert loss_names(cfg) == ("lm_loss", "mtp_loss")


def test_generation_ignores_the_mtp_layers():
    _, model = _model(depths=1)
    model.eval()
    tokens = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, _ = model(tokens, None)
        cache = KVCache([model], max_batch_size=1, max_sequence_length=SEQ)
        cache.begin_step([0], [0], [6], 6, all_logits=True)
        cached = model(tokens, cache.position_ids([0], 6), inference_cache=cache)
    torch.testing.assert_close(cached, logits)


def test_mtp_layers_of_an_moe_model_are_moe_layers():
    cfg, model = _model(depths=1, num_experts=4, moe_router_topk=2, moe_layer_freq="[0,1]")
    assert type(model.mtp.layers[0].mtp_model_layer.mlp).__name__ == "MoELayer"
    assert MoESpec.from_config(cfg).moe_layer_numbers == [2, 3]
    output = model(torch.randint(0, VOCAB, (2, SEQ)), None)
    assert isinstance(output, tuple) and len(output[1]) == 1


def test_mtp_rules():
    with pytest.raises(GigatronError, match="without learned position embeddings"):
        parse_config(["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"])
    with pytest.raises(GigatronError, match="--context-parallel-size 1"):
        parse_config(["--mtp-num-layers", "1", "--context-parallel-size", "2"])
    parse_config(
        ["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2",
         "--position-embedding-type", "rope"]
    )  # fmt: skip
