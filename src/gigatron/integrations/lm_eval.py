"""lm-evaluation-harness model `gigatron`: loglikelihood, loglikelihood_rolling and
generate_until on a gigatron GPT checkpoint.

Likelihoods are batched forward passes (`tasks.scoring.score_samples`, any tp/pp layout; under
torchrun every process runs the harness on all requests and the scoring splits them over the
data-parallel copies); generation uses the inference engine (one process).
`gigatron lm-eval ...` (or `python -m gigatron.integrations.lm_eval ...`) registers the model and
runs the harness's command line: `gigatron lm-eval --model gigatron --model_args load=CKPT ...`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from gigatron.config.validate import params_dtype
from gigatron.inference import SamplingParams
from gigatron.inference.load import build_engine, load_for_inference
from gigatron.tasks.scoring import Sample, score_samples


def _truncate(context: list[int], continuation: list[int], max_length: int) -> Sample:
    """Context + continuation, scored on the continuation; the oldest tokens go first when the
    whole does not fit in `max_length` + 1 tokens."""
    tokens = (context + continuation)[-(max_length + 1) :]
    mask = np.zeros(len(tokens) - 1, dtype=np.float32)
    mask[len(tokens) - 1 - len(continuation) :] = 1
    return Sample(np.asarray(tokens, dtype=np.int64), mask)


@register_model("gigatron")
class GigatronLM(LM):
    """`--model_args load=DIR[,ckpt_step=N][,device=cpu][,batch_size=8][,max_length=N]
    [,max_gen_toks=256]`."""

    def __init__(
        self,
        load: str,
        ckpt_step: int | None = None,
        device: str = "auto",
        batch_size: int | str = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        **_harness_kwargs: Any,
    ) -> None:
        super().__init__()
        args = argparse.Namespace(
            load=load, ckpt_step=None if ckpt_step is None else int(ckpt_step), device=device,
            tokenizer_model=None, vocab_file=None, merge_file=None,
        )  # fmt: skip
        self.loaded = load_for_inference(args, data_parallel=True)
        self.tokenizer = self.loaded.tokenizer
        config = self.loaded.chunks[0].config
        context = config.max_position_embeddings or self.loaded.cfg.model.seq_length
        self.max_length = int(max_length) if max_length else context
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 8
        self.max_gen_toks = int(max_gen_toks)
        self._engine = None

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        values = dict(item.split("=", 1) for item in arg_string.split(",") if item)
        return cls.create_from_arg_obj(values, additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """--model_args win over the harness's own options (--device, --batch_size)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})

    # ---- scoring ------------------------------------------------------------------------------
    def tok_encode(self, text: str) -> list[int]:
        return list(self.tokenizer.tokenize(text)) if text else []

    def score(self, samples: Sequence[Sample]) -> np.ndarray:
        """[n, 3]: summed loss, tokens, greedy. Samples of similar length are batched together."""

        order = sorted(range(len(samples)), key=lambda i: len(samples[i].loss_mask))
        out = np.zeros((len(samples), 3))
        group = self.batch_size * 16
        for start in range(0, len(order), group):
            part = order[start : start + group]
            scores = score_samples(
                self.loaded.chunks, self.loaded.pctx, [samples[i] for i in part],
                self.batch_size, pipeline_dtype=params_dtype(self.loaded.cfg),
            )  # fmt: skip
            out[part] = scores.numpy()
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        prefix = [self.tokenizer.eod]
        samples = []
        for request in requests:
            context, continuation = request.args
            context_ids = self.tok_encode(context) or prefix
            samples.append(_truncate(context_ids, self.tok_encode(continuation), self.max_length))
        scores = self.score(samples)
        return [(-float(loss), bool(greedy)) for loss, _, greedy in scores]

    def loglikelihood_rolling(self, requests) -> list[float]:
        samples, owner = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.tokenizer.eod,
                max_seq_len=self.max_length, context_len=1,
            )  # fmt: skip
            for context, continuation in map(make_disjoint_window, windows):
                samples.append(_truncate(list(context), list(continuation), self.max_length))
                owner.append(index)
        scores = self.score(samples)
        totals = [0.0] * len(requests)
        for index, (loss, _, _) in zip(owner, scores):
            totals[index] -= float(loss)
        return totals

    # ---- generation -----------------------------------------------------------------------------
    def generate_until(self, requests) -> list[str]:
        if self.loaded.pctx.world_size > 1:
            raise NotImplementedError("generate_until runs in one process (no torchrun)")
        if self._engine is None:
            self._engine = build_engine(
                self.loaded.chunks, self.loaded.pctx, self.tokenizer,
                max_batch_size=self.batch_size, max_sequence_length=self.max_length,
            )  # fmt: skip
        results = []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_tokens = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            prompt = self.tok_encode(context) or [self.tokenizer.eod]
            prompt = prompt[-(self.max_length - max_tokens) :]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=tuple(until))
            (completion,) = self._engine.generate([prompt], params)
            text = self.tokenizer.detokenize(completion.output_ids)
            for stop in until:
                text = text.split(stop)[0]
            results.append(text)
        return results


def main(argv: Sequence[str]) -> int:
    """The harness's command line, with the `gigatron` model registered."""
    # why: lm_eval is the optional `lm-eval` extra
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm_eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
