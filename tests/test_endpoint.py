"""``regen --endpoint`` against a real OpenAI-compatible HTTP server on 127.0.0.1.

The server is a small stdlib ``http.server`` in a thread that serves a tiny target through
transformers (``/v1/models``, ``/v1/chat/completions`` with greedy ``generate`` and usage counts).
Knobs on the server plant the failures a real deployment has: a prompt that always errors, one
that errors a few times first, a template that counts other prompt tokens, a required API key.
"""

import dataclasses
import json
import socket
import struct
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_train.cli import build_parser
from dflash_train.data.regen import options_from_args, run_regen
from dflash_train.data.stored_ids import without_token_ids


class TinyServer:
    """A tiny target behind the OpenAI chat-completions API (greedy only, like a vLLM at T=0)."""

    def __init__(self, target_dir, api_key=None):
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.api_key, self.always_fail, self.fail_first = api_key, set(), Counter()
        self.prompt_token_offset, self.requests = 0, Counter()
        # Prompts answered with a null message, with a body cut short (the connection closes early), or
        # with a body its Content-Encoding header says is gzip that is not.
        self.null_message, self.torn, self.garbled = set(), set(), set()
        # Prompts never answered (until close), or whose connection is reset (RST) without an answer.
        self.hang, self.reset, self.released = set(), set(), threading.Event()
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def reply(self, code, body, torn=False, garbled=False):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                if garbled:
                    self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(data) + 100 * torn))  # torn: promises more
                self.end_headers()
                self.wfile.write(data)

            def authorised(self):
                if server.api_key and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                    self.reply(401, {"error": "bad key"})
                    return False
                return True

            def do_GET(self):
                if self.authorised():
                    self.reply(200, {"data": [{"id": "tiny"}]})

            def do_POST(self):
                if not self.authorised():
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                last = body["messages"][-1]["content"]
                if last in server.hang or last in server.reset:
                    with server.lock:
                        server.requests[last] += 1
                    if last in server.hang:
                        server.released.wait(30)
                    else:
                        self.connection.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                        self.close_connection = True
                    return
                code, answer = server.complete(body)
                self.reply(code, answer, torn=last in server.torn, garbled=last in server.garbled)

        return Handler

    def complete(self, body):
        last = body["messages"][-1]["content"]
        with self.lock:
            self.requests[last] += 1
            if last in self.always_fail:
                return 500, {"error": "planted failure"}
            if self.fail_first[last] > 0:
                self.fail_first[last] -= 1
                return 503, {"error": "busy"}
        kwargs = body.get("chat_template_kwargs") or {}
        text = self.tokenizer.apply_chat_template(
            body["messages"], tokenize=False, add_generation_prompt=True, **kwargs
        )
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with self.lock, torch.inference_mode():
            out = self.model.generate(
                ids,
                max_new_tokens=body["max_tokens"],
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        new = out[0, ids.shape[1] :].tolist()
        eos = self.tokenizer.eos_token_id
        stopped = eos in new
        content = self.tokenizer.decode(new[: new.index(eos)] if stopped else new, skip_special_tokens=False)
        usage = {"prompt_tokens": ids.shape[1] + self.prompt_token_offset, "completion_tokens": len(new)}
        choice = {
            "message": None if last in self.null_message else {"role": "assistant", "content": content},
            "finish_reason": "stop" if stopped else "length",
        }
        return 200, {"choices": [choice], "usage": usage}

    def close(self):
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()


ROWS = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old"}, {"role": "user", "content": "more"}, {"role": "assistant", "content": "old"}]},
    {"messages": [{"role": "user", "content": "prompt only"}]},
    {"messages": [{"role": "user", "content": "flaky"}]},
    {"messages": [{"role": "user", "content": "doomed"}]},
]  # fmt: skip


@pytest.fixture
def server(tiny_qwen3_dir):
    srv = TinyServer(tiny_qwen3_dir)
    yield srv
    srv.close()


