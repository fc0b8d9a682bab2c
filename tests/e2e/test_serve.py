"""`gigatron serve` in a real process over HTTP on 127.0.0.1: Megatron's PUT /api (every
validation rule, the response), the official openai client (completions, chat, streaming),
20 concurrent clients, 1,000 malformed requests, a client leaving mid-stream, and
`gigatron text-generation-cli`."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import torch
from inference_helpers import (
    engine_from_checkpoint,
    save_tiny_checkpoint,
    start_server,
    stop_server,
)

from gigatron.inference import SamplingParams
from helpers import env, gigatron, gigatron_command

TIMEOUT = 60
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve") / "ckpt"
    save_tiny_checkpoint(directory, prompt_format="nemotron-h-aligned")  # chats use its template
    return directory


@pytest.fixture(scope="module")
def server(checkpoint):
    process, url = start_server(checkpoint, "--max-batch-size", "4")
    yield url
    output = stop_server(process)
    assert "Traceback" not in output, output


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Greedy continuations computed in this process: prompt text -> (ids, text)."""
    engine, tokenizer = engine_from_checkpoint(checkpoint)

    def greedy(prompt: str, max_tokens: int, **kwargs):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)
        (completion,) = engine.generate([tokenizer.tokenize(prompt)], params)
        return completion

    return greedy, tokenizer


def put(url, body, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body)
    return requests.put(url + "/api", data=data, timeout=TIMEOUT, headers=JSON)


# ---- Megatron's PUT /api ----------------------------------------------------------------
INVALID = [
    ({}, "prompts argument required"),
    ({"prompts": ["a"], "max_len": 3}, "max_len is no longer used.  Replace with tokens_to_generate"),
    ({"prompts": ["a"], "sentences": ["a"]}, "sentences is no longer used.  Replace with prompts"),
    ({"prompts": "a"}, "prompts is not a list of strings"),
    ({"prompts": [1, 2]}, "prompts is not a list of strings"),
    ({"prompts": []}, "prompts is empty"),
    ({"prompts": ["a"] * 129}, "Maximum number of prompts is 128"),
    ({"prompts": ["a"], "tokens_to_generate": "5"}, "tokens_to_generate must be an integer greater than 0"),
    ({"prompts": ["a"], "tokens_to_generate": -1}, "tokens_to_generate must be an integer greater than or equal to 0"),
    ({"prompts": ["a"], "logprobs": "yes"}, "logprobs must be a boolean value"),
    ({"prompts": ["a"], "tokens_to_generate": 0}, "tokens_to_generate=0 implies logprobs should be True"),
    ({"prompts": ["a"], "temperature": "hot"}, "temperature must be a positive number less than or equal to 100.0"),
    ({"prompts": ["a"], "temperature": 0.0}, "temperature must be a positive number less than or equal to 100.0"),
    ({"prompts": ["a"], "temperature": 101}, "temperature must be a positive number less than or equal to 100.0"),
    ({"prompts": ["a"], "top_k": 2.5}, "top_k must be an integer equal to or greater than 0 and less than or equal to 1000"),
    ({"prompts": ["a"], "top_k": 1001}, "top_k must be equal to or greater than 0 and less than or equal to 1000"),
    ({"prompts": ["a"], "top_p": 1}, "top_p must be a positive float less than or equal to 1.0"),
    ({"prompts": ["a"], "top_p": 0.5, "top_k": 5}, "cannot set both top-k and top-p samplings."),
    ({"prompts": ["a"], "top_p": 1.5}, "top_p must be less than or equal to 1.0"),
    ({"prompts": ["a"], "top_p_decay": 0.5}, "top_p_decay cannot be set without top_p"),
    ({"prompts": ["a"], "top_p": 0.5, "top_p_decay": 1}, "top_p_decay must be a positive float less than or equal to 1.0"),
    ({"prompts": ["a"], "top_p": 0.5, "top_p_decay": 1.5}, "top_p_decay must be less than or equal to 1.0"),
    ({"prompts": ["a"], "top_p_bound": 0.1}, "top_p_bound cannot be set without top_p"),
    ({"prompts": ["a"], "top_p": 0.5, "top_p_bound": 1}, "top_p_bound must be a positive float less than or equal to top_p"),
    ({"prompts": ["a"], "top_p": 0.5, "top_p_bound": 0.7}, "top_p_bound must be greater than 0 and less than top_p"),
    ({"prompts": ["a"], "add_BOS": 1}, "add_BOS must be a boolean value"),
    ({"prompts": [""]}, "Empty prompts require add_BOS=true"),
    ({"prompts": ["a"], "stop_on_double_eol": "no"}, "stop_on_double_eol must be a boolean value"),
    ({"prompts": ["a"], "stop_on_eol": 0}, "stop_on_eol must be a boolean value"),
    ({"prompts": ["a"], "prevent_newline_after_colon": None}, "prevent_newline_after_colon must be a boolean value"),
    ({"prompts": ["a"], "random_seed": "1"}, "random_seed must be integer"),
    ({"prompts": ["a"], "random_seed": -2}, "random_seed must be a positive integer"),
    ({"prompts": ["a"], "no_log": "x"}, "no_log must be a boolean value"),
    ({"prompts": ["a"], "beam_width": "2"}, "beam_width must be integer"),
    ({"prompts": ["a"], "beam_width": 0}, "beam_width must be an integer > 1"),
    ({"prompts": ["a", "b"], "beam_width": 2}, "When doing beam_search, batch size must be 1"),
    ({"prompts": ["a"], "beam_width": 2, "logprobs": True}, "logprobs is not available with beam_width"),
    ({"prompts": ["a"], "beam_width": 9, "tokens_to_generate": 4}, "beam_width 9 needs as many cache slots on the static engine (this one: 4 slots)"),
    ({"prompts": ["a"], "stop_token": 1.5}, "stop_token must be an integer"),
    ({"prompts": ["a"], "stop_token": 1000000000}, "stop_token 1000000000 is outside the vocabulary [0, 50257); give a token id of the vocabulary, or -1 for none"),
    ({"prompts": ["a"], "length_penalty": 1}, "length_penalty must be a float"),
]  # fmt: skip


