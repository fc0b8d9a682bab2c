"""Resumable batched generation for detoxification: self-generation from the end-of-document
token and continuations of evaluation prompts, appended to `<output>.partial` a batch at a time
and renamed to `<output>` when complete; a killed run continues where it stopped (each sample
has its own seed, so the result does not depend on where it stopped)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gigatron.errors import GigatronError


@dataclass(frozen=True)
class Job:
    """One generation: prompt token ids, its seed, and the fields its record starts with."""

    prompt_ids: list[int]
    seed: int
    fields: dict[str, Any]


def completed_lines(partial: str) -> int:
    """Complete records already in `partial`; a torn last line (a kill mid-write) is cut."""
    if not os.path.exists(partial):
        return 0
    with open(partial, "rb") as stream:
        data = stream.read()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with open(partial, "r+b") as stream:
            stream.truncate(keep)
    return data[:keep].count(b"\n")


def run_jobs(
    jobs: Sequence[Job],
    output: str,
    generate: Callable[[list[Job]], list[str]],
    batch_size: int,
) -> int:
    """Generate the jobs not yet in `<output>.partial`, then rename it to `output`; returns how
    many were generated now."""
    if os.path.exists(output):
        raise GigatronError(f"--output {output}: exists; remove it or choose another path")
    partial = output + ".partial"
    done = completed_lines(partial)
    if done > len(jobs):
        raise GigatronError(
            f"{partial}: holds {done} records, more than the {len(jobs)} asked for; it belongs "
            "to another run: remove it"
        )
    with open(partial, "a", encoding="utf-8") as stream:
        for start in range(done, len(jobs), batch_size):
            batch = list(jobs[start : start + batch_size])
            for job, text in zip(batch, generate(batch)):
                stream.write(json.dumps({**job.fields, "text": text}, ensure_ascii=False) + "\n")
            stream.flush()
            os.fsync(stream.fileno())
    os.replace(partial, output)
    return len(jobs) - done


def engine_generate(
    engine: Any, params: Any, jobs: Sequence[Job]
) -> Callable[[list[Job]], list[str]]:
    """A `generate` for run_jobs over an inference engine: one seeded request per job. Every
    job's length is checked first: a prompt too long fails before anything is generated."""
    import dataclasses  # why: keeps this module's import light for the --help path

    for job in jobs:
        try:
            engine.check_length(len(job.prompt_ids), params.max_tokens)
        except ValueError as error:
            raise GigatronError(
                f"prompt {job.fields}: {error}; shorten it or lower --max-tokens"
            ) from None

    def generate(batch: list[Job]) -> list[str]:
        requests = [dataclasses.replace(params, seed=job.seed) for job in batch]
        completions = engine.generate([job.prompt_ids for job in batch], requests)
        return [completion.text for completion in completions]

    return generate