@pytest.fixture
def chat_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def endpoint_options(target, data, output, url, *extra, **overrides):
    argv = ["regen", "--target", str(target), "--data", str(data), "--output", str(output), "--endpoint", url]
    argv += ["--max-new-tokens", "4", "--concurrency", "3", "--retries", "2", *extra]
    return dataclasses.replace(options_from_args(build_parser().parse_args(argv)), **overrides)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_endpoint_regen_matches_local_greedy_and_reports_failures(
    server, tiny_qwen3_dir, chat_file, tmp_path, monkeypatch
):
    monkeypatch.setattr("dflash_train.data.endpoint.MAX_BACKOFF_S", 0.05)
    server.always_fail.add("doomed")
    server.fail_first["flaky"] = 2  # two 503s, then an answer: retried, not failed
    output = tmp_path / "regen.jsonl"
    result = run_regen(endpoint_options(tiny_qwen3_dir, chat_file, output, server.url))
    assert result["engine"] == "endpoint" and result["rows_done"] == 3 and result["rows_failed"] == 1
    failed = read_jsonl(tmp_path / "regen.failed.jsonl")
    assert len(failed) == 1 and failed[0]["line"] == 4 and "HTTP 500" in failed[0]["reason"]
    assert server.requests["doomed"] == 3 and server.requests["flaky"] == 3  # 1 + 2 retries each

    local = tmp_path / "local.jsonl"
    argv = ["regen", "--target", str(tiny_qwen3_dir), "--data", str(chat_file), "--output", str(local)]
    run_regen(
        options_from_args(build_parser().parse_args([*argv, "--max-new-tokens", "4", "--device", "cpu"]))
    )
    # Same greedy replies, same turns; the endpoint returns text only, so its rows store no ids.
    by_line = {r["regen"]["line"]: without_token_ids(r["messages"]) for r in read_jsonl(local)}
    for row in read_jsonl(output):
        assert row["messages"] == by_line[row["regen"]["line"]]

    # A rerun retries only the failed row (now healed) and appends it.
    server.always_fail.clear()
    again = run_regen(endpoint_options(tiny_qwen3_dir, chat_file, output, server.url))
    assert again["rows_done"] == 1 and again["rows_skipped"] == 3 and again["rows_failed"] == 0
    assert (tmp_path / "regen.failed.jsonl").read_text() == ""


def test_endpoint_refuses_a_server_with_another_template(server, tiny_qwen3_dir, chat_file, tmp_path):
    server.prompt_token_offset = 1  # e.g. a server that adds a BOS the local template does not write
    with pytest.raises(ValueError, match="counts .* prompt tokens"):
        run_regen(endpoint_options(tiny_qwen3_dir, chat_file, tmp_path / "o.jsonl", server.url))


def test_unreachable_endpoint_fails_fast_naming_the_url(tiny_qwen3_dir, chat_file, tmp_path):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"cannot reach .*127.0.0.1:{port}/v1"):
        run_regen(endpoint_options(tiny_qwen3_dir, chat_file, tmp_path / "o.jsonl", url))
    assert time.perf_counter() - start < 5


def test_endpoint_api_key(tiny_qwen3_dir, chat_file, tmp_path, monkeypatch):
    srv = TinyServer(tiny_qwen3_dir, api_key="sekret")
    try:
        with pytest.raises(ValueError, match="HTTP 401"):
            run_regen(endpoint_options(tiny_qwen3_dir, chat_file, tmp_path / "a.jsonl", srv.url))
        with pytest.raises(ValueError, match="MY_KEY: that environment variable is not set"):
            run_regen(
                endpoint_options(
                    tiny_qwen3_dir, chat_file, tmp_path / "a.jsonl", srv.url, "--api-key-env", "MY_KEY"
                )
            )
        monkeypatch.setenv("MY_KEY", "sekret")
        opts = endpoint_options(
            tiny_qwen3_dir, chat_file, tmp_path / "b.jsonl", srv.url, "--api-key-env", "MY_KEY"
        )
        assert run_regen(opts)["rows_done"] == 4
    finally:
        srv.close()


