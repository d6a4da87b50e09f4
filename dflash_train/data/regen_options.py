"""The options of ``dflash-train regen``, shared by the command (``data.regen``, which picks an
engine) and every engine (``data.endpoint`` and the in-process ones), so no engine module imports
the command that chooses it."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_train.data.regen_turns import THINKING
from dflash_train.generate.compiled_step import compile_decode_choice
from dflash_train.generate.decode_attention import decode_attention_choice
from dflash_train.generate.sampling import Sampling


@dataclass(kw_only=True)
class RegenOptions:
    """Options of ``dflash-train regen`` (the CLI builds this from its arguments)."""

    target: str
    data: list[str]
    output: str
    max_new_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    batch_size: int = 16
    thinking: str = "default"
    max_rows: int = 0
    max_bad_rows: int = 0
    engine: str = "auto"
    device: str = "auto"
    seed: int = 0
    # The in-process slot engine's torch.compile of its decode step: auto (its default), on, off.
    compile_decode: str = "auto"
    # Its decode attention: auto (its default: flex on CUDA for attention-only targets), flex, grouped.
    decode_attention: str = "auto"
    # OpenAI-compatible server (``http://HOST:PORT/v1``); empty = generate in process.
    endpoint: str = ""
    model: str = ""
    api_key_env: str = ""
    concurrency: int = 64
    timeout_s: float = 600.0
    retries: int = 4

    def __post_init__(self):
        if self.thinking not in THINKING:
            raise ValueError(f"--thinking {self.thinking!r}: use one of {list(THINKING)}")
        if self.engine not in ("auto", "vllm", "transformers", "endpoint"):
            raise ValueError(f"--engine {self.engine!r}: use auto, vllm, transformers or endpoint")
        if self.engine == "endpoint" and not self.endpoint:
            raise ValueError("--engine endpoint needs --endpoint http://HOST:PORT/v1")
        if self.batch_size < 1 or self.max_new_tokens < 1 or self.concurrency < 1 or self.retries < 0:
            raise ValueError("--batch-size, --max-new-tokens and --concurrency must be >= 1, --retries >= 0")
        Sampling(temperature=self.temperature, top_p=self.top_p)  # validates both
        compile_decode_choice(self.compile_decode)
        decode_attention_choice(self.decode_attention)
