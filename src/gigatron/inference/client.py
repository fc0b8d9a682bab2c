"""`gigatron text-generation-cli HOST:PORT`: Megatron's interactive client of `PUT /api`.

Asks for a prompt and a number of tokens, prints the server's text; an error prints the
server's message. End with Ctrl-D (or Ctrl-C).
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

from gigatron.config.parser import command_parser
from gigatron.errors import GigatronError


def put_api(url: str, prompt: str, tokens_to_generate: int, timeout_s: float = 600.0) -> dict:
    """PUT {"prompts": [prompt], "tokens_to_generate": n} to `url`; the JSON answer (also for
    HTTP errors, which carry {"message": ...})."""
    body = json.dumps({"prompts": [prompt], "tokens_to_generate": tokens_to_generate}).encode()
    request = urllib.request.Request(
        url, data=body, method="PUT", headers={"Content-Type": "application/json; charset=UTF-8"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return {"status": response.status, **json.loads(response.read())}
    except urllib.error.HTTPError as error:
        try:
            payload = json.loads(error.read())
        except ValueError:
            payload = {}
        message = payload.get("message") if isinstance(payload, dict) else None
        return {"status": error.code, "message": message or error.reason}


def main(argv: Sequence[str]) -> int:
    """`gigatron text-generation-cli HOST:PORT`."""
    parser = command_parser(
        "text-generation-cli",
        "Interactive client of a generation server (gigatron serve, or Megatron's "
        "tools/run_text_generation_server.py): asks for a prompt and a number of tokens, sends "
        "PUT /api and prints the text. End with Ctrl-D.",
    )
    parser.add_argument("address", metavar="HOST:PORT", help="the server, e.g. localhost:5000")
    address = parser.parse_args(list(argv)).address
    url = address if address.startswith("http") else f"http://{address}"
    url = url.rstrip("/") + "/api"
    while True:
        try:
            prompt = input("Enter prompt: ")
            answer = input("Enter number of tokens to generate: ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        try:
            tokens = int(answer)
        except ValueError:
            print(f"Error: {answer!r} is not a whole number")
            continue
        try:
            response = put_api(url, prompt, tokens)
        except (urllib.error.URLError, OSError) as error:
            message = f"{address}: cannot reach the server ({error}); is it running?"
            raise GigatronError(message) from None
        if response["status"] != 200:
            print(f"Error {response['status']}: {response['message']}")
            continue
        print("Megatron Response: ")
        print(response["text"][0])
        sys.stdout.flush()