def test_api_validation_rules(server):
    for body, message in INVALID:
        response = put(server, body)
        assert response.status_code == 400, (body, response.text)
        assert response.json() == {"message": message}, body


def test_api_beam_search_returns_the_engine_beams(server, checkpoint):
    engine, tokenizer = engine_from_checkpoint(checkpoint)
    prompt = "The capital of France"
    params = SamplingParams(max_tokens=6, beam_width=3, length_penalty=0.5,
                            stop_token_ids=(tokenizer.eod,))  # fmt: skip
    (expected,) = engine.generate([tokenizer.tokenize(prompt)], params)
    body = {"prompts": [prompt], "tokens_to_generate": 6, "beam_width": 3, "length_penalty": 0.5}
    response = put(server, body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert set(answer) == {"text", "segments", "scores"} and len(answer["text"]) == 3
    ids = [tokenizer.tokenize(prompt) + beam.tokens for beam in expected.beams]
    assert answer["text"] == [tokenizer.detokenize(i) for i in ids]
    assert answer["segments"][0] == [tokenizer.detokenize([t]) for t in ids[0]]
    torch.testing.assert_close(answer["scores"], [b.score for b in expected.beams], atol=1e-4,
                               rtol=0)  # fmt: skip
    assert answer["scores"] == sorted(answer["scores"], reverse=True)


def test_api_generates_like_the_engine(server, reference):
    greedy, tokenizer = reference
    prompts = ["The capital of France", "Once upon a time there"]
    body = {"prompts": prompts, "tokens_to_generate": 8, "top_k": 1, "logprobs": True}
    response = put(server, body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert set(answer) == {"text", "tokens", "segments", "logprobs"}
    for i, prompt in enumerate(prompts):
        expected = greedy(prompt, 8, logprobs=True, prompt_logprobs=True)
        ids = tokenizer.tokenize(prompt) + expected.output_ids
        assert answer["tokens"][i] == ids
        assert answer["text"][i] == tokenizer.detokenize(ids)
        assert answer["segments"][i] == [tokenizer.detokenize([t]) for t in ids]
        # logprobs: the prompt's (one fewer than its tokens), then the generated tokens'
        assert len(answer["logprobs"][i]) == len(ids) - 1
        expected_lp = expected.prompt_log_probs + expected.log_probs
        torch.testing.assert_close(answer["logprobs"][i], expected_lp, atol=1e-4, rtol=0)
    # tokens_to_generate 0 with logprobs: the prompt scored, nothing generated
    scored = put(server, {"prompts": ["Hello world"], "tokens_to_generate": 0, "logprobs": True})
    assert scored.status_code == 200
    assert scored.json()["tokens"] == [tokenizer.tokenize("Hello world")]
    # add_BOS prepends the end-of-document token; a seeded request repeats
    seeded = {"prompts": ["", "x"], "add_BOS": True, "tokens_to_generate": 5, "random_seed": 3}
    first, second = put(server, seeded).json(), put(server, seeded).json()
    assert first["tokens"] == second["tokens"] and first["tokens"][0][0] == tokenizer.eod


def test_api_refuses_a_prompt_longer_than_the_context(server):
    response = put(server, {"prompts": ["word " * 60], "tokens_to_generate": 4})
    assert response.status_code == 400
    assert "exceeds the model's context of 48 tokens" in response.json()["message"]


# ---- OpenAI -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def test_openai_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["gigatron"]
    health = requests.get(server + "/health", timeout=TIMEOUT).json()
    assert health["status"] == "ok" and health["ready"] is True


def test_openai_completions(client, reference):
    greedy, tokenizer = reference
    prompt = "The history of the Roman empire"
    expected = greedy(prompt, 10, logprobs=True, top_logprobs=2)
    result = client.completions.create(
        model="gigatron", prompt=prompt, max_tokens=10, temperature=0, logprobs=2
    )
    choice = result.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert result.usage.prompt_tokens == len(tokenizer.tokenize(prompt))
    assert result.usage.completion_tokens == len(expected.output_ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + len(expected.output_ids)
    torch.testing.assert_close(
        choice.logprobs.token_logprobs, expected.log_probs, atol=1e-4, rtol=0
    )
    assert len(choice.logprobs.top_logprobs[0]) == 2
    # token ids as the prompt, a stop string, echo, n
    ids = tokenizer.tokenize(prompt)
    same = client.completions.create(model="m", prompt=ids, max_tokens=10, temperature=0)
    assert same.choices[0].text == expected.text
    stop = expected.text[3:5]
    cut = client.completions.create(
        model="m", prompt=prompt, max_tokens=10, temperature=0, stop=stop
    )
    assert cut.choices[0].text == expected.text[: expected.text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    echo = client.completions.create(
        model="m", prompt=prompt, max_tokens=3, temperature=0, echo=True
    )
    assert echo.choices[0].text.startswith(prompt)
    many = client.completions.create(model="m", prompt=prompt, max_tokens=5, n=3, seed=1)
    assert [c.index for c in many.choices] == [0, 1, 2]


def test_openai_chat_and_streaming(client, reference):
    greedy, _ = reference
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = greedy(
        "<SPECIAL_10>System\nBe brief.\n<SPECIAL_11>User\nHi\n<SPECIAL_11>Assistant\n", 12
    )
    chat = client.chat.completions.create(
        model="gigatron", messages=messages, max_tokens=12, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected.text
    assert chat.usage.completion_tokens == len(expected.output_ids)
    stream = client.chat.completions.create(
        model="gigatron", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == expected.text
    assert reasons[-1] in ("stop", "length") and usage.completion_tokens == len(expected.output_ids)
    text_stream = client.completions.create(
        model="gigatron", prompt="Hi", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in text_stream) == greedy("Hi", 12).text


def test_openai_errors_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="m", prompt="x", max_tokens=4, temperature=5)
    assert error.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="m", prompt="word " * 60, max_tokens=4)
    assert error.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="m", messages=[], max_tokens=4)
    assert error.value.body["param"] == "messages"


def test_openai_best_of_runs_beam_search(server, checkpoint):
    engine, tokenizer = engine_from_checkpoint(checkpoint)
    prompt = "Once upon a time there"
    params = SamplingParams(max_tokens=6, beam_width=3, stop_token_ids=(tokenizer.eod,))
    (expected,) = engine.generate([tokenizer.tokenize(prompt)], params)
    body = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2,
            "best_of": 3}  # fmt: skip
    response = requests.post(server + "/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    texts = [choice["text"] for choice in response.json()["choices"]]
    assert texts == [tokenizer.detokenize(beam.tokens) for beam in expected.beams[:2]]
    for wrong in ({"temperature": 1}, {"stream": True}, {"best_of": 1}, {"stop": ["x"]}):
        response = requests.post(server + "/v1/completions", json=body | wrong, timeout=TIMEOUT)
        assert response.status_code == 400, wrong
        assert response.json()["error"]["param"] == "best_of", response.text


# ---- load and abuse ---------------------------------------------------------------------
def test_twenty_concurrent_clients(server, reference):
    greedy, _ = reference
    prompts = [f"Request number {i} says" for i in range(20)]
    expected = {p: greedy(p, 6).text for p in prompts}

    def ask(prompt):
        body = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0}
        response = requests.post(server + "/v1/completions", json=body, timeout=TIMEOUT)
        return prompt, response.status_code, response.json()["choices"][0]["text"]

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, prompts))
    for prompt, status, text in answers:
        assert status == 200 and text == expected[prompt]


