"""`gigatron serve --load CKPT --port 5000`: an HTTP server (FastAPI on uvicorn) over the engine.

Endpoints: Megatron's `PUT /api` (api_megatron.py), OpenAI's `POST /v1/completions` and
`POST /v1/chat/completions` (also without `/v1`; `stream: true` sends server-sent events),
`GET /v1/models`, `GET /health` (and `/v1/health`).

One engine thread runs `InferenceEngine.serve_forever`: requests from every connection join the
running batch at the next step boundary while cache slots are free and queue otherwise. Handlers
wait on their completions without blocking the event loop. A bad request gets HTTP 400 naming
the field; an unexpected failure gets HTTP 500 with no traceback; a client that disconnects
mid-stream has its request cancelled, which frees its slot. Under torchrun (the checkpoint's
tensor/pipeline layout), rank 0 serves and the other ranks follow its steps.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations
# (`request: Request`, imported inside create_app) as real classes.
import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from gigatron.inference import api_openai as oai
from gigatron.inference.api_megatron import (
    RequestError,
    megatron_beam_response,
    megatron_response,
    parse_megatron_request,
)
from gigatron.inference.engine import Completion, InferenceEngine, SamplingParams
from gigatron.inference.http_guard import (
    DEFAULT_MAX_BODY_BYTES,
    EncodingGuard,
    add_guards,
    check_json_request,
)

log = logging.getLogger("gigatron.serve")


class EngineBridge:
    """Runs the engine in a thread; lets coroutines submit requests and await their tokens."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gigatron-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.engine.serve_forever(self._stop)
        finally:
            self.engine.runner.stop_followers()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self.engine.close()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def submit(self, prompt: list[int], params: SamplingParams) -> tuple[Completion, asyncio.Queue]:
        """Queue a request; the returned queue receives None after each update."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        def notify(_: Completion) -> None:
            loop.call_soon_threadsafe(updates.put_nowait, None)

        return self.engine.submit(prompt, params, on_update=notify), updates

    async def complete(self, prompt: list[int], params: SamplingParams) -> Completion:
        completion, updates = self.submit(prompt, params)
        try:
            while not completion.finished:
                await updates.get()
        finally:
            if not completion.finished:
                self.engine.cancel(completion.request_id)
        return completion


def _prepare(
    engine: InferenceEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    openai_words: str | None = None,
):
    """Per-prompt parameters (max_tokens -1: the rest of the context); RequestError when a
    prompt does not fit (`openai_words` "prompt" or "messages": in OpenAI's words)."""
    vocab = engine.runner.vocab_size
    prepared = []
    for prompt in prompts:
        if any(t < 0 or t >= vocab for t in prompt):
            raise RequestError(f"prompt: token ids must be in [0, {vocab})", "prompt")
        own = SamplingParams(**vars(params))
        if own.max_tokens < 0:
            own.max_tokens = max(1, engine.max_sequence_length - len(prompt))
        total, limit = len(prompt) + own.max_tokens, engine.max_sequence_length
        if openai_words and prompt and total > limit:
            raise _context_error(openai_words, limit, len(prompt), own.max_tokens)
        try:
            engine.check_length(len(prompt), own.max_tokens)
        except ValueError as error:
            field = (
                "prompt"
                if len(prompt) >= engine.max_sequence_length or not prompt
                else "max_tokens"
            )
            raise RequestError(f"{field}: {error}", field) from None
        prepared.append(own)
    return prepared


def _context_error(words: str, limit: int, prompt: int, completion: int) -> RequestError:
    """OpenAI's context_length_exceeded error (its two wordings, completions and chat)."""
    total = prompt + completion
    if words == "prompt":
        message = (
            f"This model's maximum context length is {limit} tokens, however you requested "
            f"{total} tokens ({prompt} in your prompt; {completion} for the completion). "
            "Please reduce your prompt; or completion length."
        )
    else:
        message = (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{total} tokens ({prompt} in the messages, {completion} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    param = words if prompt >= limit else "max_tokens"
    return RequestError(message, param, code="context_length_exceeded")


def _with_seed(params: SamplingParams, index: int) -> SamplingParams:
    """The n choices of one request differ: choice i uses seed + i when a seed is given."""
    own = SamplingParams(**vars(params))
    if own.seed is not None:
        own.seed += index
    return own


def _check_beam_request(engine: InferenceEngine, parsed: Any) -> None:
    """RequestError (naming best_of) when this request cannot run beam search here."""
    if parsed.stream:
        raise RequestError("best_of: more than n (beam search) cannot stream", "best_of")
    try:
        parsed.params.validate()
    except ValueError as error:
        raise RequestError(f"best_of: {error}", "best_of") from None
    if engine.scheduler is not None or parsed.params.beam_width > engine.max_batch_size:
        raise RequestError(
            f"best_of: beam search of width {parsed.params.beam_width} needs as many cache "
            f"slots of the static engine; this server has {engine.max_batch_size}"
            f"{' (dynamic engine)' if engine.scheduler is not None else ''}",
            "best_of",
        )


def _beam_choices(parsed: Any, results: list[Completion], tokenizer) -> tuple[list, list]:
    """(jobs, completions) of the n best beams of each prompt, as the n choices."""
    jobs, completions = [], []
    for index, (prompt, result) in enumerate(zip(parsed.prompts, results)):
        for choice, beam in enumerate(result.beams[: parsed.n]):
            jobs.append((index * parsed.n + choice, prompt, parsed.params))
            completion = Completion(result.request_id, prompt, list(beam.tokens))
            completion.text = tokenizer.detokenize(beam.tokens)
            completion.finish_reason = "stop" if beam.stopped else "length"
            completions.append(completion)
    return jobs, completions


def _add_error_handlers(app: Any) -> None:
    """Errors answer in Megatron's JSON shape ({"message": ...}), never with a traceback."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return JSONResponse({"message": str(error.detail)}, status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        return JSONResponse({"message": "invalid request"}, status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return JSONResponse({"message": "internal server error"}, status_code=500)


def _openai_response(
    jobs: list, completions: list[Completion], parsed: Any, chat: bool, model: str, tokenizer
) -> dict[str, Any]:
    """The JSON answer of a (chat) completion request that does not stream."""
    prompts = [p for _, p, _ in jobs]
    choices = []
    for (index, prompt, _), completion in zip(jobs, completions):
        if chat:
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": completion.text},
                "logprobs": oai.chat_logprobs(completion, tokenizer)
                if parsed.logprobs is not None
                else None,
                "finish_reason": oai.finish_reason(completion),
            }
        else:
            prefix = tokenizer.detokenize(prompt) if parsed.echo else ""
            choice = {
                "index": index,
                "text": prefix + completion.text,
                "logprobs": oai.completion_logprobs(completion, tokenizer, parsed.echo, 0)
                if parsed.logprobs is not None
                else None,
                "finish_reason": oai.finish_reason(completion),
            }
        choices.append(choice)
    return {
        "id": oai.new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion" if chat else "text_completion",
        "created": oai.timestamp(),
        "model": model,
        "choices": choices,
        "usage": oai.usage(completions, prompts),
    }


def _add_info_routes(app: Any, engine: InferenceEngine, model_name: str) -> None:
    """GET /v1/models and /health."""
    started = oai.timestamp()

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "gigatron"}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        return {
            "status": "ok", "service": "gigatron inference server", "ready": True,
            **engine.stats(),
        }  # fmt: skip


async def read_json(request: Any) -> Any:
    """The request's JSON body; RequestError when it is too large, not declared as JSON or
    not JSON."""
    # why: starlette comes with the optional `serve` extra
    from starlette.requests import ClientDisconnect

    try:
        raw = await request.body()
    except ClientDisconnect:  # the client went away mid-body: an answer nobody reads, no error
        raise RequestError("the client disconnected before sending the whole body", None) from None
    check_json_request(request.headers, raw, request.app.state.max_body_bytes)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RequestError("the request body is not valid JSON", None) from None


def _add_megatron_route(app: Any, engine: InferenceEngine, bridge: EngineBridge, tokenizer) -> None:
    """Megatron's `PUT /api`."""
    # why: fastapi is the optional `serve` extra
    from fastapi import Request
    from fastapi.responses import JSONResponse

    eod = getattr(tokenizer, "eod", None)

    @app.put("/api")
    async def megatron_api(request: Request):
        try:
            parsed = parse_megatron_request(await read_json(request), eod, engine.runner.vocab_size)
            bos = tokenizer.bos if tokenizer.bos is not None else tokenizer.eod
            encoder = EncodingGuard(tokenizer, "prompts")
            prompts = [
                ([bos] if parsed.add_bos else []) + encoder.tokenize(p) for p in parsed.prompts
            ]
            per_prompt = _prepare(engine, prompts, parsed.params)
        except RequestError as error:
            return JSONResponse({"message": error.message}, status_code=error.status)
        if parsed.params.beam_width:
            try:
                completion = await bridge.complete(prompts[0], per_prompt[0])
            except ValueError as error:
                return JSONResponse({"message": str(error)}, status_code=400)
            return megatron_beam_response(completion, tokenizer)
        completions = await asyncio.gather(
            *(bridge.complete(p, q) for p, q in zip(prompts, per_prompt))
        )
        return megatron_response(list(completions), tokenizer, parsed.params.logprobs)


def _parse_openai(body: Any, chat: bool, engine: InferenceEngine, tokenizer, template):
    """(parsed request, per-prompt parameters) of an OpenAI request; RequestError."""
    if chat:
        parsed = oai.parse_chat_request(body, EncodingGuard(tokenizer, "messages"), template)
    else:
        parsed = oai.parse_completion_request(body, EncodingGuard(tokenizer, "prompt"))
    words = "messages" if chat else "prompt"
    per_prompt = _prepare(engine, parsed.prompts, parsed.params, openai_words=words)
    if parsed.params.beam_width:
        _check_beam_request(engine, parsed)
    return parsed, per_prompt


def create_app(
    engine: InferenceEngine,
    tokenizer,
    model_name: str = "gigatron",
    api_keys: tuple[str, ...] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    prompt_format: str | None = None,
):
    """The FastAPI application (the engine thread starts and stops with it). `api_keys`: the
    keys a request must bring as `Authorization: Bearer` (none: open); `max_body_bytes`: the
    largest request body; chats use the template of `prompt_format`
    (--sft-tokenizer-prompt-format) or the tokenizer's."""

    # why: fastapi is the optional `serve` extra
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    bridge = EngineBridge(engine)
    template = oai.chat_template_of(tokenizer, prompt_format)

    @asynccontextmanager
    async def lifespan(app):
        bridge.start()
        yield
        bridge.stop()

    app = FastAPI(title="gigatron", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.bridge = bridge
    app.state.max_body_bytes = max_body_bytes
    add_guards(app, api_keys, max_body_bytes)

    def openai_error(
        message: str, param: str | None, status: int = 400, code: str | None = None
    ) -> JSONResponse:
        kind = "invalid_request_error" if status < 500 else "server_error"
        body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
        return JSONResponse(body, status_code=status)

    _add_error_handlers(app)

    _add_megatron_route(app, engine, bridge, tokenizer)

    # ---- OpenAI ---------------------------------------------------------------------------
    async def openai_call(request: Request, chat: bool):
        try:
            parsed, per_prompt = _parse_openai(
                await read_json(request), chat, engine, tokenizer, template
            )
        except RequestError as error:
            return openai_error(error.message, error.param, error.status, error.code)
        model = parsed.model or model_name
        if parsed.params.beam_width:
            beams = await asyncio.gather(
                *(bridge.complete(p, q) for p, q in zip(parsed.prompts, per_prompt))
            )
            jobs, completions = _beam_choices(parsed, list(beams), tokenizer)
            return _openai_response(jobs, completions, parsed, chat, model, tokenizer)
        jobs = [
            (index * parsed.n + choice, prompt, _with_seed(params, choice))
            for index, (prompt, params) in enumerate(zip(parsed.prompts, per_prompt))
            for choice in range(parsed.n)
        ]
        if parsed.stream:
            stream = _stream(bridge, tokenizer, jobs, parsed, chat, model)
            return StreamingResponse(stream, media_type="text/event-stream")
        completions = await asyncio.gather(*(bridge.complete(p, q) for _, p, q in jobs))
        return _openai_response(jobs, list(completions), parsed, chat, model, tokenizer)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        return await openai_call(request, chat=False)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        return await openai_call(request, chat=True)

    _add_info_routes(app, engine, model_name)
    return app


def _safe_text(text: str, stops: tuple[str, ...]) -> str:
    """The part of a running text that can be sent: not an incomplete UTF-8 character, not a
    tail that might begin a stop string."""
    hold = max((len(s) - 1 for s in stops), default=0)
    if hold:
        text = text[: max(0, len(text) - hold)]
    return text.rstrip("\ufffd")


async def _stream(bridge, tokenizer, jobs, parsed, chat: bool, model: str) -> AsyncIterator[str]:
    """Server-sent events: one chunk per text delta of any choice, a last chunk per choice with
    its finish_reason, a usage chunk when asked, then `[DONE]`."""
    ident = oai.new_id("chatcmpl" if chat else "cmpl")
    created = oai.timestamp()
    kind = "chat.completion.chunk" if chat else "text_completion"
    queue: asyncio.Queue = asyncio.Queue()
    running = []
    for index, prompt, params in jobs:
        completion, updates = bridge.submit(prompt, params)
        running.append((index, completion, params))

        async def forward(updates=updates, index=index):
            while True:
                await updates.get()
                await queue.put(index)

        running[-1] = (*running[-1], asyncio.ensure_future(forward()))

    def event(index: int, delta: str | None, reason: str | None) -> str:
        if chat:
            payload = {} if delta is None else {"content": delta}
            if delta == "" and reason is None:
                payload = {"role": "assistant", "content": ""}
            choice = {"index": index, "delta": payload, "logprobs": None, "finish_reason": reason}
        else:
            choice = {
                "index": index,
                "text": delta or "",
                "logprobs": None,
                "finish_reason": reason,
            }
        chunk = {
            "id": ident,
            "object": kind,
            "created": created,
            "model": model,
            "choices": [choice],
        }
        return f"data: {json.dumps(chunk)}\n\n"

    sent = {index: "" for index, *_ in running}
    done: set[int] = set()
    try:
        if chat:
            for index, *_ in running:
                yield event(index, "", None)
        while len(done) < len(running):
            index = await queue.get()
            if index in done:
                continue
            _, completion, params, _ = next(r for r in running if r[0] == index)
            if completion.finished:
                text = completion.text
                reason = oai.finish_reason(completion)
            else:
                text = _safe_text(tokenizer.detokenize(completion.output_ids), params.stop)
                reason = None
            if text.startswith(sent[index]) and len(text) > len(sent[index]):
                yield event(index, text[len(sent[index]) :], None)
                sent[index] = text
            if reason is not None:
                done.add(index)
                yield event(index, None, reason)
        if parsed.include_usage:
            completions = [c for _, c, _, _ in running]
            chunk = {
                "id": ident, "object": kind, "created": created, "model": model, "choices": [],
                "usage": oai.usage(completions, [p for _, p, _ in jobs]),
            }  # fmt: skip
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for _, completion, _, task in running:
            task.cancel()
            if not completion.finished:
                bridge.engine.cancel(completion.request_id)
