import subprocess
import sys

import pytest

from dflash_train.cli import build_parser

SUBCOMMANDS = ["train", "demo", "eval", "bench", "regen", "export", "data-stats"]


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