def _malformed(rng: random.Random) -> tuple[str, str, bytes]:
    paths = ["/api", "/v1/completions", "/v1/chat/completions"]
    junk = [
        b"",
        b"{",
        b"null",
        b"[]",
        b"42",
        b'"text"',
        b"\xff\xfe",
        b'{"prompts": [null]}',
        b'{"prompt": {}}',
        b'{"prompt": [[]]}',
        b'{"prompt": [1, "a"]}',
        b'{"prompt": [-5]}',
        b'{"prompt": [99999999]}',
        b'{"prompt": "x", "max_tokens": -3}',
        b'{"prompt": "x", "max_tokens": 1e9}',
        b'{"prompt": "x", "n": 0}',
        b'{"prompt": "x", "top_p": "high"}',
        b'{"prompt": "x", "stop": [1]}',
        b'{"prompt": "x", "logprobs": 99}',
        b'{"prompt": "x", "stream": "yes"}',
        b'{"messages": "hi"}',
        b'{"messages": [{"role": "robot", "content": "x"}]}',
        b'{"messages": [{"role": "user", "content": [{"type": "image"}]}]}',
        b'{"messages": [{"role": "user", "content": 5}]}',
        b'{"prompts": ["a"], "top_k": -1}',
        b'{"prompts": ["a"], "tokens_to_generate": true}',
        b'{"prompt": "x", "seed": "s"}',
        b'{"prompt": "x", "presence_penalty": 1}',
        b'{"prompt": "x", "temperature": null, "n": 99}',
    ]
    path = rng.choice(paths)
    method = "PUT" if path == "/api" else "POST"
    return method, path, rng.choice(junk) if rng.random() < 0.8 else bytes(rng.randbytes(20))


