"""``regen --endpoint``: regenerate through any OpenAI-compatible server (vLLM, SGLang, ...).

HTTP through one ``httpx.Client`` shared by a thread pool (the client is thread-safe and keeps up to
``--concurrency`` connections alive; the work is I/O, the GIL is released while waiting; docs/data.md
says why httpx). Each row's turns run in sequence in one worker; up to ``--concurrency`` rows are in
flight.

- Fast failure: ``GET /models`` once at start; an unreachable server raises a ValueError naming
  the URL, a 401/403 names ``--api-key-env``. Without ``--model`` the server's only model is used.
- Same tokens as training: the first request's reported ``usage.prompt_tokens`` must equal the
  local tokenizer's count for the same conversation (the local chat template with the generation
  prompt); otherwise the server renders another template and regen refuses with both counts.
- Retries: every transport failure (refused, reset or closed connection, a body cut short, no
  answer within ``--timeout-s``: httpx's ``TransportError``), a body that does not decode as its
  ``Content-Encoding`` says (``DecodingError``), a reply that is not JSON, HTTP 429 and
  5xx are retried with exponential backoff (1 s, 2 s, 4 s, ... capped at 30 s) up to ``--retries``
  times; other HTTP statuses (redirects included: they are not followed) fail the row at once. A
  failed row is reported with its reason (``OUTPUT.failed.jsonl``), never dropped silently.
- Sampling: ``temperature``, ``top_p``, ``max_tokens`` as the in-process engine, a per-turn
  ``seed`` from the row key, ``chat_template_kwargs.enable_thinking`` for ``--thinking on|off``.
  A reply the server's reasoning parser split off is kept as ``reasoning_content``.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from dflash_train.data.regen_options import RegenOptions
from dflash_train.data.regen_turns import THINKING, Reply, advance_to_reply, regenerate_row

MAX_BACKOFF_S = 30.0
CONNECT_CHECK_TIMEOUT_S = 10.0


class RequestError(Exception):
    """A request that failed; ``retryable`` says whether trying again may help."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


def base_url(endpoint: str) -> str:
    """``http://HOST:PORT/v1`` from what the user typed (a bare ``http://HOST:PORT`` gets ``/v1``)."""
    url = endpoint.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--endpoint {endpoint!r}: give a URL such as http://127.0.0.1:8000/v1")
    if url.count("/") == 2:  # scheme://host[:port] without a path
        url += "/v1"
    return url


