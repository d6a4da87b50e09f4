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


def builtin_target_path(name: str, *, progress: bool = True) -> Path:
    """The directory of the built-in target ``name`` (``builtin:<name>``), built on first use.

    Cached per Python minor version, since the stdlib corpus differs between versions.
    """
    from dflash_train.demo import target_build  # lazy: it imports transformers

    if name not in DEMO_TARGETS:
        raise ValueError(f"unknown built-in target {name!r}; available: {', '.join(DEMO_TARGETS)}")
    python = f"py{sys.version_info.major}.{sys.version_info.minor}"
    path = target_build.default_cache_dir() / f"{name}-{target_build.CACHE_VERSION}-{python}"
    if (path / "build_info.json").exists():
        return path
    if progress:
        print(f"building the demo target into {path} (one time, ~3 minutes on 2 CPU cores)", file=sys.stderr)
    try:
        return target_build.build_demo_target(path, progress=progress)
    except FileExistsError:
        if (path / "build_info.json").exists():  # another process finished it meanwhile
            return path
        raise


def register() -> None:
    """Make ``builtin:<name>`` resolve for every demo target."""
    for name in DEMO_TARGETS:
        register_builtin_target(name, builtin_target_path)
