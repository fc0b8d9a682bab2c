"""Chat templates (data/chat_template.py): the tokens and the assistant mask of a multi-turn
conversation with a system prompt equal transformers' `apply_chat_template` for the same template
and tokenizer (a byte-level BPE built here), with and without `{% generation %}` blocks; Megatron's
prompt formats; tokenizers without offsets; --sft reading conversations through a template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gigatron.data.chat_template import (
    PROMPT_FORMATS,
    ChatTemplate,
    chat_tokens,
    load_chat_template,
    strip_marks,
)
from gigatron.data.sft_dataset import SFTDataset, conversation_from_json
from gigatron.data.tokenizers import GPT2BPETokenizer, HuggingFaceTokenizer
from gigatron.errors import GigatronError
from gigatron.training.pretrain import parse_pretrain_config

DATA = Path(__file__).resolve().parents[1] / "data"
SPECIALS = ["<|im_start|>", "<|im_end|>", "<s>", "</s>"]
# ChatML with a default system prompt; the assistant's text and end of turn are learned (a
# template without generation blocks learns the same: the message's text from its content on).
TAGGED = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
UNTAGGED = TAGGED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CONVERSATIONS = [
    [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What colour is the sky?"},
        {"role": "assistant", "content": "The sky is blue."},
        {"role": "user", "content": "And the grass, at noon?"},
        {"role": "assistant", "content": "Green, mostly."},
    ],
    [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello there!"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = tmp_path_factory.mktemp("chat_tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = [m["content"] for c in CONVERSATIONS for m in c] * 5 + ["system user assistant"]
    tok.train_from_iterator(lines, trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": TAGGED}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_dir / "tokenizer.json"),
        bos_token="<s>",
        eos_token="<|im_end|>",
    )


def _hf(hf_tokenizer, messages, template=TAGGED):
    out = hf_tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )  # fmt: skip
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("source", ["tagged", "untagged"])
def test_tokens_and_mask_equal_apply_chat_template(tokenizer_dir, hf_tokenizer, index, source):
    tokenizer = HuggingFaceTokenizer(str(tokenizer_dir))
    template = ChatTemplate(TAGGED if source == "tagged" else UNTAGGED, {"bos_token": "<s>"})
    messages = CONVERSATIONS[index]
    ids, mask = chat_tokens(template, messages, tokenizer)
    hf_ids, hf_mask = _hf(hf_tokenizer, messages)
    assert ids == hf_ids and mask == hf_mask
    # The learned tokens are the assistants' texts and their end-of-turn markers, nothing else.
    learned = hf_tokenizer.decode([i for i, m in zip(ids, mask) if m])
    answers = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
    assert learned == "".join(answers)
    assert template.text(messages, add_generation_prompt=True) == hf_tokenizer.apply_chat_template(
        messages, chat_template=TAGGED, tokenize=False, add_generation_prompt=True
    )


def test_sft_conversation_through_the_tokenizer_template(tokenizer_dir, hf_tokenizer, tmp_path):
    tokenizer = HuggingFaceTokenizer(str(tokenizer_dir))
    template = load_chat_template("tokenizer", tokenizer)
    messages = CONVERSATIONS[0]
    conversation = conversation_from_json({"messages": messages}, tokenizer, "x", template)
    hf_ids, hf_mask = _hf(hf_tokenizer, messages)
    # The template ends with a newline, so the end-of-document token is added (and learned).
    assert conversation.tokens.tolist() == [*hf_ids, tokenizer.eod]
    assert conversation.targets.tolist() == [*hf_mask, True]
    pair = conversation_from_json(
        {"prompt": "Say hello.", "response": "Hello there!"}, tokenizer, "x", template
    )
    hf_pair = _hf(hf_tokenizer, CONVERSATIONS[1])
    assert pair.tokens.tolist()[:-1] == hf_pair[0] and pair.targets.tolist()[:-1] == hf_pair[1]

    # --sft-tokenizer-prompt-format with a tokenizer_config.json, through the dataset class.
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": messages}) + "\n")
    flags = [
        "--sft", "--sft-tokenizer-prompt-format", str(tokenizer_dir / "tokenizer_config.json"),
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer_dir),
        "--data-path", str(data), "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
    ]  # fmt: skip
    cfg = parse_pretrain_config(flags, world_size=1)
    low_level = SFTDataset.open_low_level(str(data), "--data-path", cfg, tokenizer)
    assert low_level.conversations[0].tokens.tolist() == conversation.tokens.tolist()
    assert low_level.conversations[0].targets.tolist() == conversation.targets.tolist()


def test_megatron_prompt_format_text():
    template = ChatTemplate(PROMPT_FORMATS["nemotron-h-aligned"])
    messages = [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello "},
    ]
    text, spans = template.render(messages)
    assert (
        text
        == "<SPECIAL_10>System\nBe brief.\n<SPECIAL_11>User\nhi\n<SPECIAL_11>Assistant\nhello\n"
    )
    assert [text[s:e] for s, e in spans] == ["hello\n"]
    nano = ChatTemplate(PROMPT_FORMATS["nemotron-nano-v2"])
    text, spans = nano.render(messages[1:], add_generation_prompt=False)
    assert text == "<SPECIAL_11>User\nhi\n<SPECIAL_11>Assistant\nhello\n<SPECIAL_12>\n"
    assert [text[s:e] for s, e in spans] == ["hello\n<SPECIAL_12>\n"]
    assert nano.text(messages[1:2], add_generation_prompt=True).endswith("<SPECIAL_11>Assistant\n")


def test_tokenizer_without_offsets_tokenizes_piece_by_piece():
    tokenizer = GPT2BPETokenizer(str(DATA / "gpt2-vocab.json"), str(DATA / "gpt2-merges.txt"))
    template = ChatTemplate(UNTAGGED, {"bos_token": ""})
    messages = CONVERSATIONS[1]
    ids, mask = chat_tokens(template, messages, tokenizer)
    text, spans = template.learned_spans(messages)
    ((start, end),) = spans
    assert text[start:end] == "Hello there!<|im_end|>\n"
    pieces = [text[:start], text[start:end], text[end:]]
    expected = [tokenizer.tokenize(p) for p in pieces]
    assert ids == [*expected[0], *expected[1], *expected[2]]
    assert mask == [False] * len(expected[0]) + [True] * len(expected[1]) + [False] * len(
        expected[2]
    )


def test_marks_and_errors(tokenizer_dir):
    assert strip_marks("a\ue000bc\ue001d\ue000\ue001") == ("abcd", [(1, 3)])
    tokenizer = HuggingFaceTokenizer(str(tokenizer_dir))
    with pytest.raises(GigatronError, match="neither a prompt format"):
        load_chat_template("no-such-format", tokenizer)
    failing = ChatTemplate("{{ raise_exception('no system messages') }}")
    with pytest.raises(GigatronError, match="line 4: the chat template failed"):
        conversation_from_json({"prompt": "a", "response": "b"}, tokenizer, "line 4", failing)
    with pytest.raises(GigatronError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(GigatronError, match="formats --sft conversations; add --sft"):
        parse_pretrain_config(
            ["--sft-tokenizer-prompt-format", "nemotron-h-aligned", "--mock-data",
             "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
             "--train-iters", "1", "--vocab-size", "64", "--lr", "1e-3"],
            world_size=1,
        )  # fmt: skip


def test_serve_renders_chats_with_the_same_template(tokenizer_dir, hf_tokenizer):
    from gigatron.inference.api_megatron import RequestError
    from gigatron.inference.api_openai import chat_template_of, render_chat

    tokenizer = HuggingFaceTokenizer(str(tokenizer_dir))
    template = chat_template_of(tokenizer)
    assert template == TAGGED
    messages = CONVERSATIONS[0][:2]
    prompt = render_chat([(m["role"], m["content"]) for m in messages], tokenizer, template)
    assert prompt == hf_tokenizer.apply_chat_template(
        messages, chat_template=TAGGED, tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<s><|im_start|>system\n") and prompt.endswith("assistant\n")
    # A model fine-tuned with --sft-tokenizer-prompt-format is served with that format.
    nemotron = chat_template_of(tokenizer, "nemotron-h-aligned")
    assert (
        render_chat([("user", "hi")], tokenizer, nemotron)
        == "<SPECIAL_11>User\nhi\n<SPECIAL_11>Assistant\n"
    )
    with pytest.raises(RequestError, match="the chat template failed \\(no tools\\)"):
        render_chat([("user", "x")], tokenizer, "{{ raise_exception('no tools') }}")
    # A model without a template takes no chat request: 400 naming `messages`.
    with pytest.raises(RequestError, match="messages: this model has no chat template") as error:
        render_chat([("user", "x")], tokenizer, None)
    assert error.value.param == "messages" and error.value.status == 400
