"""``dflash-train serve-check``: the export decoded by llama.cpp next to the exact eval.

Offline, a stand-in ``llama-server`` (a small HTTP server speaking the routes and ``timings`` fields
llama.cpp's server answers with) and a stand-in converter check the wiring: the flags each run gets,
the tau read from ``draft_n_accepted``, the lossless comparison with the plain run, and that every
server is stopped, also on error. With a real llama.cpp build (``DFLASH_LLAMA_SERVER``,
``DFLASH_LLAMA_CONVERT``) and the real target (``DFLASH_REAL_TARGET``), a drafter trained for a few
steps is served and its acceptance compared with the eval's:

    DFLASH_LLAMA_SERVER=.../build/bin/llama-server DFLASH_LLAMA_CONVERT=.../convert_hf_to_gguf.py \\
    DFLASH_REAL_TARGET=/work/smollm2-hf DFLASH_REAL_TARGET_GGUF=~/.cache/real-target/SmolLM2-135M-Instruct.Q4_1.gguf \\
    pytest -m real tests/test_serve_check.py
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_train.eval import llama_cpp
from dflash_train.eval.serve_check import MIN_ACCEPTED_TO_JUDGE, ServeCheckOptions, run_serve_check
from dflash_train.models.drafter_config import DFlashDraftConfig
from dflash_train.models.serving import serving_flags

BLOCK = 4
LAYER_IDS = [0, 2]
MAX_NEW_TOKENS = 9

pytestmark = pytest.mark.usefixtures("one_thread_module")

FAKE_HELP = """-m, --model FNAME  -md, --spec-draft-model FNAME  --spec-type [none|draft-dflash|ngram-simple|ngram-mod]
--spec-draft-n-max N  --spec-draft-p-min P  --jinja, --no-jinja  -c, --ctx-size N  -t, --threads N
--spec-ngram-simple-size-n N  --spec-ngram-simple-size-m N  -np, --parallel N  --host HOST  --port PORT"""

# Speaks the llama-server routes serve-check uses. Per --spec-type: accepted drafts per request (5 for
# an n-gram type before the drafter, "ngram-simple,draft-dflash") and the text it answers; FAIL_CHAT / FAIL_START make it answer 500 / exit while loading, HANG / DROP make
# it hang on a chat request / reset its connection, COUNTS=all-accepted reports every draft accepted
# (what builds that count only fully accepted rounds report on a recurrent target).
FAKE_SERVER = """
import http.server, json, os, socket, struct, sys, time
args = sys.argv[1:]
if "--help" in args:
    print(os.environ["FAKE_HELP"]); sys.exit(0)
spec = args[args.index("--spec-type") + 1] if "--spec-type" in args else "plain"
record = os.environ["FAKE_RECORD"]
with open(os.path.join(record, spec + ".json"), "w") as f:
    json.dump({"argv": args, "pid": os.getpid()}, f)
if os.environ.get("FAKE_FAIL_START") == spec:
    print("error: failed to load the draft model"); sys.exit(3)
