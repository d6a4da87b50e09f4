import subprocess
import sys

import pytest

from dflash_train.cli import build_parser

SUBCOMMANDS = [
    "train",
    "demo",
    "eval",
    "bench",
    "plot",
    "regen",
    "synth",
    "export",
    "data-stats",
    "serve-check",
]


def test_top_level_help_lists_every_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "dflash_train.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_has_help(name):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([name, "--help"])
    assert exc.value.code == 0


def test_an_import_error_is_shown_as_the_bug_it_is(monkeypatch):
    """A missing dflash_train module propagates with its traceback (no "not available yet")."""
    from dflash_train import cli

    def broken(args):
        raise ModuleNotFoundError("No module named 'dflash_train.gone'", name="dflash_train.gone")

    monkeypatch.setattr(cli, "cmd_export", broken)
    with pytest.raises(ModuleNotFoundError, match="dflash_train.gone"):
        cli.main(["export", "ckpt", "out"])


def test_bench_options_come_from_the_parser_with_the_same_defaults():
    from dflash_train.bench.train_step import BenchOptions
    from dflash_train.cli import options_from_args

    args = build_parser().parse_args(["bench"])
    assert options_from_args(BenchOptions, args) == BenchOptions()
    args = build_parser().parse_args(["bench", "--seq-len", "64", "--no-compile", "--loss", "kl"])
    assert options_from_args(BenchOptions, args) == BenchOptions(seq_len=64, compile=False, loss="kl")
    del args.loss
    with pytest.raises(TypeError, match="without a command-line argument: \\['loss'\\]"):
        options_from_args(BenchOptions, args)
    with pytest.raises(ValueError, match="--preset 'huge'"):
        BenchOptions(preset="huge")


def test_a_device_name_torch_does_not_know_is_a_one_line_error(capsys):
    """`gpu` (for cuda) raised torch's RuntimeError with a traceback from deep in each command."""
    from dflash_train import cli
    from dflash_train.eval.command import resolve_device as eval_device
    from dflash_train.generate.sampling import resolve_device as generation_device
    from dflash_train.train.parallel import pick_device

    assert cli.main(["train", "tiny-cpu", "train.device=gpu"]) == 1
    assert "train.device='gpu' is not a device name: use auto, cpu, cuda" in capsys.readouterr().err
    for resolve, setting in ((pick_device, "train.device"), (eval_device, "--device")):
        with pytest.raises(ValueError, match=f"{setting}='gpu' is not a device name"):
            resolve("gpu")
    with pytest.raises(ValueError, match="--device='gpu' is not a device name"):
        generation_device("gpu")
    assert generation_device("cpu") == "cpu" and eval_device("cpu").type == "cpu"