def test_a_null_message_or_a_torn_reply_fails_only_its_row(
    server, tiny_qwen3_dir, chat_file, tmp_path, monkeypatch
):
    """Both end in OUTPUT.failed.jsonl with a reason (a torn body after its retries); the run goes on."""
    monkeypatch.setattr("dflash_train.data.endpoint.MAX_BACKOFF_S", 0.0)
    server.null_message.add("flaky")
    server.torn.add("doomed")
    output = tmp_path / "regen.jsonl"
    result = run_regen(endpoint_options(tiny_qwen3_dir, chat_file, output, server.url))
    assert result["rows_done"] == 2 and result["rows_failed"] == 2
    reasons = {r["line"]: r["reason"] for r in read_jsonl(tmp_path / "regen.failed.jsonl")}
    assert set(reasons) == {3, 4} and "malformed completion" in reasons[3]
    assert "complete message body" in reasons[4] and "after 2 retries" in reasons[4]
    assert server.requests["doomed"] == 3  # retried: a cut connection may succeed next time


def test_a_hung_or_reset_request_is_retried_then_fails_only_its_row(
    server, tiny_qwen3_dir, chat_file, tmp_path, monkeypatch
):
    """No answer within --timeout-s and a reset connection are retried, then reported with the
    reason; the other rows regenerate."""
    monkeypatch.setattr("dflash_train.data.endpoint.MAX_BACKOFF_S", 0.0)
    server.hang.add("flaky")
    server.reset.add("doomed")
    output = tmp_path / "regen.jsonl"
    start = time.perf_counter()
    result = run_regen(endpoint_options(tiny_qwen3_dir, chat_file, output, server.url, "--timeout-s", "0.5"))
    assert time.perf_counter() - start < 20
    assert result["rows_done"] == 2 and result["rows_failed"] == 2
    reasons = {r["line"]: r["reason"] for r in read_jsonl(tmp_path / "regen.failed.jsonl")}
    assert "ReadTimeout" in reasons[3] and "after 2 retries" in reasons[3]
    assert "after 2 retries" in reasons[4]
    assert server.requests["flaky"] == 3 and server.requests["doomed"] == 3


def test_a_body_that_does_not_decode_is_retried_then_fails_only_its_row(
    server, tiny_qwen3_dir, chat_file, tmp_path, monkeypatch
):
    """A body that is not what its Content-Encoding says (a proxy's broken gzip) raised httpx's
    DecodingError, which is no TransportError: it escaped the row's worker and ended the run."""
    monkeypatch.setattr("dflash_train.data.endpoint.MAX_BACKOFF_S", 0.0)
    server.garbled.add("doomed")
    output = tmp_path / "regen.jsonl"
    result = run_regen(endpoint_options(tiny_qwen3_dir, chat_file, output, server.url))
    assert result["rows_done"] == 3 and result["rows_failed"] == 1
    (failed,) = read_jsonl(tmp_path / "regen.failed.jsonl")
    assert failed["line"] == 4 and "DecodingError" in failed["reason"]
    assert "after 2 retries" in failed["reason"]
    assert server.requests["doomed"] == 3


def test_a_first_row_the_local_template_refuses_fails_alone(tmp_path, monkeypatch):
    """The server check rendered the first row locally: one the template refuses (Qwen3.5, a system
    turn after the first) raised the template's error and ended the run before any row."""
    from dflash_train.tiny import build_tiny_target
    from tests.chat_families import qwen_tokenizer, save_with

    monkeypatch.setattr("dflash_train.data.endpoint.MAX_BACKOFF_S", 0.0)
    tok = qwen_tokenizer("qwen3.5")
    save_with(tmp_path / "t", build_tiny_target("qwen3", vocab_size=len(tok), seed=0), tok)
    late_system = [
        {"role": "user", "content": "a"},
        {"role": "system", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [late_system, ROWS[1]["messages"]]))
    srv = TinyServer(tmp_path / "t")
    try:
        result = run_regen(endpoint_options(tmp_path / "t", data, tmp_path / "regen.jsonl", srv.url))
    finally:
        srv.close()
    assert result["rows_done"] == 1 and result["rows_failed"] == 1
    (failed,) = read_jsonl(tmp_path / "regen.failed.jsonl")
    assert failed["line"] == 1
