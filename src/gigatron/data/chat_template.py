"""Chat templates: a conversation rendered by a Jinja template (Hugging Face's format), its tokens
and which of them the model learns (the assistant turns).

`--sft-tokenizer-prompt-format` names the template (`load_chat_template`): one of Megatron's prompt
formats (`PROMPT_FORMATS`), `tokenizer` (the `chat_template` of the tokenizer_config.json beside
`--tokenizer-model`), or a file: a tokenizer_config.json, or a Jinja template. Templates render in
a sandbox like transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, `raise_exception`,
`tojson`, the tokenizer's special token strings such as `bos_token`), including its `{% generation
%}` blocks: the text inside them is what the model learns. A template without them learns each
assistant message from its content to the end of the text the template writes for it (the
end-of-turn marker included, the role header not), found by rendering the conversation one message
longer at a time. Tokens (`chat_tokens`) are the whole text's, without the tokenizer's own special
tokens (as `apply_chat_template(tokenize=True)`); a token is learned when it overlaps a learned
span (transformers' `assistant_masks` rule). Tokenizers that report no character offsets (all but
HuggingFaceTokenizer) tokenize the text piece by piece between span boundaries instead.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from gigatron.errors import GigatronError

# Megatron's SFT prompt formats (--sft-tokenizer-prompt-format), with the assistant text marked.
PROMPT_FORMATS = {
    "nemotron-h-aligned": (
        "{% for m in messages %}"
        "{% if m['role'] == 'system' %}{{ '<SPECIAL_10>System\\n' + m['content'].strip() + '\\n' }}"
        "{% elif m['role'] == 'user' %}"
        "{{ '<SPECIAL_11>User\\n' + m['content'].strip() + '\\n<SPECIAL_11>Assistant\\n' }}"
        "{% elif m['role'] == 'assistant' %}"
        "{% generation %}{{ m['content'].strip() + '\\n' }}{% endgeneration %}"
        "{% endif %}{% endfor %}"
    ),
    "nemotron-nano-v2": (
        "{% for m in messages %}"
        "{% set text = m['content'].replace('/think', '').replace('/no_think', '').strip() %}"
        "{% if m['role'] == 'system' %}{{ '<SPECIAL_10>System\\n' + text + '\\n' }}"
        "{% elif m['role'] == 'user' %}{{ '<SPECIAL_11>User\\n' + text + '\\n' }}"
        "{% elif m['role'] == 'assistant' %}{{ '<SPECIAL_11>Assistant\\n' }}"
        "{% generation %}{{ m['content'].strip() + '\\n<SPECIAL_12>\\n' }}{% endgeneration %}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<SPECIAL_11>Assistant\\n' }}{% endif %}"
    ),
}
SPECIAL_TOKENS = ("bos", "eos", "unk", "pad", "cls", "sep", "mask")


def tokenizer_config_template(path: str) -> str | None:
    """The `chat_template` of a tokenizer_config.json (the `default` one of a named list)."""
    try:
        with open(path, encoding="utf-8") as handle:
            template = json.load(handle).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def tokenizer_template(tokenizer: Any) -> str | None:
    """The chat template of a Hugging Face tokenizer's folder (tokenizer_config.json), if any."""
    identifiers = getattr(tokenizer, "unique_identifiers", None) or {}
    path = identifiers.get("tokenizer_model") if isinstance(identifiers, dict) else None
    if not isinstance(path, str):
        return None
    return tokenizer_config_template(os.path.join(os.path.dirname(path), "tokenizer_config.json"))


def template_source(spec: str, tokenizer: Any) -> str:
    """The Jinja text `--sft-tokenizer-prompt-format spec` names."""
    flag = f"--sft-tokenizer-prompt-format {spec}"
    if spec in PROMPT_FORMATS:
        return PROMPT_FORMATS[spec]
    if spec == "tokenizer":
        template = tokenizer_template(tokenizer)
        if template is None:
            raise GigatronError(
                f"{flag}: the tokenizer has no chat_template (tokenizer_config.json beside a "
                "HuggingFaceTokenizer's --tokenizer-model); name a template file instead"
            )
        return template
    if not os.path.isfile(spec):
        raise GigatronError(
            f"{flag}: neither a prompt format ({', '.join(PROMPT_FORMATS)}, tokenizer) nor a "
            "file; give one of those, a tokenizer_config.json or a Jinja template file"
        )
    if spec.endswith(".json"):
        template = tokenizer_config_template(spec)
        if template is None:
            raise GigatronError(f"{flag}: the file holds no chat_template string")
        return template
    with open(spec, encoding="utf-8") as handle:
        return handle.read()


