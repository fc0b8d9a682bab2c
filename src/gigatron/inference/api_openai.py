"""OpenAI's completions and chat completions requests and responses (the parts a local model
can serve), validated field by field: a bad field raises `RequestError` naming it.

Supported: prompt (text, texts, token ids, lists of token ids), messages, max_tokens /
max_completion_tokens, temperature (0 = greedy), top_p, top_k (an extension, as vLLM's), n,
seed, stop, echo, logprobs / top_logprobs, stream with stream_options.include_usage,
ignore_eos (extension), best_of (more than n: beam search of width best_of at temperature 0,
the n best beams are the choices). Parameters a local model cannot honour (penalties,
logit_bias, tools, suffix) are refused with a 400 unless left at their neutral value.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from gigatron.data.chat_template import (
    ChatTemplate,
    TemplateFailure,
    special_token_strings,
    template_source,
    tokenizer_template,
)
from gigatron.errors import GigatronError
from gigatron.inference.api_megatron import RequestError
from gigatron.inference.engine import Completion, SamplingParams

MAX_N = 16
MAX_TOP_LOGPROBS_COMPLETIONS = 5
MAX_TOP_LOGPROBS_CHAT = 20


@dataclass
class OpenAIRequest:
    prompts: list[list[int]]  # token ids, one list per prompt
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # completions: top-n; chat: top_logprobs when logprobs is true
    model: str


def _get(body: dict, name: str, kinds: tuple, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise RequestError(f"{name}: must be {kinds[0].__name__}, not a boolean", name)
    if not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise RequestError(f"{name}: must be {names}, got {type(value).__name__}", name)
    return value


def _range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise RequestError(f"{name}: {value} is out of range; it must be in [{low}, {high}]", name)


def _refuse_unsupported(body: dict) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = _get(body, name, (int, float), 0)
        if value != 0:
            raise RequestError(f"{name}: not supported by this server; leave it at 0", name)
    for name in ("logit_bias", "tools", "functions"):
        if body.get(name):
            raise RequestError(f"{name}: not supported by this server", name)
    if body.get("suffix"):
        raise RequestError("suffix: not supported by this server", "suffix")
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "none", "auto"):
        raise RequestError("tool_choice: tools are not supported by this server", "tool_choice")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise RequestError("response_format: only {'type': 'text'} is supported", "response_format")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop: must be a non-empty string or a list of them", "stop")
    if len(stop) > 4:
        raise RequestError("stop: at most 4 stop sequences", "stop")
    return tuple(stop)


def _common(body: dict, default_max_tokens: int | None) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    _refuse_unsupported(body)
    temperature = _get(body, "temperature", (int, float), 1.0)
    _range("temperature", temperature, 0.0, 2.0)
    top_p = _get(body, "top_p", (int, float), 1.0)
    _range("top_p", top_p, 0.0, 1.0)
    if top_p == 0:
        raise RequestError("top_p: must be greater than 0", "top_p")
    top_k = _get(body, "top_k", (int,), 0)
    if top_k < 0 and top_k != -1:
        raise RequestError("top_k: must be >= 0 (0 or -1: all tokens)", "top_k")
    n = _get(body, "n", (int,), 1)
    _range("n", n, 1, MAX_N)
    best_of = _get(body, "best_of", (int,), n)
    _range("best_of", best_of, n, MAX_N)
    if best_of > n and temperature != 0:
        raise RequestError(
            "best_of: more than n runs beam search here, which needs temperature 0", "best_of"
        )
    seed = _get(body, "seed", (int,), None)
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    include_usage = _get(options, "include_usage", (bool,), False)
    if options and not stream:
        raise RequestError("stream_options: only allowed with stream: true", "stream_options")
    ignore_eos = _get(body, "ignore_eos", (bool,), False)
    max_tokens = _get(body, "max_tokens", (int,), default_max_tokens)
    if max_tokens is not None and max_tokens < 0:
        raise RequestError("max_tokens: must be >= 0", "max_tokens")
    model = _get(body, "model", (str,), "")
    _get(body, "user", (str,), "")
    return {
        "temperature": float(temperature),
        "top_p": float(top_p) if top_p < 1 else 0.0,
        "top_k": max(top_k, 0),
        "n": n,
        "best_of": best_of,
        "seed": seed,
        "stream": stream,
        "include_usage": include_usage,
        "ignore_eos": ignore_eos,
        "max_tokens": max_tokens,
        "stop": _stop(body),
        "model": model,
    }


def _prompts(body: dict, tokenizer) -> list[list[int]]:
    if "prompt" not in body or body["prompt"] is None:
        raise RequestError("prompt: required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [tokenizer.tokenize(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [tokenizer.tokenize(p) for p in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(
            isinstance(p, list)
            and p
            and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in prompt
        ):
            return [list(p) for p in prompt]
    raise RequestError(
        "prompt: must be a string, a list of strings, a list of token ids or a list of lists of "
        "token ids (non-empty)",
        "prompt",
    )


def parse_completion_request(body: Any, tokenizer) -> OpenAIRequest:
    common = _common(body, default_max_tokens=16)
    prompts = _prompts(body, tokenizer)
    echo = _get(body, "echo", (bool,), False)
    logprobs = _get(body, "logprobs", (int,), None)
    if logprobs is not None:
        _range("logprobs", logprobs, 0, MAX_TOP_LOGPROBS_COMPLETIONS)
    if echo and common["stream"]:
        raise RequestError("echo: not supported with stream: true", "echo")
    params = _sampling(common, logprobs is not None, logprobs or 0, echo and logprobs is not None)
    return OpenAIRequest(
        prompts, params, common["n"], common["stream"], common["include_usage"], echo,
        logprobs, common["model"],
    )  # fmt: skip


def _message_text(message: Any, index: int) -> tuple[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where}: must be an object with role and content", "messages")
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError(f"{where}.role: must be system, user or assistant", "messages")
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(f"{where}.content: only text parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise RequestError(
                    f"{where}.content: a text part needs a string 'text'", "messages"
                )
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise RequestError(f"{where}.content: must be a string or a list of text parts", "messages")
    return role, content


def chat_template_of(tokenizer, prompt_format: str | None = None) -> str | None:
    """The Jinja chat template a model was fine-tuned with (its --sft-tokenizer-prompt-format),
    else its Hugging Face tokenizer's (tokenizer_config.json), if any."""
    if prompt_format is not None:
        return template_source(prompt_format, tokenizer)
    return tokenizer_template(tokenizer) if tokenizer else None


