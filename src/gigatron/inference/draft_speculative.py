"""Speculative decoding with a separate small draft model (`--speculative-draft-load DIR`, a second
gigatron GPT checkpoint with the target's tokenizer; `--num-speculative-tokens K` drafts a round).

Each round the draft model proposes K tokens one at a time from its own key/value cache, then
one forward of the target model over the pending token and the K drafts verifies them all with
the rejection rule of inference/speculative.py (`verify`): the output follows the target's
sampling distribution exactly, and at temperature 0 it is exactly the target's greedy tokens.

Several sequences run together, one static-cache slot each in both models: a round is K draft
steps and one target step over every unfinished sequence (right-padded where their pending
lengths differ). The target's cache holds every verified position but the last token; the
draft's holds the verified positions it has fed (a rejected draft's position is written again
by the next round). One process; attention-only models (a Mamba state cannot be rewound).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from gigatron.errors import GigatronError
from gigatron.inference.kv_cache import KVCache
from gigatron.inference.speculative import (
    SpeculativeResult,
    distributions,
    settle_output,
    verify,
)


@dataclasses.dataclass
class _Row:
    """One sequence: its tokens (prompt + verified), the target positions fed (all but the last
    token), the draft positions fed, and its own random generator."""

    slot: int
    tokens: list[int]
    fed: int
    draft_fed: int
    generator: torch.Generator
    result: SpeculativeResult


class DraftModelSpeculator:
    """Generation by `target` with drafts of `draft` (see the module docstring)."""

    def __init__(
        self, target: nn.Module, draft: nn.Module, num_speculative_tokens: int, vocab_size: int
    ) -> None:
        if num_speculative_tokens < 1:
            raise GigatronError(
                f"--num-speculative-tokens {num_speculative_tokens}: a draft model needs at "
                "least 1 draft token per round; give 1 or more"
            )
        for name, model in (("--load", target), ("--speculative-draft-load", draft)):
            if model.vocab_size < vocab_size:
                raise GigatronError(
                    f"{name}: the model has {model.vocab_size} vocabulary entries, fewer than "
                    f"the tokenizer's {vocab_size}; the draft must use the target's tokenizer"
                )
        self.target, self.draft = target, draft
        self.k = num_speculative_tokens
        self.vocab_size = vocab_size

    @staticmethod
    def _forward(model, cache, rows, starts, pieces: list[list[int]], all_logits: bool):
        """Logits [b, n, V] (all positions) or [b, V] (each row's last token) of `model` fed
        `pieces[r]` at row r's cache slot from `starts[r]`, right-padded."""
        width = max(len(p) for p in pieces)
        cache.begin_step(
            [r.slot for r in rows], starts, [len(p) for p in pieces], width, all_logits
        )
        padded = [p + [0] * (width - len(p)) for p in pieces]
        ids = torch.tensor(padded, dtype=torch.long, device=cache.device)
        logits = model(ids, cache.position_ids(starts, width), inference_cache=cache)
        return logits if all_logits else logits[:, 0]

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        seeds: list[int] | None = None,
        eos_id: int | None = None,
    ) -> list[SpeculativeResult]:
        """`max_tokens` tokens after each prompt (fewer at `eos_id`, not included); prompt i
        samples with `seeds[i]` (default i)."""
        if any(not p for p in prompts):
            raise GigatronError("speculative decoding: an empty prompt; give at least one token")
        longest = max(len(p) for p in prompts) + max_tokens + self.k + 1
        for name, model in (("--load", self.target), ("--speculative-draft-load", self.draft)):
            check_positions(model, name, longest - 1)
        caches = [KVCache([m], len(prompts), longest) for m in (self.target, self.draft)]
        if any(c.mamba is not None for c in caches):
            raise GigatronError(
                "speculative decoding with a draft model: a model has Mamba layers, whose "
                "recurrent state cannot be rewound past rejected drafts; use attention-only models"
            )
        probs = functools.partial(
            distributions, vocab_size=self.vocab_size, temperature=temperature, top_k=top_k
        )
        seeds = seeds if seeds is not None else list(range(len(prompts)))
        rows = [
            _Row(i, list(p), 0, 0, torch.Generator().manual_seed(seed),
                 SpeculativeResult([], "length", 0, 0, 0))
            for i, (p, seed) in enumerate(zip(prompts, seeds))
        ]  # fmt: skip
        first = probs(self._forward(self.target, caches[0], rows, [0] * len(rows), prompts, False))
        for row, p in zip(rows, first):
            row.tokens.append(int(torch.multinomial(p, 1, generator=row.generator)))
            row.fed = len(row.tokens) - 1
        active = [r for r in rows if not _finished(r, len(prompts[r.slot]), max_tokens, eos_id)]
        while active:
            self._round(caches, active, probs)
            active = [
                r for r in active if not _finished(r, len(prompts[r.slot]), max_tokens, eos_id)
            ]
        return [r.result for r in rows]

    def _round(self, caches: list[KVCache], rows: list[_Row], probs) -> None:
        """K drafts per row, one target step verifying them, the accepted tokens appended."""
        drafts: list[list[int]] = [[] for _ in rows]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in rows]
        pieces = [r.tokens[r.draft_fed :] for r in rows]
        for _ in range(self.k):
            starts = [r.draft_fed for r in rows]
            q = probs(self._forward(self.draft, caches[1], rows, starts, pieces, False))
            for i, row in enumerate(rows):
                row.draft_fed += len(pieces[i])
                draft_probs[i].append(q[i])
                drafts[i].append(int(torch.multinomial(q[i], 1, generator=row.generator)))
            pieces = [[d[-1]] for d in drafts]
        verifying = [r.tokens[r.fed :] + d for r, d in zip(rows, drafts)]
        starts = [r.fed for r in rows]
        target = self._forward(self.target, caches[0], rows, starts, verifying, True)
        for i, row in enumerate(rows):
            p = probs(target[i, : self.k + 1])
            accepted, after = verify(p, torch.stack(draft_probs[i]), drafts[i], row.generator)
            verified = len(row.tokens)
            row.tokens += drafts[i][:accepted] + [after]
            row.fed = len(row.tokens) - 1
            row.draft_fed = verified + min(accepted, self.k - 1)
            row.result.drafted += self.k
            row.result.accepted += accepted
            row.result.rounds += 1


def check_positions(model: nn.Module, flag: str, last_position: int) -> None:
    """Refuse a request that would feed a position past the model's learned position table."""
    table = model.embedding.position_embeddings  # None with rotary positions
    if table is not None and last_position >= table.num_embeddings:
        raise GigatronError(
            f"speculative decoding: prompt + --max-tokens + --num-speculative-tokens = "
            f"{last_position + 1} positions, past the {flag} model's {table.num_embeddings}; "
            "shorten the prompt or lower --max-tokens"
        )


def _finished(row: _Row, prompt: int, limit: int, eos: int | None) -> bool:
    return settle_output(row.result, row.tokens[prompt:], limit, eos)