def special_token_strings(tokenizer: Any) -> dict[str, str]:
    """`bos_token`, `eos_token`, ... as the template sees them (those the tokenizer has)."""
    names = {}
    inverse = getattr(tokenizer, "inv_vocab", None)
    for attribute in SPECIAL_TOKENS:
        token_id = getattr(tokenizer, attribute, None)
        if not isinstance(token_id, int):
            continue
        if isinstance(inverse, dict) and token_id in inverse:
            names[f"{attribute}_token"] = inverse[token_id]
        else:
            names[f"{attribute}_token"] = tokenizer.detokenize([token_id])
    return names


GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateFailure(ValueError):
    """The template failed on a conversation (its `raise_exception`, or a Jinja error)."""


# Private-use characters around the output of a {% generation %} block, removed after rendering.
OPEN, CLOSE = "\ue000", "\ue001"


class GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the text the model learns."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_mark")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _mark(self, caller: Any) -> str:
        return OPEN + caller() + CLOSE


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: no HTML escaping, json.dumps' options
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """A sandbox with what transformers gives chat templates."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment


def strip_marks(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without generation marks, and the [start, end) spans they enclosed."""
    text: list[str] = []
    spans: list[tuple[int, int]] = []
    length, start = 0, None
    for char in marked:
        if char == OPEN:
            start = length if start is None else start
        elif char == CLOSE and start is not None:
            spans.append((start, length))
            start = None
        elif char != CLOSE:
            text.append(char)
            length += 1
    return "".join(text), [(s, e) for s, e in spans if e > s]


class ChatTemplate:
    """A compiled chat template; `render` gives the text and its learned character spans."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.special_tokens = dict(special_tokens or {})
        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateError as error:
            raise GigatronError(f"chat template: does not compile ({error}); fix it") from None
        self.marks_generation = GENERATION_TAG.search(source) is not None

    def text(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        return self.render(messages, add_generation_prompt)[0]

    def render(
        self, messages: Sequence[dict], add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and its learned spans [start, end) in characters (raises
        TemplateFailure when the template fails, by its `raise_exception` or otherwise)."""
        try:
            marked = self.template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as error:
            raise TemplateFailure(str(error)) from None
        return strip_marks(marked)

    def learned_spans(self, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The text and the spans the model learns: the template's generation blocks, or each
        assistant message's text from its content on."""
        text, spans = self.render(messages)
        if self.marks_generation:
            return text, spans
        spans = []
        for index, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            start = len(self.text(messages[:index]))
            end = len(self.text(messages[: index + 1]))
            content = str(message.get("content", "")).strip()
            found = text.find(content, start, end) if content else -1
            spans.append((found if found >= 0 else start, end))
        return text, spans


def chat_tokens(
    template: ChatTemplate, messages: Sequence[dict], tokenizer: Any
) -> tuple[list[int], list[bool]]:
    """The token ids of the rendered conversation and, per token, whether it is learned."""
    text, spans = template.learned_spans(messages)
    encode = getattr(tokenizer, "encode_with_offsets", None)
    if encode is not None:
        ids, offsets = encode(text)
        learned = [any(end > s and start < e for s, e in spans) for start, end in offsets]
        return list(ids), learned
    cuts = sorted({0, len(text), *(p for span in spans for p in span)})
    ids: list[int] = []
    learned: list[bool] = []
    for start, end in zip(cuts, cuts[1:]):
        piece = list(tokenizer.tokenize(text[start:end]))
        inside = any(s <= start and end <= e for s, e in spans)
        ids += piece
        learned += [inside] * len(piece)
    return ids, learned


def load_chat_template(spec: str, tokenizer: Any) -> ChatTemplate:
    """The template `--sft-tokenizer-prompt-format` names, with the tokenizer's special tokens."""
    return ChatTemplate(template_source(spec, tokenizer), special_token_strings(tokenizer))
