"""Beam search over the static KV cache, with Hugging Face `generate(num_beams=...)`'s rules.

The `beam_width` beams of one prompt occupy cache slots 0 .. beam_width - 1. Each step every
beam's next-token log-probs are added to its score; the best `2 x beam_width` continuations over
all beams are kept (the vocab-parallel top-n of each beam holds them all). A continuation ending
in a stop token among the first `beam_width` of them (or reaching `max_tokens`) becomes a
finished hypothesis scored `score / generated_length ** length_penalty`; the best `beam_width`
other ones go on, each copying its parent's cache slot first (the step's `copy_slots`).

Stopping (`early_stopping`): True stops once `beam_width` hypotheses are finished; False stops
when the best running beam, at its current length, cannot beat the worst finished hypothesis;
"never" (with a positive length penalty) compares at the longest possible length instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from gigatron.inference.runner import ModelRunner, StepPlan
from gigatron.inference.sampling import RowSampling

NEG = -1.0e9  # Hugging Face's score of an impossible beam


@dataclass
class Beam:
    """One hypothesis: generated tokens (a final stop token left out), its length-penalised
    score, and whether a stop token ended it."""

    tokens: list[int]
    score: float
    stopped: bool = False


@dataclass
class _Candidate:
    score: float
    parent: int
    token: int
    hit: bool = False


def beam_search(
    runner: ModelRunner,
    prompt: list[int],
    beam_width: int,
    max_tokens: int,
    stop_ids: tuple[int, ...],
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> list[Beam]:
    """The `beam_width` best hypotheses for `prompt`, best first (see the module docstring)."""
    keep = max(2, 1 + len(stop_ids)) * beam_width
    plan = StepPlan(slots=[0], tokens=[prompt], starts=[0], sampling=[RowSampling(0.0)],
                    top_n=keep)  # fmt: skip
    running = [([], 0.0)]  # (tokens, score) of each live beam
    finished: list[tuple[float, list[int], bool]] = []  # (score, tokens, stopped)
    improvable, generated = True, 0
    while True:
        tops = runner.execute(plan).top
        candidates = sorted(
            (
                _Candidate(score + log_prob, parent, token)
                for parent, (_, score) in enumerate(running)
                for token, log_prob in tops[parent]
            ),
            key=lambda c: -c.score,
        )[:keep]
        for candidate in candidates:
            candidate.hit = candidate.token in stop_ids or generated + 1 >= max_tokens
        full = len(finished) == beam_width and early_stopping is True
        if improvable and not full:
            divisor = (generated + 1) ** length_penalty
            finished = _merge_finished(finished, candidates, running, beam_width, divisor, stop_ids)
        chosen = sorted(candidates, key=lambda c: -(c.score + NEG * c.hit))[:beam_width]
        generated += 1
        best = chosen[0].score + NEG * chosen[0].hit
        length = max_tokens if early_stopping == "never" and length_penalty > 0 else generated
        all_done = len(finished) == beam_width
        worst = min(score for score, _, _ in finished) if all_done else NEG
        improvable = improvable and best / length**length_penalty > worst
        if (
            not improvable
            or (all_done and early_stopping is True)
            or all(c.hit for c in candidates)
        ):
            break
        running = [(running[c.parent][0] + [c.token], c.score + NEG * c.hit) for c in chosen]
        plan = _next_step(chosen, running, len(prompt), generated, keep)
    finished.sort(key=lambda f: -f[0])
    return [Beam(tokens, score, stopped) for score, tokens, stopped in finished]


def _merge_finished(finished, candidates, running, beam_width, divisor, stop_ids) -> list:
    """The best `beam_width` of the finished hypotheses and this step's finishing candidates
    (those among the first `beam_width`), as (score, tokens, stopped)."""
    for c in candidates[:beam_width]:
        if c.hit:
            stopped = c.token in stop_ids
            tokens = running[c.parent][0] + ([] if stopped else [c.token])
            finished.append((c.score / divisor, tokens, stopped))
    finished.sort(key=lambda f: -f[0])
    return finished[:beam_width]


def _next_step(chosen, running, prompt_length: int, generated: int, keep: int) -> StepPlan:
    """Every beam feeds its newest token; each slot first takes its parent's cache."""
    count = len(chosen)
    return StepPlan(
        slots=list(range(count)),
        tokens=[[tokens[-1]] for tokens, _ in running],
        starts=[prompt_length + generated - 1] * count,
        sampling=[RowSampling(0.0)] * count,
        top_n=keep,
        copy_slots=[c.parent for c in chosen],
    )
