"""Beam search equals Hugging Face `generate(num_beams=...)` on a converted GPT-2: the same
hypotheses in the same order with the same scores, for length penalties and every early-stopping
rule, with a stop token the beams meet."""

from __future__ import annotations

import pytest
import torch
from test_inference_engine import PROMPTS, engine_for, gpt2_pair

from gigatron.inference import SamplingParams

CASES = [(1.0, False), (2.0, True), (0.5, "never"), (-1.0, False)]


@pytest.fixture(scope="module")
def pair():
    return gpt2_pair()


def hf_beams(hf_model, prompt, width, steps, eos, length_penalty, early_stopping):
    out = hf_model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=width, num_return_sequences=width, max_new_tokens=steps, do_sample=False,
        eos_token_id=eos, pad_token_id=eos, length_penalty=length_penalty,
        early_stopping=early_stopping, output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    beams = []
    for row, score in zip(out.sequences, out.sequences_scores):
        tokens = row[len(prompt) :].tolist()
        if eos in tokens:
            tokens = tokens[: tokens.index(eos)]
        beams.append((tokens, float(score)))
    return beams


@pytest.mark.parametrize("length_penalty,early_stopping", CASES)
def test_beam_search_equals_hugging_face(pair, length_penalty, early_stopping):
    model, hf_model = pair
    engine = engine_for(model, max_batch_size=4)
    stopped = 0
    for prompt in PROMPTS[:2]:
        greedy = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0]
        eos = greedy.output_ids[1]  # a token the beams are likely to meet
        params = SamplingParams(
            max_tokens=8, beam_width=4, length_penalty=length_penalty,
            early_stopping=early_stopping, stop_token_ids=(eos,),
        )  # fmt: skip
        (completion,) = engine.generate([prompt], params)
        expected = hf_beams(hf_model, prompt, 4, 8, eos, length_penalty, early_stopping)
        assert [b.tokens for b in completion.beams] == [tokens for tokens, _ in expected]
        torch.testing.assert_close([b.score for b in completion.beams],
                                   [score for _, score in expected], atol=1e-4, rtol=0)  # fmt: skip
        assert completion.output_ids == expected[0][0]
        assert completion.finish_reason == ("stop" if completion.beams[0].stopped else "length")
        stopped += sum(b.stopped for b in completion.beams)
    if length_penalty <= 1.0:  # (a penalty of 2 prefers the longest hypotheses)
        assert stopped > 0  # some hypotheses ended at the stop token