class EndpointEngine:
    """Regenerates rows through ``/chat/completions`` of an OpenAI-compatible server."""

    name = "endpoint"

    def __init__(self, opts: RegenOptions, backoff_s: float = 1.0):
        from dflash_train.models.target_loading import load_tokenizer

        self.opts, self.url, self.backoff_s = opts, base_url(opts.endpoint), backoff_s
        headers = {}
        if opts.api_key_env:
            key = os.environ.get(opts.api_key_env)
            if not key:
                raise ValueError(f"--api-key-env {opts.api_key_env}: that environment variable is not set")
            headers["Authorization"] = f"Bearer {key}"
        connections = httpx.Limits(
            max_connections=opts.concurrency, max_keepalive_connections=opts.concurrency
        )
        self.client = httpx.Client(base_url=self.url, headers=headers, limits=connections)
        self.tokenizer = load_tokenizer(opts.target, trust_remote_code=False)
        if self.tokenizer is None:
            raise ValueError(
                f"--target {opts.target} has no tokenizer; regen tokenizes locally to check the server"
            )
        self.model = opts.model or self.served_model()
        self.checked = False

    # ------------------------------------------------------------------ HTTP

    def request(self, path: str, payload: dict | None, timeout: float) -> dict[str, Any]:
        """One HTTP call (POST with a payload, else GET); raises ``RequestError`` (retryable or not)."""
        method = "GET" if payload is None else "POST"
        try:
            response = self.client.request(method, path, json=payload, timeout=timeout)
        # refused, reset, closed, cut short, timed out, a body that does not decode as its
        # Content-Encoding says (a DecodingError is no TransportError): may pass next time
        except (httpx.TransportError, httpx.DecodingError) as err:
            raise RequestError(f"{type(err).__name__}: {err}", True) from err
        if not response.is_success:
            code = response.status_code
            where = (
                f" (a redirect to {response.headers.get('location')}: give that URL)"
                if response.is_redirect
                else ""
            )
            raise RequestError(f"HTTP {code}{where}: {response.text[:300]}", code == 429 or code >= 500)
        try:
            return response.json()
        except ValueError as err:  # JSONDecodeError, or bytes that are not UTF-8
            raise RequestError(f"the server's reply is not JSON: {err}", True) from err

    def served_model(self) -> str:
        """The only model the server lists (``--model`` picks one when it serves several)."""
        try:
            listing = self.request("/models", None, min(CONNECT_CHECK_TIMEOUT_S, self.opts.timeout_s))
        except RequestError as err:
            hint = f" (is {self.opts.api_key_env} the right key?)" if "HTTP 40" in str(err) else ""
            raise ValueError(
                f"cannot reach the OpenAI-compatible endpoint {self.url}/models: {err}{hint}; start the server "
                "(see docs/data.md for the vLLM and SGLang commands) or fix --endpoint"
            ) from err
        names = [m.get("id") for m in listing.get("data", [])]
        if len(names) != 1:
            raise ValueError(f"{self.url} serves models {names}: choose one with --model")
        return names[0]

    def payload(self, conversation: list[dict], key: int, max_tokens: int) -> dict[str, Any]:
        body = {
            "model": self.model,
            "messages": conversation,
            "max_tokens": max_tokens,
            "temperature": self.opts.temperature,
            "top_p": self.opts.top_p,
            "seed": key % 2**31,
        }
        thinking = THINKING[self.opts.thinking]
        if thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": thinking}
        return body

    def completion(self, conversation: list[dict], key: int, max_tokens: int) -> dict[str, Any]:
        """A chat completion with retries; raises the last ``RequestError``."""
        for attempt in range(self.opts.retries + 1):
            try:
                return self.request(
                    "/chat/completions", self.payload(conversation, key, max_tokens), self.opts.timeout_s
                )
            except RequestError as err:
                if not err.retryable or attempt == self.opts.retries:
                    raise
                time.sleep(min(MAX_BACKOFF_S, self.backoff_s * 2**attempt))
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ regen

    def complete(self, conversation: list[dict], key: int) -> Reply:
        """One assistant turn as a ``Reply`` (``error`` set when the row must be reported as failed)."""
        try:
            response = self.completion(conversation, key, self.opts.max_new_tokens)
        except RequestError as err:
            return Reply(
                "", False, error=f"{err} (after {self.opts.retries} retries)" if err.retryable else str(err)
            )
        try:
            return reply_of(response)
        except (KeyError, IndexError, TypeError) as err:
            return Reply("", False, error=f"malformed completion ({type(err).__name__}: {err})")

    def check_prompt_tokens(self, conversation: list[dict]) -> bool:
        """Refuse a server whose chat template gives other prompt tokens than the local one; False
        (nothing checked) for a conversation the local template refuses (its row fails at the server)."""
        kwargs = (
            {} if THINKING[self.opts.thinking] is None else {"enable_thinking": THINKING[self.opts.thinking]}
        )
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception:  # jinja raises many types, incl. raise_exception() in templates
            return False
        local = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        try:
            served = self.completion(conversation, 0, 1)["usage"]["prompt_tokens"]
        except RequestError as err:
            raise ValueError(f"{self.url}: the first request failed: {err}") from err
        except (KeyError, TypeError) as err:
            raise ValueError(
                f"{self.url} reports no usage.prompt_tokens, so its template cannot be checked"
            ) from err
        if served != local:
            raise ValueError(
                f"{self.url} counts {served} prompt tokens for the first conversation, the local tokenizer of "
                f"{self.opts.target} {local}: the server renders another chat template (or adds a BOS). Serve "
                "the target with its own tokenizer and template, or point --target at the served one."
            )
        return True

    def regenerate(self, rows):
        """Rows in input order, each regenerated by one worker (turns in sequence)."""
        if not self.checked:  # on the first row the local template renders (a later batch if none)
            self.checked = any(self.check_prompt_tokens(first_prompt(row)) for row in rows)
        with ThreadPoolExecutor(max_workers=self.opts.concurrency) as pool:
            return list(pool.map(lambda row: regenerate_row(self.complete, row), rows))


def first_prompt(row) -> list[dict]:
    """The turns of ``row`` before its first reply."""
    conversation: list[dict] = []
    advance_to_reply(row, conversation, [0], 0)
    return conversation


def reply_of(response: Any) -> Reply:
    """The ``Reply`` of a chat completion; KeyError, IndexError or TypeError where it is malformed
    (no choices, a ``null`` message, content that is not text)."""
    choice = response["choices"][0]
    message = choice["message"]
    if not isinstance(message, dict):
        raise TypeError(f"choices[0].message is {json.dumps(message)}, not an object")
    content, reasoning = message.get("content"), message.get("reasoning_content") or message.get("reasoning")
    if not isinstance(content, (str, type(None))) or not isinstance(reasoning, (str, type(None))):
        raise TypeError(f"choices[0].message has content {content!r} and reasoning {reasoning!r}, not text")
    return Reply(content or "", choice.get("finish_reason") == "stop", reasoning=reasoning)
