#!/bin/bash
# Pretrain a small GPT (12 layers, hidden 768: GPT-2 124M shape) with Megatron-LM's flags.
#
#   bash examples/pretrain_gpt_small.sh <checkpoint dir> <vocab.json> <merges.txt> <data prefix>
#
# The data prefix comes from `gigatron preprocess ... --append-eod` (files <prefix>.bin/.idx).
# Set GPUS_PER_NODE / NNODES / NODE_RANK / MASTER_ADDR for more processes; on a CPU-only
# machine the same script runs on Gloo (set GPUS_PER_NODE to the number of processes).
# Without arguments it trains on synthetic tokens (--mock-data), which needs no files.
set -euo pipefail

CHECKPOINT_PATH=${1:-checkpoints/gpt-small}
VOCAB_FILE=${2:-}
MERGE_FILE=${3:-}
DATA_PATH=${4:-}

GPUS_PER_NODE=${GPUS_PER_NODE:-1}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
)

GPT_MODEL_ARGS=(
    --num-layers 12
    --hidden-size 768
    --num-attention-heads 12
    --seq-length 1024
    --max-position-embeddings 1024
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

TRAINING_ARGS=(
    --micro-batch-size 8
    --global-batch-size 64
    --train-iters 20000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.02
    --clip-grad 1.0
    --lr 6.0e-4
    --min-lr 6.0e-5
    --lr-decay-style cosine
    --lr-warmup-iters 500
    --exit-signal-handler
)

# bf16 needs a GPU; on a CPU-only machine the run is fp32.
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    TRAINING_ARGS+=(--bf16)
fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
)

if [[ -n "$DATA_PATH" ]]; then
    DATA_ARGS=(
        --data-path "$DATA_PATH"
        --tokenizer-type GPT2BPETokenizer
        --vocab-file "$VOCAB_FILE"
        --merge-file "$MERGE_FILE"
        --split 949,50,1
    )
else
    DATA_ARGS=(--mock-data --vocab-size 50257)
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --save-interval 1000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$CHECKPOINT_PATH/tensorboard"
)

torchrun "${DISTRIBUTED_ARGS[@]}" -m gigatron.cli pretrain gpt \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"
