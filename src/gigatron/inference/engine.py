"""The generation engine: requests, per-sequence stopping, and continuous batching.

Requests wait in a queue. Each `step()` is one forward step of the model: when a cache slot is
free and requests wait, the waiting ones (as many as there are free slots) are prefilled
together, prompts of different lengths right-padded in one batch; otherwise every running
sequence decodes one token. A sequence stops on its own (end-of-document / stop token, stop
string, end of line, `max_tokens`, the cache's length) and frees its slot at once, so a queued
request joins at the next step boundary. `submit` and `cancel` are thread-safe: a server thread
submits while another thread runs `step()` in a loop (`serve_forever`).

With a `DraftProposer` (speculative decoding with a draft model) a decode step first drafts K
tokens per eligible sequence, then one target step verifies them (inference/draft_speculative.py).

With a `BlockScheduler` (the dynamic engine, over a runner with a paged KV cache) the scheduler
builds each step instead: decode tokens, prefill chunks and newcomers together under a token
budget, KV memory admitted by blocks, preemption when blocks run out (inference/scheduler.py).
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from gigatron.errors import GigatronError
from gigatron.inference.beam import Beam, beam_search
from gigatron.inference.draft_speculative import DraftProposer
from gigatron.inference.runner import ModelRunner, StepPlan, StepResult
from gigatron.inference.sampling import RowSampling
from gigatron.inference.scheduler import BlockScheduler, packing_pays
from gigatron.inference.speculative import verify


@dataclass
class SamplingParams:
    """What one request asks for. `temperature` 0 is greedy; `top_p` 0 or 1 is off; `seed`
    None draws one. `stop_token_ids` end the sequence and are not part of the output (unless
    `ignore_eos`); `stop` strings end it and are cut from the text. `stop_on_eol`: stop after a
    token holding a newline; `stop_on_double_eol`: after an empty line. `top_p_decay` /
    `top_p_bound`: after each token top_p becomes max(top_p * decay, bound) (Megatron's).
    `prevent_newline_after_colon`: no newline token right after a token ending in ':'.
    `logprobs`: log-probs of the generated tokens; `prompt_logprobs`: of the prompt's tokens
    after the first; `top_logprobs`: the n likeliest tokens at each generated position.
    `beam_width` >= 1: beam search (inference/beam.py; 0: none) with `length_penalty` and
    `early_stopping` (True, False or "never", Hugging Face's meanings); the request runs alone."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    prevent_newline_after_colon: bool = False
    logprobs: bool = False
    prompt_logprobs: bool = False
    top_logprobs: int = 0
    beam_width: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def validate(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.top_p <= 1:
            raise ValueError("top_p must be in [0, 1]")
        if self.top_logprobs < 0:
            raise ValueError("top_logprobs must be >= 0")
        if self.beam_width < 0:
            raise ValueError("beam_width must be >= 0")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError('early_stopping must be true, false or "never"')
        beam_only = (self.stop or self.logprobs or self.prompt_logprobs or self.top_logprobs
                     or self.stop_on_eol or self.stop_on_double_eol)  # fmt: skip
        if self.beam_width >= 1 and beam_only:
            raise ValueError(
                "beam search does not take stop strings, end-of-line stops or log-probs"
            )


@dataclass
class Completion:
    """A finished (or, in callbacks, running) sequence. `text` is the generated text only, cut
    at a stop string; `finish_reason` is "stop", "length", "cancelled" or "error"."""

    request_id: int
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    log_probs: list[float] = field(default_factory=list)
    top_log_probs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_log_probs: list[float] | None = None
    beams: list[Beam] = field(default_factory=list)  # beam search: every hypothesis, best first
    drafted: int = 0  # speculative decoding: draft tokens proposed
    accepted: int = 0  # and accepted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Sequence:
    completion: Completion
    params: SamplingParams
    seed: int
    on_update: Callable[[Completion], None] | None
    slot: int = -1
    cached: int = 0  # tokens in the cache
    pending: int | None = None  # the last chosen token, fed at the next decode step
    top_p: float = 0.0
    cancelled: bool = False
    cut_text: str | None = None  # the text up to a stop string, when one ended it
    blocks: list[int] = field(default_factory=list)  # paged cache: the KV block table
    order: int = 0  # paged cache: admission order (the newest is preempted first)
    generator: torch.Generator | None = None  # speculative decoding's draws

    def tokens(self) -> list[int]:
        """Prompt and generated tokens: what the cache must hold (a preempted request is
        recomputed from them)."""
        return self.completion.prompt_ids + self.completion.output_ids

    @property
    def wants_whole_prompt(self) -> bool:
        """Prompt log-probs still to compute: the prompt is fed whole, from position 0."""
        return self.params.prompt_logprobs and self.completion.prompt_log_probs is None


class InferenceEngine:
    """Continuous-batching generation over a `ModelRunner` (rank 0 of the model-parallel
    group). `tokenizer` (optional) is needed for stop strings, end-of-line stops and text."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer=None,
        default_stop_token_ids: Sequence[int] = (),
        seed: int = 0,
        scheduler: BlockScheduler | None = None,
        proposer: DraftProposer | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        if proposer is not None and scheduler is not None:
            raise GigatronError(
                "--speculative-draft-load: runs on the static engine; drop "
                "--inference-dynamic-batching"
            )
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.default_stop_token_ids = tuple(default_stop_token_ids)
        self.max_batch_size = runner.max_batch_size
        self.max_sequence_length = runner.max_sequence_length
        self._seeds = random.Random(seed)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[int, _Sequence] = {}  # slot -> sequence
        self._by_id: dict[int, _Sequence] = {}
        self._closed = False
        self._drafted = self._accepted = 0
        self._newline_ids = self._single_token_ids("\n")
        self._colon_texts = (":",)

    # ---- submitting -----------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        on_update: Callable[[Completion], None] | None = None,
    ) -> Completion:
        """Queue a request; returns its `Completion` (filled in as it runs). `on_update` is
        called from the engine's thread after every token and once when it finishes."""
        params = params or SamplingParams()
        params.validate()
        prompt = [int(t) for t in prompt_ids]
        self.check_length(len(prompt), params.max_tokens)
        if any(t < 0 or t >= self.runner.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {self.runner.vocab_size})")
        if (params.stop or params.stop_on_eol or params.stop_on_double_eol) and not self.tokenizer:
            raise ValueError("stop strings and end-of-line stops need a tokenizer")
        if params.beam_width >= 1 and (self.scheduler is not None or
                                      params.beam_width > self.max_batch_size):  # fmt: skip
            raise ValueError(
                f"beam_width {params.beam_width} needs as many cache slots on the static engine "
                f"(this one: {self.max_batch_size} slots"
                f"{', dynamic' if self.scheduler is not None else ''})"
            )
        with self._lock:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
            completion = Completion(next(self._ids), prompt)
            sequence = _Sequence(completion, params, seed, on_update, top_p=params.top_p)
            self._waiting.append(sequence)
            self._by_id[completion.request_id] = sequence
            self._work.notify_all()
        return completion

    def check_length(self, prompt_length: int, max_tokens: int) -> None:
        """ValueError when a prompt does not fit the context with `max_tokens` more tokens (or,
        the dynamic engine, the KV block pool)."""
        limit = self.max_sequence_length
        if prompt_length < 1:
            raise ValueError("the prompt is empty (it needs at least one token)")
        if prompt_length + max(max_tokens, 1) > limit:
            raise ValueError(
                f"the prompt ({prompt_length} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"model's context of {limit} tokens"
            )
        if self.scheduler is not None:
            self.scheduler.check_fits(prompt_length + max_tokens)

    def cancel(self, request_id: int) -> None:
        """Stop a request (e.g. its client went away); its slot is freed at the next step."""
        with self._lock:
            sequence = self._by_id.get(request_id)
            if sequence is not None:
                sequence.cancelled = True
                self._work.notify_all()

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running)

    # ---- running --------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """Generate for every prompt (batched as the slots allow) and return the completions in
        order. Not to be mixed with a running `serve_forever`."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        completions = [self.submit(p, q) for p, q in zip(prompts, params)]
        while self.busy:
            self.step()
        return completions

    def serve_forever(self, stop: threading.Event, idle_wait_s: float = 0.05) -> None:
        """Step while there is work; wait for requests otherwise; return when `stop` is set."""
        while not stop.is_set():
            try:
                worked = self.step()
            except Exception:  # noqa: BLE001 - one failed step must not take the server down
                logging.getLogger("gigatron.inference").exception("generation step failed")
                self._fail_running()
                continue
            if not worked:
                with self._work:
                    if not (self._waiting or self._running) and not stop.is_set():
                        self._work.wait(idle_wait_s)

    def _fail_running(self) -> None:
        with self._lock:
            failed = list(self._running.values())
            self._running.clear()
            for sequence in failed:
                self._by_id.pop(sequence.completion.request_id, None)
                self._release(sequence)
        for sequence in failed:
            sequence.completion.finish_reason = "error"
            self._notify(sequence)

    def stats(self) -> dict[str, int]:
        """Sequences generating now and waiting for a slot (with a paged cache also the KV
        blocks in use and free, prefix-cache hits, evictions and preemptions)."""
        with self._lock:
            numbers = {"running": len(self._running), "waiting": len(self._waiting)}
            if self.proposer is not None:
                numbers.update(
                    speculative_drafted=self._drafted, speculative_accepted=self._accepted
                )
            if self.scheduler is not None:
                pool = self.scheduler.pool
                numbers.update(
                    blocks_in_use=pool.in_use(), blocks_available=pool.available(),
                    **vars(pool.counters),
                )  # fmt: skip
            return numbers

    def close(self) -> None:
        with self._work:
            self._closed = True
            self._work.notify_all()

    def step(self) -> bool:
        """One forward step (prefill of newcomers, else one decode step; the dynamic engine:
        the scheduler's mix). False when idle."""
        self._drop_cancelled()
        if self.scheduler is not None:
            return self._dynamic_step()
        with self._lock:
            free = [s for s in range(self.max_batch_size) if s not in self._running]
            joining = []
            beam = self._waiting[0] if self._waiting and _is_beam(self._waiting[0]) else None
            if beam is not None and not self._running:
                self._waiting.popleft()
                self._running[0] = beam
                beam.slot = 0
            elif beam is not None:
                free = []  # a beam search runs alone: let the running sequences finish
            while free and self._waiting and not _is_beam(self._waiting[0]):
                sequence = self._waiting.popleft()
                sequence.slot = free.pop(0)
                self._running[sequence.slot] = sequence
                joining.append(sequence)
            running = [self._running[s] for s in sorted(self._running) if s not in
                       {q.slot for q in joining}]  # fmt: skip
        if beam is not None and beam.slot == 0:
            self._beam_search(beam)
        elif joining:
            self._prefill(joining)
        elif running:
            self._decode(running)
        else:
            return False
        return True

    def _beam_search(self, sequence: _Sequence) -> None:
        params = sequence.params
        stop_ids = (
            () if params.ignore_eos else (params.stop_token_ids or self.default_stop_token_ids)
        )
        beams = beam_search(
            self.runner, sequence.completion.prompt_ids, params.beam_width, params.max_tokens,
            tuple(stop_ids), params.length_penalty, params.early_stopping,
        )  # fmt: skip
        completion = sequence.completion
        completion.beams = beams
        completion.output_ids = list(beams[0].tokens)
        self._finish(sequence, "stop" if beams[0].stopped else "length")

    def _drop_cancelled(self) -> None:
        finished = []
        with self._lock:
            for sequence in list(self._waiting):
                if sequence.cancelled:
                    self._waiting.remove(sequence)
                    finished.append(sequence)
            for slot, sequence in list(self._running.items()):
                if sequence.cancelled:
                    del self._running[slot]
                    finished.append(sequence)
            for sequence in finished:
                self._by_id.pop(sequence.completion.request_id, None)
                self._release(sequence)
        for sequence in finished:
            sequence.completion.finish_reason = "cancelled"
            self._notify(sequence)

    def _row(self, sequence: _Sequence) -> RowSampling:
        params = sequence.params
        banned: tuple[int, ...] = ()
        if params.prevent_newline_after_colon and self.tokenizer is not None:
            previous = sequence.pending
            if previous is None and sequence.completion.prompt_ids:
                previous = sequence.completion.prompt_ids[-1]
            if previous is not None and self.tokenizer.detokenize([previous]).endswith(":"):
                banned = self._newline_ids
        return RowSampling(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=sequence.top_p,
            seed=sequence.seed,
            step=len(sequence.completion.output_ids),
            banned=banned,
        )

    def _prefill(self, joining: list[_Sequence]) -> None:
        plan = StepPlan(
            slots=[q.slot for q in joining],
            tokens=[q.completion.prompt_ids for q in joining],
            starts=[0] * len(joining),
            sampling=[self._row(q) for q in joining],
            prompt_log_probs=any(q.params.prompt_logprobs for q in joining),
            top_n=max(q.params.top_logprobs for q in joining),
        )
        result = self.runner.execute(plan)
        for row, sequence in enumerate(joining):
            sequence.cached = len(sequence.completion.prompt_ids)
            if self.proposer is not None:
                self.proposer.start(sequence.slot)
            if sequence.params.prompt_logprobs:
                sequence.completion.prompt_log_probs = result.prompt_log_probs[row]
            if sequence.params.max_tokens == 0:
                self._finish(sequence, "length")
                continue
            self._accept(sequence, row, result)

    def _decode(self, running: list[_Sequence]) -> None:
        drafted = [q for q in running if self._speculates(q)]
        if drafted:
            self._speculate(drafted)
        running = [q for q in running if all(q is not d for d in drafted)]
        if not running:
            return
        plan = StepPlan(
            slots=[q.slot for q in running],
            tokens=[[q.pending] for q in running],
            starts=[q.cached for q in running],
            sampling=[self._row(q) for q in running],
            top_n=max(q.params.top_logprobs for q in running),
        )
        result = self.runner.execute(plan)
        for row, sequence in enumerate(running):
            sequence.cached += 1
            self._accept(sequence, row, result)

    def _speculates(self, sequence: _Sequence) -> bool:
        """Whether a decoding sequence takes drafts: a draft model is loaded, the request asks
        nothing the verification step does not give (log-probs, top-p, banned tokens), and its
        K + 1 verified positions fit the cache."""
        params = sequence.params
        return self.proposer is not None and not (
            params.logprobs or params.top_logprobs or sequence.top_p > 0
            or params.prevent_newline_after_colon
            or sequence.cached + self.proposer.k + 1 > self.max_sequence_length
        )  # fmt: skip

    def _speculate(self, rows: list[_Sequence]) -> None:
        """One round of speculative decoding for `rows`: K drafts each, one verifying step."""
        for q in rows:
            if q.generator is None:
                q.generator = torch.Generator().manual_seed(q.seed)
        drafts, draft_probs = self.proposer.propose(
            [q.slot for q in rows], [q.tokens() for q in rows],
            [(q.params.temperature, q.params.top_k) for q in rows], [q.generator for q in rows],
        )  # fmt: skip
        plan = StepPlan(
            slots=[q.slot for q in rows],
            tokens=[[q.pending, *d] for q, d in zip(rows, drafts)],
            starts=[q.cached for q in rows],
            sampling=[self._row(q) for q in rows],
            verify=True,
        )
        target = self.runner.execute(plan).distributions
        for r, sequence in enumerate(rows):
            accepted, after = verify(target[r], draft_probs[r], drafts[r], sequence.generator)
            self.proposer.settle(sequence.slot, len(sequence.tokens()), accepted)
            sequence.completion.drafted += self.proposer.k
            sequence.completion.accepted += accepted
            self._drafted += self.proposer.k
            self._accepted += accepted
            first = sequence.cached
            for i, token in enumerate([*drafts[r][:accepted], after]):
                sequence.cached = first + 1 + i
                if self._take(sequence, token, None, None):
                    break

    def _accept(self, sequence: _Sequence, row: int, result: StepResult) -> None:
        """Take this step's token for `sequence` and decide whether it stops."""
        top = result.top[row] if result.top is not None else None
        self._take(sequence, result.tokens[row], result.log_probs[row], top)

    def _take(self, sequence: _Sequence, token: int, log_prob, top) -> bool:
        """Append `token` (with its log-prob and top-n) to `sequence`; True when it finished."""
        completion, params = sequence.completion, sequence.params
        stop_ids = params.stop_token_ids or self.default_stop_token_ids
        if not params.ignore_eos and token in stop_ids:
            self._finish(sequence, "stop")
            return True
        completion.output_ids.append(token)
        if params.logprobs:
            completion.log_probs.append(log_prob)
        if params.top_logprobs:
            completion.top_log_probs.append(top[: params.top_logprobs])
        sequence.pending = token
        if params.top_p_decay > 0 and sequence.top_p > 0:
            sequence.top_p = max(sequence.top_p * params.top_p_decay, params.top_p_bound)
        reason = self._text_stop(sequence, token)
        if reason is None and len(completion.output_ids) >= params.max_tokens:
            reason = "length"
        if reason is None and sequence.cached + 1 >= self.max_sequence_length:
            reason = "length"
        if reason is not None:
            self._finish(sequence, reason)
            return True
        self._notify(sequence)
        return False

    def _text_stop(self, sequence: _Sequence, token: int) -> str | None:
        params = sequence.params
        if self.tokenizer is None:
            return None
        completion = sequence.completion
        if not (params.stop or params.stop_on_eol or params.stop_on_double_eol):
            return None
        text = self.tokenizer.detokenize(completion.output_ids)
        if params.stop_on_eol and "\n" in self.tokenizer.detokenize([token]):
            return "stop"
        if params.stop_on_double_eol and "\n\n" in text:
            return "stop"
        cut = [text.find(s) for s in params.stop if s and s in text]
        if cut:
            sequence.cut_text = text[: min(cut)]
            return "stop"
        return None

    def _finish(self, sequence: _Sequence, reason: str) -> None:
        completion = sequence.completion
        if sequence.cut_text is not None:
            completion.text = sequence.cut_text
        elif self.tokenizer is not None:
            completion.text = self.tokenizer.detokenize(completion.output_ids)
        completion.finish_reason = reason
        with self._lock:
            self._running.pop(sequence.slot, None)
            self._by_id.pop(completion.request_id, None)
            self._release(sequence)
        self._notify(sequence)

    def _release(self, sequence: _Sequence) -> None:
        """Give a sequence's KV blocks back (the dynamic engine; the lock is held)."""
        if self.scheduler is not None:
            self.scheduler.release(sequence)

    # ---- the dynamic engine ---------------------------------------------------------------
    def _dynamic_step(self) -> bool:
        with self._lock:
            rows = self.scheduler.schedule(self._running, self._waiting)
        if not rows:
            return False
        whole = any(q.wants_whole_prompt for q, _ in rows)
        lengths = [n for _, n in rows]
        ends = [q.cached + n for q, n in rows]
        hidden = self.runner.config.hidden_size
        packed = self.runner.cache.packs and not whole and packing_pays(lengths, ends, hidden)
        plan = StepPlan(
            slots=[q.slot for q, _ in rows],
            tokens=[q.tokens()[q.cached : q.cached + n] for q, n in rows],
            starts=[q.cached for q, _ in rows],
            sampling=[self._row(q) for q, _ in rows],
            prompt_log_probs=whole,
            top_n=max(q.params.top_logprobs for q, _ in rows),
            block_tables=[list(q.blocks) for q, _ in rows],
            packed=packed,
        )
        result = self.runner.execute(plan)
        for sequence, count in rows:
            sequence.cached += count
        with self._lock:
            self.scheduler.after_step(rows)
        for row, (sequence, _) in enumerate(rows):
            if sequence.cached < len(sequence.tokens()):
                continue  # a prefill chunk: its token comes with the prompt's last chunk
            if sequence.wants_whole_prompt:
                sequence.completion.prompt_log_probs = result.prompt_log_probs[row]
            if sequence.params.max_tokens == 0:
                self._finish(sequence, "length")
            else:
                self._accept(sequence, row, result)
        return True

    def _notify(self, sequence: _Sequence) -> None:
        if sequence.on_update is not None:
            sequence.on_update(sequence.completion)

    def _single_token_ids(self, text: str) -> tuple[int, ...]:
        if self.tokenizer is None:
            return ()
        try:
            ids = self.tokenizer.tokenize(text)
        except Exception:  # noqa: BLE001 - a tokenizer without that text: nothing to ban
            return ()
        return tuple(ids) if len(ids) == 1 else ()


def _is_beam(sequence: _Sequence) -> bool:
    return sequence.params.beam_width >= 1


def validate_engine_sizes(max_batch_size: int, max_sequence_length: int) -> None:
    if max_batch_size < 1:
        raise GigatronError(f"--max-batch-size {max_batch_size}: must be at least 1")
    if max_sequence_length < 2:
        raise GigatronError(f"--max-sequence-length {max_sequence_length}: must be at least 2")