accepted = {"plain": 0, "draft-dflash": 4, "ngram-simple": 2, "ngram-mod": 0}.get(spec, 5)
text = "a changed reply" if spec == "ngram-mod" else "the same reply"

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self.answer(200, {"status": "ok"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/apply-template":
            return self.answer(200, {"prompt": "rendered"})
        if self.path == "/tokenize":
            return self.answer(200, {"tokens": [5, 6, 7]})
        if os.environ.get("FAKE_FAIL_CHAT") == spec:
            return self.answer(500, {"error": {"message": "decode failed"}})
        print("slot launch_slot_: id  0 | task 0 | processing task", flush=True)
        if os.environ.get("FAKE_HANG") == spec:
            time.sleep(60)  # the client gives up first; stop() ends the process
            return
        if os.environ.get("FAKE_DROP") == spec:  # reset the connection (RST) without an answer
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        n = body["max_tokens"]
        timings = {"predicted_n": n, "predicted_ms": 10.0}
        if spec != "plain":
            drafted = 3 * (n - 1 - accepted)
            if os.environ.get("FAKE_COUNTS") == "all-accepted":
                drafted = accepted
            timings.update(draft_n=drafted, draft_n_accepted=accepted)
        self.answer(200, {"choices": [{"message": {"role": "assistant", "content": text},
                                       "finish_reason": "length"}],
                          "usage": {"prompt_tokens": 3, "completion_tokens": n}, "timings": timings})

import threading
threading.Timer(300, os._exit, [0]).start()  # never outlives a broken stop() for long
http.server.ThreadingHTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
"""

FAKE_CONVERTER = """
import json, os, sys
args = sys.argv[1:]
out = args[args.index("--outfile") + 1]
open(out, "wb").write(b"GGUF")
with open(os.path.join(os.environ["FAKE_RECORD"], "convert-" + os.path.basename(out) + ".json"), "w") as f:
    json.dump(args, f)
"""


@pytest.fixture
def fake_llama(tmp_path, monkeypatch):
    """A stand-in llama-server binary and converter; what they were called with lands in ``record``."""
    record = tmp_path / "record"
    record.mkdir()
    server = tmp_path / "llama-server"
    server.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    server.chmod(0o755)
    converter = tmp_path / "convert_hf_to_gguf.py"
    converter.write_text(FAKE_CONVERTER)
    monkeypatch.setenv("FAKE_RECORD", str(record))
    monkeypatch.setenv("FAKE_HELP", FAKE_HELP)
    return {"server": str(server), "converter": str(converter), "record": record}


@pytest.fixture
def tiny_export(tiny_qwen3_dir, tmp_path):
    """A random tiny drafter exported for the tiny Qwen3 target, and a prompt file of two chat rows."""
    return export_for(tiny_qwen3_dir, tmp_path)


def export_for(target_dir, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from dflash_train.config import DrafterConfig
    from dflash_train.models import presets
    from dflash_train.models.drafter import DFlashDrafter
    from dflash_train.models.export import save_drafter

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    config = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=BLOCK),
        AutoConfig.from_pretrained(target_dir),
        target_layer_ids=LAYER_IDS,
        mask_token_id=tokenizer.mask_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(config).eval(), config, tmp_path / "export", dtype="float32")
    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "x"}]},
        {"prompt": "the quick brown fox"},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"target": str(target_dir), "export": str(tmp_path / "export"), "prompts": str(prompts)}


def fake_options(fake_llama, tiny_export, tmp_path, **extra) -> ServeCheckOptions:
    return ServeCheckOptions(
        target=tiny_export["target"], drafter=tiny_export["export"], prompts=[tiny_export["prompts"]],
        max_new_tokens=MAX_NEW_TOKENS, llama_server=fake_llama["server"],
        llama_convert=fake_llama["converter"], workdir=str(tmp_path / "work"), startup_timeout_s=60, **extra,
    )  # fmt: skip


def servers_started(record: Path) -> dict[str, dict]:
    return {
        p.stem: json.loads(p.read_text()) for p in record.glob("*.json") if not p.stem.startswith("convert")
    }


def assert_stopped(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_serve_check_reads_the_engine_and_compares_it_with_the_eval(fake_llama, tiny_export, tmp_path):
    result = run_serve_check(fake_options(fake_llama, tiny_export, tmp_path))
    started = servers_started(fake_llama["record"])
    combined = {"ngram-simple,draft-dflash", "ngram-mod,draft-dflash"}
    assert set(started) == {"plain", "draft-dflash", "ngram-simple", "ngram-mod", *combined}
    work = tmp_path / "work"
    dflash = started["draft-dflash"]["argv"]
    assert dflash[dflash.index("--spec-draft-n-max") + 1] == str(BLOCK - 1)
    assert dflash[dflash.index("--spec-draft-p-min") + 1] == "0"  # a block is never cut short
    for name in combined:  # the drafter's flags, the n-gram type first in one --spec-type list
        argv = started[name]["argv"]
        assert argv[argv.index("-md") + 1] == str(work / "draft-f32.gguf")
        assert argv[argv.index("--spec-draft-n-max") + 1] == str(BLOCK - 1)
        assert argv[argv.index("--spec-draft-p-min") + 1] == "0"
    # ngram-simple, alone and first, with the eval's key size 3 and at most 48 tokens per lookup round.
    for name in ("ngram-simple", "ngram-simple,draft-dflash"):
        argv = started[name]["argv"]
        assert argv[argv.index("--spec-ngram-simple-size-n") + 1] == "3"
        assert argv[argv.index("--spec-ngram-simple-size-m") + 1] == "48"
    assert "--spec-ngram-simple-size-n" not in started["ngram-mod,draft-dflash"]["argv"]
    # SERVING.md's combined llama-server line carries exactly the flags this run had.
    config = DFlashDraftConfig.from_serving_dict(
        json.loads(Path(tiny_export["export"], "config.json").read_text())
    )
    line = serving_flags(config, tiny_export["export"])["llama_cpp_combined"].split()
    served, argv = (
        line[line.index("-md") + 2 : line.index("--jinja")],
        started["ngram-simple,draft-dflash"]["argv"],
    )
    assert {k: v for k, v in zip(served[::2], served[1::2])} == {
        k: argv[argv.index(k) + 1] for k in served[::2]
    }
    assert dflash[dflash.index("-md") + 1] == str(work / "draft-f32.gguf")
    assert dflash[dflash.index("-m") + 1] == str(work / "target-f32.gguf")  # the HF target, converted
    assert dflash[dflash.index("--host") + 1] == "127.0.0.1" and "--jinja" in dflash
    assert "-md" not in started["plain"]["argv"] and "--spec-type" not in started["plain"]["argv"]
    convert = json.loads((fake_llama["record"] / "convert-draft-f32.gguf.json").read_text())
    assert convert[convert.index("--target-model-dir") + 1] == tiny_export["target"]
    assert convert[0] == tiny_export["export"] and convert[convert.index("--outtype") + 1] == "f32"
    for server in started.values():
        assert_stopped(server["pid"])
    # 9 tokens, 4 accepted: the first from prefill, then 4 rounds emit the other 8 -> tau 2.
    assert result["engine_tau"] == pytest.approx(2.0)
    assert result["engine_ngram_simple_tau"] == pytest.approx(8 / 6)
    assert result["engine"]["draft-dflash"]["accepted"] == 2 * 4 and result["num_prompts"] == 2
    # The combination: 5 accepted of 9 tokens -> 8 / 3, beside the eval's ngram+dflash.
    assert result["engine_ngram_dflash_tau"] == pytest.approx(8 / 3)
    assert result["engine_ngram_simple_draft_dflash_tau"] == result["engine_ngram_dflash_tau"]
    assert 1.0 <= result["eval_ngram_dflash_tau"] <= 1 + 48  # lookup may copy 48 tokens a round
    assert result["ngram_lookup"] == {"key_size": 3, "max_draft": 48}
    assert set(result["engine_tokens_per_s"]) == {"plain", "draft-dflash", "ngram-simple", "ngram-mod"} | {
        "ngram-simple+draft-dflash",
        "ngram-mod+draft-dflash",
    }
    assert result["engine_lossless"] == {
        "draft-dflash": "2/2", "ngram-simple": "2/2", "ngram-mod": "0/2",
        "ngram-simple+draft-dflash": "2/2", "ngram-mod+draft-dflash": "2/2",
    }  # fmt: skip
    assert result["prompt_tokens_equal"] == "0/2"  # the stand-in renders other tokens than the HF tokenizer
    assert 1.0 <= result["eval_tau"] <= BLOCK and result["eval_ngram_tau"] >= 1.0
    assert json.loads((work / "serve_check.json").read_text())["engine_tau"] == result["engine_tau"]


def test_a_server_is_stopped_when_a_request_fails(fake_llama, tiny_export, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL_CHAT", "draft-dflash")
    with pytest.raises(
        llama_cpp.LlamaCppError, match="(?s)answered 500 to /v1/chat/completions.*decode failed"
    ):
        run_serve_check(fake_options(fake_llama, tiny_export, tmp_path, ngram_types=[]))
    started = servers_started(fake_llama["record"])
    assert set(started) == {"plain", "draft-dflash"}
    for server in started.values():
        assert_stopped(server["pid"])


def test_a_server_that_dies_while_loading_shows_its_log(fake_llama, tiny_export, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL_START", "draft-dflash")
    with pytest.raises(
        llama_cpp.LlamaCppError, match="(?s)exited with 3 while loading.*failed to load the draft"
    ):
        run_serve_check(fake_options(fake_llama, tiny_export, tmp_path, ngram_types=[]))


def cli_args(fake_llama, tiny_export, tmp_path, *extra) -> list[str]:
    return [
        "serve-check", "--target", tiny_export["target"], "--drafter", tiny_export["export"],
        "--prompts", tiny_export["prompts"], "--max-new-tokens", str(MAX_NEW_TOKENS),
        "--llama-server", fake_llama["server"], "--llama-convert", fake_llama["converter"],
        "--workdir", str(tmp_path / "work"), "--startup-timeout-s", "60", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("failure", ["FAKE_HANG", "FAKE_DROP"])
def test_a_stuck_or_dropped_request_fails_in_one_line_and_keeps_what_finished(
    failure, fake_llama, tiny_export, tmp_path, monkeypatch, capsys
):
    """A server that hangs on (or resets) a chat request: one line naming the route, the timeout
    and the server log's tail, exit 1, and serve_check.json holds the exact eval and the runs that
    finished before it."""
    from dflash_train.cli import main

    monkeypatch.setenv(failure, "draft-dflash")
    args = cli_args(fake_llama, tiny_export, tmp_path, "--request-timeout-s", "1", "--ngram-types")
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    line = errors[0]
    work = tmp_path / "work"
    assert "POST /v1/chat/completions" in line and "llama-server-draft-dflash.log" in line
    assert "processing task" in line  # the log's tail
    assert str(work / "serve_check.json") in line
    if failure == "FAKE_HANG":
        assert "within 1 s" in line and "--request-timeout-s" in line
    saved = json.loads((work / "serve_check.json").read_text())
    assert saved["status"] == "failed" and saved["error"] in line
    assert list(saved["engine_runs"]) == ["plain"]
    plain = saved["engine_runs"]["plain"]
    assert len(plain["completions"]) == 2 and plain["completions"][0]["text"] == "the same reply"
    assert saved["eval"]["dflash"]["drafted"] > 0 and saved["draft_gguf"] == str(work / "draft-f32.gguf")
    for server in servers_started(fake_llama["record"]).values():
        assert_stopped(server["pid"])


def test_finished_runs_are_saved_as_they_finish(fake_llama, tiny_export, tmp_path, monkeypatch):
    """serve_check.json is rewritten after every engine run, before the next server starts."""
    seen = []
    real_server = llama_cpp.LlamaServer.__enter__

    def entering(self):
        path = tmp_path / "work" / "serve_check.json"
        seen.append(sorted(json.loads(path.read_text())["engine_runs"]))
        return real_server(self)

    monkeypatch.setattr(llama_cpp.LlamaServer, "__enter__", entering)
    result = run_serve_check(fake_options(fake_llama, tiny_export, tmp_path, ngram_types=["ngram-simple"]))
    assert seen == [[], ["plain"], ["draft-dflash", "plain"], ["draft-dflash", "ngram-simple", "plain"]]
    saved = json.loads((tmp_path / "work" / "serve_check.json").read_text())
    assert saved["status"] == "complete" and saved["engine_tau"] == result["engine_tau"]


def test_a_proxy_in_the_environment_is_not_used_for_the_local_server(
    fake_llama, tiny_export, tmp_path, monkeypatch
):
    """llama-server runs on 127.0.0.1 as a child process: HTTP(S)_PROXY (common on clusters) must
    not send its requests elsewhere."""
    with socket.socket() as sock:  # a proxy address nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead_proxy = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, dead_proxy)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    options = fake_options(fake_llama, tiny_export, tmp_path, ngram_types=[])
    options.startup_timeout_s = 10
    assert run_serve_check(options)["engine_tau"] == pytest.approx(2.0)


def test_a_server_whose_help_or_converter_hangs_is_refused_in_one_line(tmp_path):
    hanging = tmp_path / "hangs"
    hanging.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    hanging.chmod(0o755)
    with pytest.raises(llama_cpp.LlamaCppError, match=r"--help did not finish within 0.5 s"):
        llama_cpp.server_help(hanging, timeout_s=0.5)
    with pytest.raises(llama_cpp.LlamaCppError, match=r"(?s)converter did not finish within 0.5 s.*log"):
        llama_cpp.convert_to_gguf(hanging, tmp_path, tmp_path / "out.gguf", timeout_s=0.5)


def test_a_recurrent_target_whose_engine_accepts_every_draft_is_refused(
    fake_llama, tiny_hybrid_dir, tmp_path, monkeypatch, capsys
):
    """On a GatedDeltaNet hybrid, draft_n == draft_n_accepted is what llama.cpp builds that drop
    partly accepted rounds from the counters report: no acceptance, tau or verdict is given."""
    monkeypatch.setenv("FAKE_COUNTS", "all-accepted")
    export = export_for(tiny_hybrid_dir, tmp_path)
    result = run_serve_check(fake_options(fake_llama, export, tmp_path, ngram_types=["ngram-simple"]))
    assert result["target_recurrent"] is True
    for name in ("draft-dflash", "ngram-simple"):
        assert "draft_n == draft_n_accepted" in result["engine_refused"][name]
        assert result["engine"][name]["acceptance_rate"] is None and result["engine"][name]["tau"] is None
    assert result["engine_tau"] is None and result["engine_acceptance_rate"] is None
    assert result["engine_far_from_eval"] is None
    assert result["engine"]["draft-dflash"]["drafted"] == result["engine"]["draft-dflash"]["accepted"] == 8
    saved = json.loads((tmp_path / "work" / "serve_check.json").read_text())["engine_runs"]["draft-dflash"]
    assert saved["numbers"]["acceptance_rate"] is None and "draft_n_accepted" in saved["numbers"]["refused"]
    err = capsys.readouterr().err
    assert "REFUSED draft-dflash" in err and "cannot remove part of a sequence" in err


@pytest.mark.parametrize(("rs_seq", "tau_given"), [(3, True), (0, False), (None, False)])
def test_a_recurrent_target_is_judged_on_acceptance_and_tau_only_with_rollback_snapshots(
    rs_seq, tau_given, tmp_path
):
    """Counts below full acceptance are judged; tau from the completion tokens only where the log
    shows recurrent rollback snapshots (n_rs_seq > 0): with checkpoint replay every partly accepted
    round takes two target forwards."""
    from dflash_train.eval.serve_check import check_engine_counts

    log = tmp_path / "server.log"
    # The drafter's context logs its own n_rs_seq (0) after the target's.
    lines = [] if rs_seq is None else [f"llama_context: n_rs_seq              = {n}" for n in (rs_seq, 0)]
    log.write_text("".join(line + "\n" for line in lines))
    numbers = {"tau": 1.5, "drafted": 90, "accepted": 6, "acceptance_rate": 6 / 90}
    refused = check_engine_counts(numbers, recurrent_target=True, log_path=log)
    assert refused is None and numbers["acceptance_rate"] == pytest.approx(6 / 90)
    assert (numbers["tau"] == 1.5) is tau_given
    if not tau_given:
        assert numbers["tau"] is None and "two target forwards" in numbers["tau_note"]
    attention = {"tau": 1.5, "drafted": 9, "accepted": 9, "acceptance_rate": 1.0}
    assert check_engine_counts(attention, recurrent_target=False, log_path=log) is None
    assert attention["tau"] == 1.5


def test_missing_llama_cpp_says_how_to_build_it(tiny_export, tmp_path, monkeypatch, capsys):
    from dflash_train.cli import main

    monkeypatch.delenv(llama_cpp.SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-server on it
    args = ["serve-check", "--target", tiny_export["target"], "--drafter", tiny_export["export"]]
    assert main([*args, "--prompts", tiny_export["prompts"]]) == 1
    err = capsys.readouterr().err
    assert "llama-server not found" in err and "ninja -C DIR/build llama-server" in err
    assert "-DGGML_NATIVE=OFF" in err and llama_cpp.SERVER_ENV in err


def test_a_build_without_dflash_is_refused_by_its_help():
    help_text = FAKE_HELP.replace("draft-dflash|", "")
    with pytest.raises(llama_cpp.LlamaCppError, match="(?s)does not know.*--spec-type draft-dflash"):
        llama_cpp.check_server_supports(help_text, ["--spec-draft-n-max"], ["draft-dflash", "ngram-mod"])
    llama_cpp.check_server_supports(FAKE_HELP, ["--spec-draft-n-max", "-md"], ["draft-dflash", "ngram-mod"])


def test_the_lookup_sizes_reach_the_engine_and_the_eval_and_an_old_build_is_refused(
    fake_llama, tiny_export, tmp_path, monkeypatch, capsys
):
    options = fake_options(fake_llama, tiny_export, tmp_path, ngram_types=["ngram-simple"])
    options.ngram_min_match, options.ngram_max_draft = 1, 6
    result = run_serve_check(options)
    argv = servers_started(fake_llama["record"])["ngram-simple,draft-dflash"]["argv"]
    assert argv[argv.index("--spec-ngram-simple-size-n") + 1] == "1"
    assert argv[argv.index("--spec-ngram-simple-size-m") + 1] == "6"
    assert result["ngram_lookup"] == {"key_size": 1, "max_draft": 6}
    saved = json.loads((tmp_path / "work" / "serve_check.json").read_text())
    assert saved["eval_ngram_dflash_tau"] == result["eval_ngram_dflash_tau"] >= 1.0
    assert "eval ngram+dflash" in capsys.readouterr().err
    monkeypatch.setenv("FAKE_HELP", FAKE_HELP.replace("--spec-ngram-simple-size-m N", ""))
    with pytest.raises(llama_cpp.LlamaCppError, match="does not know.*--spec-ngram-simple-size-m"):
        run_serve_check(fake_options(fake_llama, tiny_export, tmp_path, ngram_types=["ngram-simple"]))
    with pytest.raises(ValueError, match="ngram_max_draft=-1"):
        fake_options(fake_llama, tiny_export, tmp_path, ngram_max_draft=-1)
    with pytest.raises(ValueError, match=r"--device='gpu' is not a device name"):  # before any engine run
        fake_options(fake_llama, tiny_export, tmp_path, device="gpu")


def test_a_drafter_for_another_target_is_refused_before_any_conversion(fake_llama, tiny_export, tmp_path):
    """The fit check ran in the exact eval, after llama.cpp's converter had turned the target and the
    drafter into GGUF files (minutes for a real model): a drafter trained for another target is
    refused first, with the eval's error, and the converter is never called. So is a bad prompt row,
    which needs only the tokenizer."""
    config = Path(tiny_export["export"], "config.json")
    serving = json.loads(config.read_text())
    depth = serving["num_target_layers"]
    config.write_text(json.dumps({**serving, "num_target_layers": depth + 2}))
    with pytest.raises(
        ValueError, match=f"trained for a {depth + 2}-layer target, --target has {depth} layers"
    ):
        run_serve_check(fake_options(fake_llama, tiny_export, tmp_path))
    assert not list(fake_llama["record"].glob("convert-*"))
    config.write_text(json.dumps(serving))
    Path(tiny_export["prompts"]).write_text('{"messages": []}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1: .messages. is empty"):
        run_serve_check(fake_options(fake_llama, tiny_export, tmp_path))
    assert not list(fake_llama["record"].glob("convert-*"))
    saved = json.loads((tmp_path / "work" / "serve_check.json").read_text())
    assert saved["status"] == "failed" and "is empty" in saved["error"]


def test_a_gguf_target_needs_its_hf_directory(tmp_path):
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="also give --target-hf"):
        ServeCheckOptions(target=str(gguf), drafter="x", prompts=["p.jsonl"])


REAL = os.environ.get("DFLASH_REAL_TARGET", "")
LLAMA = os.environ.get(llama_cpp.SERVER_ENV, "") and os.environ.get(llama_cpp.CONVERT_ENV, "")
# The target GGUF the HF directory was dequantized from: converting real-target.sh's directory back
# gives an SPM vocabulary that llama-server cannot render chat with (no newline token).
REAL_GGUF = os.environ.get("DFLASH_REAL_TARGET_GGUF", "")
PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "Explain recursion in one sentence.",
    "List three primary colors.",
]


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(
    not (REAL and REAL_GGUF and LLAMA),
    reason=f"set DFLASH_REAL_TARGET(_GGUF) and {llama_cpp.SERVER_ENV} + {llama_cpp.CONVERT_ENV} (a llama.cpp build)",
)
def test_llama_cpp_accepts_what_the_eval_accepts(tmp_path):
    """A drafter trained a few steps on the target's own replies to the prompts it is then served
    (so that it accepts something quickly on CPU): llama.cpp must accept about as much as the exact
    eval. An engine near 0 where the eval is not means the export and llama.cpp disagree on a
    convention (layer ids, norms, mask token). The engine's target is ``DFLASH_REAL_TARGET_GGUF``,
    the GGUF the HF directory was dequantized from."""

    prompts, steps = train_on_own_replies(tmp_path, "smollm2-135m")
    result = run_serve_check(
        ServeCheckOptions(
            target=REAL_GGUF, target_hf=REAL, drafter=str(tmp_path / "run" / "export"),
            prompts=[str(prompts)], num_prompts=len(PROMPTS), max_new_tokens=32, ngram_types=[],
            workdir=str(tmp_path / "serve"),
        )
    )  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "engine_commands"}, default=str))
    accepted = result["eval"]["dflash"]["accepted"]
    assert accepted >= MIN_ACCEPTED_TO_JUDGE, (
        f"the eval accepts {accepted} drafts after {steps} steps: raise them"
    )
    assert result["engine_lossless"]["draft-dflash"] == f"{len(PROMPTS)}/{len(PROMPTS)}"
    assert result["engine_far_from_eval"] is False, (
        result["engine_acceptance_rate"],
        result["eval_acceptance_rate"],
    )
    assert result["engine"]["draft-dflash"]["accepted"] > 0


@pytest.mark.parametrize(
    ("engine_accepted", "eval_accepted", "far"), [(0, 6, True), (4, 6, False), (0, 4, None)]
)
def test_engine_acceptance_far_below_the_eval_is_flagged_once_it_can_be_judged(
    engine_accepted, eval_accepted, far, tmp_path
):
    from dflash_train.eval.serve_check import compare
    from dflash_train.eval.serve_prompts import ServePrompt
    from dflash_train.eval.speculative import Generation

    def completion(accepted, drafted):
        return llama_cpp.Completion("text", "length", 3, 33, drafted, accepted, 10.0)

    runs = {
        "plain": {"completions": [completion(0, 0)], "prompt_tokens": [[1, 2, 3]], "command": ["s"]},
        "draft-dflash": {
            "completions": [completion(engine_accepted, 30 * 3)],
            "prompt_tokens": None,
            "command": [],
            "log": tmp_path / "no.log",
        },
    }
    rounds = 32 - eval_accepted
    generation = Generation(
        tokens=list(range(33)), num_drafted=[3] * rounds, num_accepted=[eval_accepted] + [0] * (rounds - 1)
    )
    eval_side = {
        "dflash": [generation], "ngram": [generation], "greedy_texts": ["text"], "target_recurrent": False,
    }  # fmt: skip
    options = SimpleNamespace(max_new_tokens=32, ngram_min_match=3, ngram_max_draft=0)  # what compare reads
    result = compare(options, 4, [ServePrompt("p:1", [], [1, 2, 3])], runs, eval_side)
    assert result["engine_far_from_eval"] is far
    assert result["eval"]["dflash"]["accepted"] == eval_accepted
    assert result["prompt_tokens_equal"] == "1/1" and result["engine_greedy_equals_eval"] == "1/1"


def test_texts_a_drafter_free_run_also_changed_are_told_apart_from_the_drafters(tmp_path):
    from dflash_train.eval.serve_check import compare
    from dflash_train.eval.serve_prompts import ServePrompt
    from dflash_train.eval.speculative import Generation

    def completions(*texts):
        return [llama_cpp.Completion(t, "length", 3, 33, 30, 3, 10.0) for t in texts]

    def run(*texts):
        return {
            "completions": completions(*texts),
            "prompt_tokens": None,
            "command": [],
            "log": tmp_path / "no",
        }

    runs = {
        "plain": {**run("a", "b", "c"), "prompt_tokens": [[1]] * 3},
        "draft-dflash": run("a", "B", "C"),  # prompts 2 and 3 lost with the drafter
        "ngram-simple": run("a", "b", "C"),  # prompt 3 lost without it too
        "ngram-simple+draft-dflash": run("a", "b", "c"),
    }
    generation = Generation(tokens=list(range(33)), num_drafted=[3] * 30, num_accepted=[1] * 30)
    eval_side = {
        "dflash": [generation] * 3, "ngram": [generation] * 3, "greedy_texts": ["a", "b", "c"],
        "target_recurrent": False,
    }  # fmt: skip
    options = SimpleNamespace(max_new_tokens=32, ngram_min_match=3, ngram_max_draft=0)
    prompts = [ServePrompt(f"p:{i}", [], [1]) for i in (1, 2, 3)]
    result = compare(options, 4, prompts, runs, eval_side)
    assert result["engine_lossless"] == {
        "draft-dflash": "1/3",
        "ngram-simple": "2/3",
        "ngram-simple+draft-dflash": "3/3",
    }
    assert result["engine"]["draft-dflash"]["unlike_plain"] == ["p:2", "p:3"]
    assert result["unlike_plain_without_drafter"] == {
        "with_drafter": ["p:2", "p:3"],
        "also_without_drafter": ["p:3"],
    }
    del runs["ngram-simple"], runs["ngram-simple+draft-dflash"]
    assert compare(options, 4, prompts, runs, eval_side)["unlike_plain_without_drafter"] is None


def train_on_own_replies(tmp_path, recipe: str):
    """Regenerate PROMPTS with the real target and train ``recipe`` a few steps on the replies (CPU,
    fp32); returns the prompt file and the steps. The export is ``tmp_path / "run" / "export"``."""
    from dflash_train.cli import main

    steps = int(os.environ.get("DFLASH_SERVE_CHECK_STEPS", "50"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in PROMPTS)
    )
    regen = ["regen", "--target", REAL, "--data", str(prompts), "--output", str(tmp_path / "regen.jsonl")]
    assert main([*regen, "--max-new-tokens", "32", "--device", "cpu", "--engine", "transformers"]) == 0
    overrides = [
        f"target.path={REAL}", "target.dtype=float32", f"data.paths=[{tmp_path / 'regen.jsonl'}]",
        f"output_dir={tmp_path / 'run'}", "drafter.num_hidden_layers=1", "drafter.block_size=8",
        "train.num_anchors=16", "data.seq_buckets=[128]", "data.token_budget=512", f"train.max_steps={steps}",
        "train.num_epochs=1000", "train.compile=false", "train.attention_backend=sdpa", "train.device=cpu",
        "train.dtype=float32", "train.lr=3e-3", "train.lr_schedule=constant", "train.warmup_ratio=0.0",
        f"logging.every_steps={steps}", f"checkpoint.every_steps={steps}",
    ]  # fmt: skip
    assert main(["train", recipe, *overrides]) == 0
    return prompts, steps
