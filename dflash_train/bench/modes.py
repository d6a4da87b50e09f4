"""The modes of ``dflash-train bench``: one module each, listed once in ``MODES``.

A mode module has
- ``HELP``: one line, shown by ``dflash-train bench --help``;
- ``add_arguments(parser)``: its own arguments;
- ``Options``: a frozen dataclass with one field per argument (same names: ``--seq-len`` ->
  ``seq_len``), inheriting ``progress.StepLimits`` (``--step-timeout-s``, ``--progress``, which
  every mode gets from ``add_common_arguments``);
- ``run(options) -> dict``: the measurement; the result is printed, or with ``--json`` the last
  stdout line is that dict as one JSON object.
Each step of a mode (a train step, a save, a phase) runs under ``progress.StepProgress``: a bar on
stderr and the per-step time limit. Adding a mode is one import and one line in ``MODES``.

``dflash-train bench`` without a mode is ``bench train``, so the commands of earlier versions
(``dflash-train bench --preset qwen3.6-27b``) still run. The CLI imports this module only when
``bench`` runs: mode modules may import torch at the top.
"""

from __future__ import annotations

import argparse
from types import ModuleType

from dflash_train.bench import checkpoint, decode, eval_speed, generation, lengths, train_step
from dflash_train.bench.progress import StepLimits

MODES: dict[str, ModuleType] = {
    "train": train_step,
    "lengths": lengths,
    "eval": eval_speed,
    "checkpoint": checkpoint,
    "decode": decode,
    "generation": generation,
}
DEFAULT_MODE = "train"


def add_mode_parsers(bench_parser: argparse.ArgumentParser) -> None:
    """One sub-parser per mode, with the mode's arguments and the common ones."""
    modes = bench_parser.add_subparsers(dest="bench_mode", metavar="MODE", required=True)
    for name, module in MODES.items():
        parser = modes.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(parser)
        add_common_arguments(parser)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json``, ``--step-timeout-s`` and ``--progress/--no-progress``, with StepLimits' defaults."""
    parser.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,  # keeps a --json given before the mode (bench --json train)
        help="make the last stdout line one JSON object with the results",
    )
    parser.add_argument(
        "--step-timeout-s",
        type=float,
        default=StepLimits.step_timeout_s,
        help="stop with an error when one step (a train step, a save, a phase) runs longer (0 = no limit)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=StepLimits.progress,
        help="a progress bar over the steps on stderr",
    )


def with_default_mode(argv: list[str]) -> list[str]:
    """``argv`` with ``train`` inserted after ``bench`` (and a ``--json`` given before the mode) when
    no mode (nor --help) follows."""
    if argv[:1] != ["bench"]:
        return argv
    position = 1
    while position < len(argv) and argv[position] == "--json":  # bench's own option
        position += 1
    if position < len(argv) and argv[position] in (*MODES, "-h", "--help"):
        return argv
    return [*argv[:position], DEFAULT_MODE, *argv[position:]]