def test_a_thousand_malformed_requests_then_a_good_one(server):
    rng = random.Random(0)
    session = requests.Session()
    statuses = []
    for _ in range(1000):
        method, path, body = _malformed(rng)
        response = session.request(method, server + path, data=body, timeout=TIMEOUT,
                                   headers=JSON)  # fmt: skip
        statuses.append(response.status_code)
        assert response.status_code < 500, (path, body, response.text)
        assert "Traceback" not in response.text
    assert statuses.count(400) > 900
    good = session.put(server + "/api", json={"prompts": ["still alive"], "tokens_to_generate": 2})
    assert good.status_code == 200 and len(good.json()["text"]) == 1


def test_a_client_leaving_mid_stream_frees_its_slot(server):
    body = {"model": "m", "prompt": "Leaving early", "max_tokens": 40, "temperature": 0.5,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with requests.post(server + "/v1/completions", json=body, stream=True, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # one event, then hang up
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = requests.get(server + "/health", timeout=TIMEOUT).json()
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        time.sleep(0.2)
    assert stats["running"] == 0 and stats["waiting"] == 0


def test_text_generation_cli(server, reference):
    greedy, _ = reference
    command = gigatron_command("text-generation-cli", server[len("http://") :])
    result = subprocess.run(
        command, input="Good morning\n4\nGood morning\nfour\n", capture_output=True, text=True,
        env=env(), timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Megatron Response: \nGood morning" in result.stdout
    # top-k 0 sampling: the text starts with the prompt; a bad count is reported, not fatal
    assert "'four' is not a whole number" in result.stdout


def test_server_rejects_http_methods_and_paths(server):
    try:
        urllib.request.urlopen(urllib.request.Request(server + "/api", method="GET"), timeout=10)
    except urllib.error.HTTPError as error:
        assert error.code == 405
    else:
        raise AssertionError("GET /api answered 200")
    assert requests.get(server + "/nothing", timeout=TIMEOUT).status_code == 404


# ---- hardening: API keys, body limit, JSON only, unencodable prompts, disconnects -----------
def test_a_port_in_use_is_refused_before_the_model_loads(checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = gigatron("serve", "--load", str(checkpoint), "--device", "cpu",
                          "--host", "127.0.0.1", "--port", str(port), check=False)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in result.stderr
    assert "Traceback" not in result.stderr and "gigatron serve:" not in result.stdout


def test_api_keys_body_limit_json_only_and_openai_context_errors(checkpoint):
    process, url = start_server(checkpoint, "--api-key", "secret", "--max-request-bytes", "2000")
    try:
        body = {"model": "m", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        key = {"Authorization": "Bearer secret"}
        missing = requests.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        wrong = put(url, {"prompts": ["a"]}, raw=None)
        assert wrong.status_code == 401 and wrong.json() == {
            "message": "Incorrect API key provided"
        }
        assert requests.get(url + "/health", timeout=TIMEOUT).status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="secret", max_retries=0)
        assert client.completions.create(**body).choices[0].text
        plain = requests.post(url + "/v1/completions", data=json.dumps(body), timeout=TIMEOUT,
                              headers={**key, "Content-Type": "text/plain"})  # fmt: skip
        assert plain.status_code == 415 and "application/json" in plain.text
        big = requests.post(url + "/v1/completions", json=body | {"user": "x" * 3000},
                            headers=key, timeout=TIMEOUT)  # fmt: skip
        assert big.status_code == 413
        surrogate = b'{"model": "m", "prompt": "\\ud800", "max_tokens": 2}'
        bad = requests.post(url + "/v1/completions", data=surrogate, timeout=TIMEOUT,
                            headers={**key, **JSON})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text
        long = requests.post(url + "/v1/completions", json=body | {"max_tokens": 60},
                             headers=key, timeout=TIMEOUT)  # fmt: skip
        error = long.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
        assert error["message"].startswith(
            "This model's maximum context length is 48 tokens, however you requested 61 tokens "
            "(1 in your prompt; 60 for the completion)."
        )
        # a client that sends half a body and hangs up is no error of the server's
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as raw:
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                        b"secret\r\nContent-Type: application/json\r\nContent-Length: 500"
                        b"\r\n\r\n{\"prompt\": ")  # fmt: skip
        time.sleep(1.0)
        assert requests.get(url + "/health", timeout=TIMEOUT).status_code == 200
    finally:
        output = stop_server(process)
    assert "Traceback" not in output and "unexpected error" not in output, output
