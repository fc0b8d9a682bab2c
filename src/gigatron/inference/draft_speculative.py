"""Speculative decoding with a separate small draft model (`--speculative-draft-load DIR`, a second
gigatron GPT checkpoint with the target's tokenizer; `--num-speculative-tokens K` drafts a round).

The engine (inference/engine.py) runs it: at a decode step each eligible running sequence gets
K draft tokens from `DraftProposer.propose` (the draft model, one token at a time over its own
static cache, one slot per engine slot), then one target step feeds the pending token and the K
drafts of every such sequence and returns the target's distributions at the K + 1 positions
(`StepPlan.verify`); `verify` (inference/speculative.py, the rejection rule) keeps a prefix of
the drafts and draws the token after it. The output follows the target's sampling distribution
exactly, and at temperature 0 it is exactly the target's greedy tokens.

The draft model runs on the engine's rank (rank 0) as one full copy, whatever the target's
tensor/pipeline layout. Its cache holds the positions it has fed that are still verified: after
a round that accepted `a` of K drafts, the first min(a, K - 1) draft positions stay (the last
draft was never fed) and the next round feeds from there. Attention-only models (a Mamba state
cannot be rewound past a rejected draft).
"""

from __future__ import annotations

import torch
from torch import nn

from gigatron.errors import GigatronError
from gigatron.inference.kv_cache import KVCache
from gigatron.inference.speculative import distributions


class DraftProposer:
    """The draft model's side of speculative decoding (see the module docstring)."""

    def __init__(
        self,
        draft: nn.Module,
        num_speculative_tokens: int,
        vocab_size: int,
        max_batch_size: int,
        max_sequence_length: int,
    ) -> None:
        k = num_speculative_tokens
        if k < 1:
            raise GigatronError(
                f"--num-speculative-tokens {k}: a draft model needs at least 1 draft token per "
                "round; give 1 or more"
            )
        if draft.vocab_size < vocab_size:
            raise GigatronError(
                f"--speculative-draft-load: the draft has {draft.vocab_size} vocabulary entries, "
                f"fewer than the tokenizer's {vocab_size}; it must use the target's tokenizer"
            )
        table = draft.embedding.position_embeddings  # None with rotary positions
        if table is not None and table.num_embeddings < max_sequence_length:
            raise GigatronError(
                f"--speculative-draft-load: the draft has learned positions for "
                f"{table.num_embeddings} tokens, the target generates up to "
                f"{max_sequence_length}; lower --max-sequence-length"
            )
        self.cache = KVCache([draft], max_batch_size, max_sequence_length)
        if self.cache.mamba is not None:
            raise GigatronError(
                "--speculative-draft-load: the draft has Mamba layers, whose recurrent state "
                "cannot be rewound past a rejected draft; use an attention-only draft model"
            )
        self.draft = draft.eval()
        self.k = k
        self.vocab_size = vocab_size
        self.fed = [0] * max_batch_size  # per slot: positions of the draft's cache still valid

    def start(self, slot: int) -> None:
        """A new sequence takes `slot`: nothing of it is cached yet."""
        self.fed[slot] = 0

    @torch.inference_mode()
    def propose(
        self,
        slots: list[int],
        histories: list[list[int]],
        sampling: list[tuple[float, int]],
        generators: list[torch.Generator],
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """K drafts per row and the distributions [K, V] (CPU) they were drawn from. Row r holds
        `histories[r]` (prompt and verified tokens) in `slots[r]`; it samples with
        `sampling[r]` = (temperature, top_k) and `generators[r]`."""
        drafts: list[list[int]] = [[] for _ in slots]
        rows: list[list[torch.Tensor]] = [[] for _ in slots]
        pieces = [h[self.fed[s] :] for s, h in zip(slots, histories)]
        for _ in range(self.k):
            logits = self._forward(slots, pieces)
            for r, slot in enumerate(slots):
                self.fed[slot] += len(pieces[r])
                temperature, top_k = sampling[r]
                q = distributions(logits[r : r + 1], self.vocab_size, temperature, top_k)[0].cpu()
                rows[r].append(q)
                drafts[r].append(int(torch.multinomial(q, 1, generator=generators[r])))
            pieces = [[d[-1]] for d in drafts]
        return drafts, [torch.stack(q) for q in rows]

    def settle(self, slot: int, verified: int, accepted: int) -> None:
        """After a round of a sequence that held `verified` tokens: `accepted` drafts kept."""
        self.fed[slot] = verified + min(accepted, self.k - 1)

    def _forward(self, slots: list[int], pieces: list[list[int]]) -> torch.Tensor:
        """The draft's logits [b, V] at each row's last token, `pieces[r]` fed right-padded."""
        starts = [self.fed[s] for s in slots]
        width = max(len(p) for p in pieces)
        self.cache.begin_step(slots, starts, [len(p) for p in pieces], width)
        padded = [p + [0] * (width - len(p)) for p in pieces]
        ids = torch.tensor(padded, dtype=torch.long, device=self.cache.device)
        positions = self.cache.position_ids(starts, width)
        return self.draft(ids, positions, inference_cache=self.cache)[:, 0]
