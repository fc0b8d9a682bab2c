"""The T5 family: an encoder-decoder trained on span corruption (Megatron's pretrain_t5), on
samples from sentence-split data with `--vocab-extra-ids` sentinel tokens.

Loss (Megatron's, GPT's loss function): `lm_loss`, the mean cross entropy over the decoder's
real positions of a micro-batch (the labels: per masked span its sentinel and tokens, then
[EOS]).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

from torch import nn

from gigatron.data.batch import get_batch
from gigatron.data.t5_dataset import build_t5_datasets
from gigatron.errors import GigatronError
from gigatron.families.gpt import language_model_loss
from gigatron.families.registry import ModelFamily
from gigatron.families.t5.hf_t5 import T5HFAdapter
from gigatron.models.flops import forward_flops_per_token
from gigatron.models.t5 import build_t5_model, t5_stage_layout
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.pipeline import pipeline_tensor_shape

BATCH_KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask")


def forward_step(
    pctx: ParallelContext, data_iterator: Iterator | None, model: nn.Module
) -> tuple[object, Callable]:
    """One micro-batch through one T5 chunk (schedule contract)."""
    batch = get_batch(data_iterator, pctx, BATCH_KEYS)
    output = model(batch["text_enc"], batch["text_dec"], batch["enc_mask"], batch["dec_mask"])
    # Padded labels are -1 (Megatron's); the loss mask is 0 there.
    labels = batch["labels"].clamp(min=0)
    return output, partial(language_model_loss, labels, batch["loss_mask"], pctx)


def make_forward_step(cfg, pctx: ParallelContext):
    return partial(forward_step, pctx)


def loss_names(cfg) -> tuple[str, ...]:
    return ("lm_loss",)


def build_datasets(cfg, tokenizer, num_samples, pctx=None):
    return build_t5_datasets(cfg, tokenizer, num_samples, pctx)


def flops_per_iteration(cfg, global_batch_size: int, padded_vocab_size: int) -> float:
    """Encoder tokens through the encoder, decoder tokens through the decoder (self-attention,
    cross-attention over the encoder tokens, MLP, logits), times 3 for the backward pass."""
    m = cfg.model
    s_enc, s_dec = m.encoder_seq_length or m.seq_length, m.decoder_seq_length
    encoder_layers = m.encoder_num_layers or m.num_layers
    decoder_layers = m.decoder_num_layers or m.num_layers
    shape = dict(
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        swiglu=m.swiglu or m.geglu,
    )
    encoder = forward_flops_per_token(encoder_layers, seq_length=s_enc, vocab_size=0, **shape)
    decoder = forward_flops_per_token(
        decoder_layers, seq_length=s_dec, vocab_size=padded_vocab_size, **shape
    )
    h, q = m.hidden_size, m.num_attention_heads * m.kv_channels
    kv = 2 * m.num_query_groups * m.kv_channels
    cross = decoder_layers * (s_dec * (2 * h * q + 4 * s_enc * q + 2 * q * h) + s_enc * 2 * h * kv)
    return 3.0 * (encoder * s_enc + decoder * s_dec + cross) * global_batch_size


# Beyond the common core: the encoder-decoder shape, relative positions, the stage split, the
# span-corruption data's masking, and per-token loss averaging.
ACCEPTED_FIELDS = frozenset(
    {
        "encoder_num_layers",
        "decoder_num_layers",
        "encoder_seq_length",
        "decoder_seq_length",
        "position_embedding_type=relative",
        "relative_attention_num_buckets",
        "relative_attention_max_distance",
        "pipeline_model_parallel_split_rank",
        "mask_prob",
        "short_seq_prob",
        "calculate_per_token_loss",
    }
)


def validate(cfg) -> None:
    """What the T5 model and its data need, and what it cannot do yet."""
    m, p = cfg.model, cfg.parallel
    # The cross-attention is T5's own: these would reach the self-attention layers only.
    unsupported = [
        flag
        for value, flag in (
            (m.window_size is not None, "--window-size"),
            (m.softmax_type != "vanilla", f"--softmax-type {m.softmax_type}"),
            (m.qk_layernorm, "--qk-layernorm"),
        )
        if value
    ]
    if unsupported:
        raise GigatronError(
            f"{', '.join(unsupported)}: not built for T5's attention; drop the flag(s) for "
            "gigatron pretrain t5"
        )
    if m.decoder_seq_length is None:
        raise GigatronError(
            "--decoder-seq-length is not set; T5 needs it with --encoder-seq-length "
            "(e.g. 512 and 128)"
        )
    if m.encoder_seq_length is not None and m.seq_length != m.encoder_seq_length:
        raise GigatronError(
            f"--seq-length {m.seq_length} and --encoder-seq-length {m.encoder_seq_length} "
            "differ; give one of them (T5's --seq-length is the encoder's)"
        )
    if m.num_layers is None and m.decoder_num_layers is None:
        raise GigatronError("--decoder-num-layers (or --num-layers) is not set")
    if m.position_embedding_type not in ("learned_absolute", "relative"):
        raise GigatronError(
            f"--position-embedding-type {m.position_embedding_type}: T5 has learned_absolute "
            "(Megatron's) or relative (Hugging Face T5) positions"
        )
    longest = max(m.seq_length or 0, m.decoder_seq_length)
    if (
        m.position_embedding_type == "learned_absolute"
        and m.max_position_embeddings is not None
        and m.max_position_embeddings < longest
    ):
        raise GigatronError(
            f"--max-position-embeddings {m.max_position_embeddings} is shorter than the "
            f"longest sequence ({longest}); raise it or leave it out"
        )
    for given, flag in (
        (m.post_layernorm, "--post-layernorm"),
        (m.apply_residual_connection_post_layernorm, "--apply-residual-connection-post-layernorm"),
        (p.context_parallel_size > 1, "--context-parallel-size > 1"),
        (bool(p.num_virtual_stages_per_pipeline_rank), "virtual pipeline stages"),
        (p.num_layers_per_virtual_pipeline_stage is not None, "virtual pipeline stages"),
        (p.decoder_first_pipeline_num_layers is not None, "--decoder-first-pipeline-num-layers"),
        (p.decoder_last_pipeline_num_layers is not None, "--decoder-last-pipeline-num-layers"),
    ):
        if given:
            raise GigatronError(
                f"{flag}: not available for T5 (pre-norm dense layers, no context parallelism, "
                "one pipeline chunk per stage); drop it for gigatron pretrain t5"
            )
    tp = p.tensor_model_parallel_size
    if p.sequence_parallel and tp > 1:
        for length, flag in ((m.seq_length, "--encoder-seq-length"), (m.decoder_seq_length, "--decoder-seq-length")):  # fmt: skip
            if length % tp:
                raise GigatronError(
                    f"{flag} {length} is not divisible by --tensor-model-parallel-size {tp}; "
                    "sequence parallelism splits both sequences over tp"
                )
    _validate_pipeline(cfg)


def _validate_pipeline(cfg) -> None:
    p = cfg.parallel
    pp, split = p.pipeline_model_parallel_size, p.pipeline_model_parallel_split_rank
    if split is not None and not 0 < split < pp:
        raise GigatronError(
            f"--pipeline-model-parallel-split-rank {split}: must lie in 1..{pp - 1} "
            f"(stages below it hold the encoder) with --pipeline-model-parallel-size {pp}"
        )
    if pp == 1:
        return
    if split is None:
        # Megatron's T5 needs the split rank; gigatron splits the stages evenly without it.
        split = p.pipeline_model_parallel_split_rank = pp // 2
    m = cfg.model
    encoder_layers = m.encoder_num_layers or m.num_layers
    decoder_layers = m.decoder_num_layers or m.num_layers
    if encoder_layers < split or decoder_layers < pp - split:
        raise GigatronError(
            f"--pipeline-model-parallel-split-rank {split}: the {encoder_layers} encoder layers "
            f"and {decoder_layers} decoder layers cannot give every one of the {split} encoder "
            f"and {pp - split} decoder stages a layer; change the split or the layer counts"
        )
    if m.untie_embeddings_and_output_weights:
        raise GigatronError(
            "--untie-embeddings-and-output-weights with --pipeline-model-parallel-size > 1: T5 "
            "pipelines keep the output layer tied to the embedding; drop the flag"
        )
    if m.position_embedding_type == "relative" and (split > 1 or pp - split > 1):
        raise GigatronError(
            f"--position-embedding-type relative with --pipeline-model-parallel-size {pp}: each "
            "stack's relative position table must live on one stage; use "
            "--pipeline-model-parallel-size 2 (encoder | decoder)"
        )


def pipeline_stage_shapes(cfg, pctx: ParallelContext):
    """What each T5 stage sends forward: [encoder hidden] from encoder stages, [decoder hidden,
    encoder output] from decoder stages (shapes [seq(/tp with SP), micro-batch, hidden])."""
    m, p = cfg.model, cfg.parallel
    layout = t5_stage_layout(
        pctx.pp_size,
        p.pipeline_model_parallel_split_rank,
        m.encoder_num_layers or m.num_layers,
        m.decoder_num_layers or m.num_layers,
    )
    common = dict(
        micro_batch_size=cfg.training.micro_batch_size,
        hidden_size=m.hidden_size,
        tp_size=pctx.tp_size,
        sequence_parallel=cfg.parallel.sequence_parallel,
    )
    encoder = pipeline_tensor_shape(m.encoder_seq_length or m.seq_length, **common)
    decoder = pipeline_tensor_shape(m.decoder_seq_length, **common)

    def stage_shapes(stage: int) -> list[tuple[int, ...]]:
        return [encoder] if layout[stage][1] is None else [decoder, encoder]

    return stage_shapes


HF_ADAPTER = T5HFAdapter()
DEFAULT_TOKENIZER_TYPE = "BertWordPieceLowerCase"  # Megatron's pretrain_t5.py


FAMILY = ModelFamily.from_namespace(
    globals(),
    description="encoder-decoder, span-corruption pre-training (T5)",
    build_model=build_t5_model,
)
