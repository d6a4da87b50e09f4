"""The demo's built-in targets (``builtin:demo-target``): where they are cached, and their registration
with ``models.builtin_targets``.

``register()`` is cheap (the ``dflash-train`` command calls it before every subcommand): a target
is built, or found in the cache, by ``builtin_target_path`` only when a ``builtin:`` path is resolved.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dflash_train.models.builtin_targets import register_builtin_target

DEMO_TARGETS = ("demo-target",)
# The builtin target trains its full schedule (700 steps, ~8 minutes on 2 idle CPU cores) whatever the
# machine's load, so every machine gets the same target; the wall-clock cap is only a backstop
# against a machine so busy that the schedule would take half an hour. A 180 s cap once left a
# loaded machine with a 10-step target whose greedy output was a run of newlines, cached for good.
BUILTIN_TARGET_MAX_SECONDS = 1800.0


def builtin_target_path(name: str, *, progress: bool = True) -> Path:
    """The directory of the built-in target ``name`` (``builtin:<name>``), built on first use.

    Cached per Python minor version, since the stdlib corpus differs between versions.
    """
    from dflash_train.demo import target_build  # lazy: it imports transformers

    if name not in DEMO_TARGETS:
        raise ValueError(f"unknown built-in target {name!r}; available: {', '.join(DEMO_TARGETS)}")
    python = f"py{sys.version_info.major}.{sys.version_info.minor}"
    path = target_build.default_cache_dir() / f"{name}-{target_build.CACHE_VERSION}-{python}"
    if not (path / "build_info.json").exists():
        if progress:
            print(
                f"building the demo target into {path} (one time, ~8 minutes on 2 CPU cores)", file=sys.stderr
            )
        try:
            target_build.build_demo_target(path, seconds_budget=BUILTIN_TARGET_MAX_SECONDS, progress=progress)
        except FileExistsError:
            if not (path / "build_info.json").exists():  # another process is still building it
                raise
    warn_if_cut_short(path)
    return path


def warn_if_cut_short(path: Path) -> None:
    """A target whose build stopped at the backstop before its schedule ended is undertrained."""
    import json

    from dflash_train.demo import target_build

    steps = json.loads((path / "build_info.json").read_text())["steps"]
    planned = target_build.DemoTargetSettings().max_steps
    if steps < planned:
        print(
            f"WARNING: the demo target at {path} trained only {steps} of {planned} steps (its build hit "
            f"the {BUILTIN_TARGET_MAX_SECONDS:.0f} s backstop on a busy machine): its output and the "
            f"demo's numbers are not the documented ones; delete {path} to rebuild it",
            file=sys.stderr,
        )


def register() -> None:
    """Make ``builtin:<name>`` resolve for every demo target."""
    for name in DEMO_TARGETS:
        register_builtin_target(name, builtin_target_path)