def render_chat(messages: list[tuple[str, str]], tokenizer, template: str | None) -> str:
    """The prompt text: the model's chat template (rendered as --sft renders it for training,
    data/chat_template.py); a model without one cannot take chat requests (RequestError, as
    transformers and vLLM refuse to guess a template)."""
    if template is None:
        raise RequestError(
            "messages: this model has no chat template (neither a fine-tuning "
            "--sft-tokenizer-prompt-format nor a chat_template in its tokenizer's "
            "tokenizer_config.json); send the text as a prompt to /v1/completions",
            "messages",
        )
    try:
        compiled = ChatTemplate(template, special_token_strings(tokenizer))
        return compiled.text([{"role": r, "content": c} for r, c in messages], True)
    except (TemplateFailure, GigatronError) as error:
        raise RequestError(f"messages: the chat template failed ({error})", "messages") from None


def parse_chat_request(body: Any, tokenizer, template: str | None) -> OpenAIRequest:
    common = _common(body, default_max_tokens=None)
    max_completion = _get(body, "max_completion_tokens", (int,), None)
    if max_completion is not None:
        if max_completion < 0:
            raise RequestError("max_completion_tokens: must be >= 0", "max_completion_tokens")
        common["max_tokens"] = max_completion
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: required, a non-empty list", "messages")
    texts = [_message_text(m, i) for i, m in enumerate(messages)]
    prompt = render_chat(texts, tokenizer, template)
    logprobs = _get(body, "logprobs", (bool,), False)
    top = _get(body, "top_logprobs", (int,), None)
    if top is not None:
        _range("top_logprobs", top, 0, MAX_TOP_LOGPROBS_CHAT)
        if not logprobs:
            raise RequestError("top_logprobs: needs logprobs: true", "top_logprobs")
    params = _sampling(common, logprobs, top or 0, False)
    return OpenAIRequest(
        [tokenizer.tokenize(prompt)], params, common["n"], common["stream"],
        common["include_usage"], False, (top or 0) if logprobs else None, common["model"],
    )  # fmt: skip


def _sampling(common: dict, logprobs: bool, top: int, prompt_logprobs: bool) -> SamplingParams:
    return SamplingParams(
        max_tokens=common["max_tokens"] if common["max_tokens"] is not None else -1,
        temperature=common["temperature"],
        top_k=common["top_k"],
        top_p=common["top_p"],
        seed=common["seed"],
        stop=common["stop"],
        ignore_eos=common["ignore_eos"],
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        top_logprobs=top,
        beam_width=common["best_of"] if common["best_of"] > common["n"] else 0,
    )


# ---- responses ------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(completions: list[Completion], prompts: list[list[int]]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.output_ids) for c in completions)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(completion: Completion, tokenizer, echo: bool, text_start: int) -> dict:
    """OpenAI's legacy logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    ids, values, tops = [], [], []
    if echo:
        ids += completion.prompt_ids
        values += [None, *(completion.prompt_log_probs or [])]
        tops += [None] * len(completion.prompt_ids)
    ids += completion.output_ids
    values += completion.log_probs
    tops += [{tokenizer.detokenize([t]): lp for t, lp in step} for step in completion.top_log_probs]
    tokens = [tokenizer.detokenize([t]) for t in ids]
    offsets, position = [], text_start
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(completion: Completion, tokenizer) -> dict:
    def entry(token_id: int, value: float) -> dict:
        text = tokenizer.detokenize([token_id])
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = []
    for index, (token_id, value) in enumerate(zip(completion.output_ids, completion.log_probs)):
        item = entry(token_id, value)
        top = completion.top_log_probs[index] if index < len(completion.top_log_probs) else []
        item["top_logprobs"] = [entry(t, v) for t, v in top]
        content.append(item)
    return {"content": content}


def finish_reason(completion: Completion) -> str:
    return "stop" if completion.finish_reason == "stop" else "length"


def timestamp() -> int:
    return int(time.time())
