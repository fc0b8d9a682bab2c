"""Megatron-LM's `PUT /api` request: the same fields, defaults, checks (in the same order) and
messages as Megatron's text generation server, and the same response shape.

One difference on purpose: every invalid request is answered with HTTP 400 and
`{"message": <Megatron's text>}` (Megatron answers most of them with HTTP 200 and a bare string;
its own `text_generation_cli.py` reads `response.json()["message"]` on errors).
Fields Megatron's current engine validates but ignores are honoured here as its earlier server
did: top_p_decay, top_p_bound, add_BOS (prepends the end-of-document token, as Megatron),
stop_on_eol, stop_on_double_eol, prevent_newline_after_colon, random_seed, stop_token. no_log is
accepted (request bodies are never logged). `beam_width` (one prompt) runs beam search as
Megatron's earlier server did, with `length_penalty` and `stop_token`, and answers
`{"text", "segments", "scores"}` for every beam, best first; without it length_penalty is
validated and has no effect.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gigatron.inference.engine import Completion, SamplingParams

MAX_PROMPTS = 128


class RequestError(ValueError):
    """An invalid request: `message` goes back to the client with HTTP 400; `param` names the
    field (OpenAI's error format); `status` is the HTTP status (400 unless told), `code` OpenAI's error code."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


@dataclass
class MegatronRequest:
    prompts: list[str]
    add_bos: bool
    params: SamplingParams


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bool_field(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean value", name)
    return value


def parse_megatron_request(
    body: Any, default_stop_token: int | None, vocab_size: int | None = None
) -> MegatronRequest:
    """Validate a `PUT /api` JSON body in Megatron's order; RequestError on the first problem.
    With `vocab_size`, a `stop_token` past the vocabulary is refused (a negative one: none)."""
    prompts = _prompts(body)
    tokens_to_generate, logprobs = _lengths(body)
    temperature, top_k, top_p = _sampling(body)
    top_p_decay, top_p_bound = _nucleus_decay(body, top_p)
    add_bos = _bool_field(body, "add_BOS")
    if any(len(p) == 0 for p in prompts) and not add_bos:
        raise RequestError("Empty prompts require add_BOS=true", "add_BOS")
    stop_on_double_eol = _bool_field(body, "stop_on_double_eol")
    stop_on_eol = _bool_field(body, "stop_on_eol")
    prevent_newline = _bool_field(body, "prevent_newline_after_colon")
    random_seed = body.get("random_seed", -1)
    if not _is_int(random_seed):
        raise RequestError("random_seed must be integer", "random_seed")
    if "random_seed" in body and random_seed < 0:
        raise RequestError("random_seed must be a positive integer", "random_seed")
    _bool_field(body, "no_log")
    beam_width = _beam_width(body, prompts)
    stop_token = body.get("stop_token", default_stop_token)
    if "stop_token" in body and not _is_int(stop_token):
        raise RequestError("stop_token must be an integer", "stop_token")
    length_penalty = body.get("length_penalty", 1.0)
    if "length_penalty" in body and not isinstance(length_penalty, float):
        raise RequestError("length_penalty must be a float", "length_penalty")

    if stop_token is not None and vocab_size is not None and stop_token >= vocab_size:
        raise RequestError(
            f"stop_token {stop_token} is outside the vocabulary [0, {vocab_size}); give a "
            "token id of the vocabulary, or -1 for none",
            "stop_token",
        )
    params = SamplingParams(
        max_tokens=tokens_to_generate,
        temperature=float(temperature),
        top_k=top_k,
        top_p=top_p,
        top_p_decay=top_p_decay,
        top_p_bound=top_p_bound,
        seed=random_seed if random_seed >= 0 else None,
        stop_token_ids=(stop_token,) if stop_token is not None else (),
        stop_on_eol=stop_on_eol,
        stop_on_double_eol=stop_on_double_eol,
        prevent_newline_after_colon=prevent_newline,
        logprobs=logprobs,
        prompt_logprobs=logprobs,
    )
    if beam_width:
        if logprobs:
            raise RequestError("logprobs is not available with beam_width", "logprobs")
        if stop_on_eol or stop_on_double_eol:
            raise RequestError("stop_on_eol is not available with beam_width", "stop_on_eol")
        params.beam_width, params.length_penalty = beam_width, float(length_penalty)
    return MegatronRequest(prompts, add_bos, params)


def _beam_width(body: dict, prompts: list[str]) -> int:
    """`beam_width` (0 when absent) with Megatron's checks."""
    if "beam_width" not in body:
        return 0
    beam_width = body["beam_width"]
    if not _is_int(beam_width):
        raise RequestError("beam_width must be integer", "beam_width")
    if beam_width < 1:
        raise RequestError("beam_width must be an integer > 1", "beam_width")
    if len(prompts) > 1:
        raise RequestError("When doing beam_search, batch size must be 1", "prompts")
    return beam_width


def _prompts(body: Any) -> list[str]:
    if not isinstance(body, dict):
        raise RequestError("prompts argument required", "prompts")
    if "prompts" not in body:
        raise RequestError("prompts argument required", "prompts")
    if "max_len" in body:
        raise RequestError("max_len is no longer used.  Replace with tokens_to_generate", "max_len")
    if "sentences" in body:
        raise RequestError("sentences is no longer used.  Replace with prompts", "sentences")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts is not a list of strings", "prompts")
    if len(prompts) == 0:
        raise RequestError("prompts is empty", "prompts")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"Maximum number of prompts is {MAX_PROMPTS}", "prompts")

    return prompts


def _lengths(body: dict) -> tuple[int, bool]:
    tokens_to_generate = body.get("tokens_to_generate", 64)
    if not _is_int(tokens_to_generate):
        raise RequestError(
            "tokens_to_generate must be an integer greater than 0", "tokens_to_generate"
        )
    if tokens_to_generate < 0:
        raise RequestError(
            "tokens_to_generate must be an integer greater than or equal to 0", "tokens_to_generate"
        )
    logprobs = _bool_field(body, "logprobs")
    if tokens_to_generate == 0 and not logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be True", "logprobs")

    return tokens_to_generate, logprobs


def _sampling(body: dict) -> tuple[float, int, float]:
    temperature = body.get("temperature", 1.0)
    message = "temperature must be a positive number less than or equal to 100.0"
    if not _is_number(temperature) or not 0.0 < temperature <= 100.0:
        raise RequestError(message, "temperature")
    top_k = body.get("top_k", 0)
    if not _is_int(top_k):
        raise RequestError(
            "top_k must be an integer equal to or greater than 0 and less than or equal to 1000",
            "top_k",
        )
    if not 0 <= top_k <= 1000:
        raise RequestError(
            "top_k must be equal to or greater than 0 and less than or equal to 1000", "top_k"
        )
    top_p = body.get("top_p", 0.0)
    if not isinstance(top_p, float):
        raise RequestError("top_p must be a positive float less than or equal to 1.0", "top_p")
    if top_p > 0.0 and top_k > 0:
        raise RequestError("cannot set both top-k and top-p samplings.", "top_p")
    if not 0 <= top_p <= 1.0:
        raise RequestError("top_p must be less than or equal to 1.0", "top_p")
    return temperature, top_k, top_p


def _nucleus_decay(body: dict, top_p: float) -> tuple[float, float]:
    top_p_decay = _top_p_option(
        body, "top_p_decay", top_p, "1.0", lambda v: 0 <= v <= 1.0, "less than or equal to 1.0"
    )
    top_p_bound = _top_p_option(
        body,
        "top_p_bound",
        top_p,
        "top_p",
        lambda v: 0.0 < v <= top_p,
        "greater than 0 and less than top_p",
    )
    return top_p_decay, top_p_bound


def _top_p_option(
    body: dict, name: str, top_p: float, most: str, in_range: Callable[[float], bool], bounds: str
) -> float:
    """A float refining top-p (0.0 when absent): needs top_p; `bounds` says what `in_range` wants."""
    value = body.get(name, 0.0)
    if name in body:
        if not isinstance(value, float):
            raise RequestError(
                f"{name} must be a positive float less than or equal to {most}", name
            )
        if top_p == 0.0:
            raise RequestError(f"{name} cannot be set without top_p", name)
        if not in_range(value):
            raise RequestError(f"{name} must be {bounds}", name)
    return value


def megatron_beam_response(completion: Completion, tokenizer) -> dict[str, Any]:
    """Megatron's beam search answer: every beam's prompt + text, segments and score."""
    tokens = [completion.prompt_ids + beam.tokens for beam in completion.beams]
    return {
        "text": [tokenizer.detokenize(ids) for ids in tokens],
        "segments": [[tokenizer.detokenize([t]) for t in ids] for ids in tokens],
        "scores": [beam.score for beam in completion.beams],
    }


def megatron_response(completions: list[Completion], tokenizer, logprobs: bool) -> dict[str, Any]:
    """`{"text", "tokens", "segments"[, "logprobs"]}`: text and tokens are prompt + generation;
    logprobs are the prompt's (one fewer than its tokens) then the generated tokens'."""
    tokens = [c.prompt_ids + c.output_ids for c in completions]
    response: dict[str, Any] = {
        "text": [tokenizer.detokenize(ids) for ids in tokens],
        "tokens": tokens,
        "segments": [[tokenizer.detokenize([t]) for t in ids] for ids in tokens],
    }
    if logprobs:
        response["logprobs"] = [(c.prompt_log_probs or []) + c.log_probs for c in completions]
    return response
