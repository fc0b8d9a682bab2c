"""One forward step of generation on this rank: the model chunk, the KV cache, pipeline
point-to-point transfers, and (on the last stage) the choice of tokens.

Every rank of the model-parallel group runs the same `StepPlan`s in the same order. Rank 0 makes
them (the engine's scheduler) and broadcasts each one; the other ranks follow
(`ModelRunner.follow`). A first stage embeds the plan's tokens; a middle stage receives hidden
states from the previous stage and sends its own to the next; the last stage's tensor-parallel
ranks choose the tokens together from vocab-sharded logits (`sampling`), and the result goes to
every rank (rank 0 needs it for the scheduler).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from gigatron.errors import GigatronError
from gigatron.inference import sampling
from gigatron.inference.kv_cache import KVCache
from gigatron.inference.paged_kv import PagedKVCache, kv_bytes_per_block
from gigatron.inference.sampling import RowSampling
from gigatron.inference.speculative import distributions
from gigatron.parallel.context import ParallelContext


@dataclass
class StepPlan:
    """One forward step: row r feeds `tokens[r]` into cache slot `slots[r]` at positions
    `starts[r]...`, then picks its next token with `sampling[r]`. `prompt_log_probs`: also return
    the log-prob of every fed token given the ones before (prefill from position 0 only).
    `top_n`: also return the n likeliest tokens of each chosen position. `stop`: followers leave
    their loop. `block_tables` (paged cache): each row's KV blocks; `packed`: the rows' tokens
    in one row without padding (`inference.paged_kv`). `copy_slots` (beam search, static cache):
    before the step, slot i takes the cache of slot `copy_slots[i]`. `verify` (speculative
    decoding): no token is chosen; the result carries each row's sampling distribution at every
    fed position instead (inference/draft_speculative.py)."""

    slots: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    sampling: list[RowSampling] = field(default_factory=list)
    prompt_log_probs: bool = False
    top_n: int = 0
    stop: bool = False
    block_tables: list[list[int]] | None = None
    packed: bool = False
    copy_slots: list[int] | None = None
    verify: bool = False


@dataclass
class StepResult:
    """Per row: the chosen token, its log-prob, the top-n (id, log-prob) pairs, and (with
    `prompt_log_probs`) the log-probs of the fed tokens after the first. A `verify` step:
    per row the distributions [fed tokens, V] (CPU) instead of tokens."""

    tokens: list[int]
    log_probs: list[float]
    top: list[list[tuple[int, float]]] | None = None
    prompt_log_probs: list[list[float]] | None = None
    distributions: list[torch.Tensor] | None = None


class ModelRunner:
    """Runs `StepPlan`s through this rank's model chunk with a `KVCache` of `max_batch_size`
    slots x `max_sequence_length` positions, or, given `block_size`, a `PagedKVCache` of
    `max_batch_size` request slots and as many blocks as `kv_buffer_bytes` hold on the rank
    with the least room (default: as many positions as the static cache)."""

    def __init__(
        self,
        model_chunks: list[nn.Module],
        pctx: ParallelContext,
        vocab_size: int,
        max_batch_size: int,
        max_sequence_length: int,
        block_size: int | None = None,
        kv_buffer_bytes: int | None = None,
    ) -> None:
        if len(model_chunks) != 1:
            raise GigatronError(
                "generation: virtual pipeline stages (several model chunks per rank) are not "
                "supported; convert the checkpoint with gigatron convert-checkpoint without "
                "--target-num-virtual-stages-per-pipeline-rank"
            )
        if pctx.dp_size * pctx.cp_size != 1:
            raise GigatronError(
                f"generation runs on tensor x pipeline parallel ranks only; this run has "
                f"data-parallel {pctx.dp_size} and context-parallel {pctx.cp_size}: start "
                "tensor-parallel x pipeline-parallel processes"
            )
        self.model = model_chunks[0].eval()
        self.pctx = pctx
        self.vocab_size = vocab_size
        self.config = self.model.config
        if block_size is None:
            self.cache = KVCache(model_chunks, max_batch_size, max_sequence_length)
        else:
            blocks = self._agreed_blocks(
                model_chunks, block_size, kv_buffer_bytes, max_batch_size, max_sequence_length
            )
            self.cache = PagedKVCache(model_chunks, max_batch_size, blocks, block_size)
        self.paged = block_size is not None
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.device = self.cache.device
        grid = pctx.grid
        self.result_source = grid.rank_of(tp=0, cp=0, dp=0, pp=pctx.pp_size - 1)
        # The server's engine thread and the main thread may both release the followers: one
        # step's collectives at a time, and one stop plan (a second would wait forever).
        self._step_lock = threading.Lock()
        self._followers_released = False

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan | None) -> StepResult | None:
        """Rank 0 passes the plan (broadcast to every rank); the others pass None and receive
        it. Returns the step's result on every rank (None for a `stop` plan)."""
        with self._step_lock:
            return self._execute(plan)

    def _execute(self, plan: StepPlan | None) -> StepResult | None:
        plan = self._share(plan, source=0)
        if plan.stop:
            return None
        lengths = [len(t) for t in plan.tokens]
        if plan.copy_slots:
            self.cache.copy_slots(plan.copy_slots)
        tokens, positions = self._inputs(plan, lengths)
        pctx = self.pctx
        hidden_shape = (tokens.shape[1], tokens.shape[0], self.config.hidden_size)
        if not pctx.is_pipeline_first_stage():
            received = torch.empty(hidden_shape, dtype=self.config.params_dtype, device=self.device)
            dist.recv(received, src=pctx.prev_pipeline_rank)
            self.model.set_input_tensor(received)
        output = self.model(tokens, positions, inference_cache=self.cache)
        result = None
        if not pctx.is_pipeline_last_stage():
            dist.send(output.contiguous(), dst=pctx.next_pipeline_rank)
        else:
            result = self._choose(output, plan, tokens, lengths)
        return self._share(result, source=self.result_source)

    def follow(self) -> None:
        """Ranks other than 0: run the plans rank 0 broadcasts until a `stop` plan."""
        while self.execute(None) is not None:
            pass

    def stop_followers(self) -> None:
        """Rank 0: release the followers' loops (once; later calls do nothing)."""
        with self._step_lock:
            if self.pctx.world_size > 1 and not self._followers_released:
                self._followers_released = True
                self._execute(StepPlan(stop=True))

    # ---- helpers --------------------------------------------------------------------------
    def _inputs(self, plan: StepPlan, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (tokens, position ids), with the cache ready for it."""
        if self.paged:
            return self.cache.begin_step(
                plan.slots, plan.starts, plan.tokens, plan.block_tables, plan.packed,
                all_logits=plan.prompt_log_probs or plan.verify,
            )  # fmt: skip
        width = max(lengths)
        tokens = torch.zeros(len(plan.tokens), width, dtype=torch.long, device=self.device)
        for row, ids in enumerate(plan.tokens):
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        self.cache.begin_step(
            plan.slots, plan.starts, lengths, width, all_logits=plan.prompt_log_probs or plan.verify
        )
        return tokens, self.cache.position_ids(plan.starts, width)

    def _agreed_blocks(
        self, chunks, block_size: int, buffer_bytes: int | None, requests: int, length: int
    ) -> int:
        """Blocks of the paged cache, the same on every rank: what `buffer_bytes` holds on the
        rank whose layers take the most per block (+1, the scratch block)."""
        if buffer_bytes is None:
            return requests * -(-length // block_size) + 1
        per_block = kv_bytes_per_block(chunks, block_size)
        blocks = buffer_bytes // per_block if per_block else requests * -(-length // block_size)
        if self.pctx.world_size > 1:
            box = torch.tensor([blocks], device=next(chunks[0].parameters()).device)
            dist.all_reduce(box, op=dist.ReduceOp.MIN)
            blocks = int(box)
        if blocks < 2:
            raise GigatronError(
                f"--inference-dynamic-batching-buffer-size-gb {buffer_bytes / 2**30:g}: holds "
                f"{blocks} KV block(s) of {block_size} tokens ({per_block} bytes each); give "
                "more memory or a smaller --inference-dynamic-batching-block-size"
            )
        return int(blocks)

    def _share(self, value, source: int):
        if self.pctx.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=source)
        return box[0]

    def _choose(self, output, plan: StepPlan, tokens, lengths) -> StepResult:
        pctx = self.pctx
        logits = output  # [b, n', V/tp]
        if plan.verify:
            return self._distributions(logits, plan, lengths)
        prompt_lp = None
        if plan.prompt_log_probs:
            prompt_lp = self._prompt_log_probs(logits, tokens, lengths)
            rows = torch.arange(logits.shape[0], device=logits.device)
            last = torch.tensor(lengths, device=logits.device) - 1
            logits = logits[rows, last]
        else:
            logits = logits[:, 0]
        logits = sampling.mask_vocabulary(logits, self.vocab_size, pctx)
        chosen = sampling.choose_tokens(logits, plan.sampling, pctx, self.vocab_size)
        log_probs = sampling.token_log_probs(logits, chosen, pctx)
        top = None
        if plan.top_n > 0:
            values, ids = sampling.top_log_probs(logits, plan.top_n, pctx)
            top = [list(zip(ids[r].tolist(), values[r].tolist())) for r in range(logits.shape[0])]
        return StepResult(chosen.tolist(), log_probs.tolist(), top, prompt_lp)

    def _distributions(self, logits, plan: StepPlan, lengths: list[int]) -> StepResult:
        """Each row's sampling distributions at its fed positions (the whole vocabulary
        gathered from the tensor-parallel ranks)."""
        full = sampling.gather_vocabulary(logits, self.pctx)
        rows = [
            distributions(full[r, :n], self.vocab_size, row.temperature, row.top_k).cpu()
            for r, (n, row) in enumerate(zip(lengths, plan.sampling))
        ]
        return StepResult([], [], distributions=rows)

    def _prompt_log_probs(self, logits, tokens, lengths) -> list[list[float]]:
        batch, width, local = logits.shape
        flat = sampling.mask_vocabulary(
            logits.reshape(batch * width, local), self.vocab_size, self.pctx
        )
        targets = torch.roll(tokens, -1, dims=1).reshape(-1)
        values = sampling.token_log_probs(flat, targets, self.pctx).view(batch, width)
        return [values[r, : lengths[r] - 1].tolist() for r in range(batch)]
