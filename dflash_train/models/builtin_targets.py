"""``builtin:<name>`` target paths: a registry that whoever ships a built-in target fills.

``models/`` must not depend on the demo, yet ``target.path: builtin:demo-target`` has to resolve.
The demo registers its targets (``dflash_train.demo.builtin_targets.register``, which the
``dflash-train`` command calls before any subcommand); library callers register theirs, or the
demo's, the same way. Resolution of an unregistered name is a ValueError that says how to fix it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

# name -> a function returning the target's local checkpoint directory (it may build it first).
_RESOLVERS: dict[str, Callable[[str], Path]] = {}


def register_builtin_target(name: str, resolve: Callable[[str], Path]) -> None:
    """Make ``builtin:<name>`` resolve through ``resolve(name)`` (re-registering replaces it)."""
    _RESOLVERS[name] = resolve


def registered_builtin_targets() -> list[str]:
    """The names ``builtin:<name>`` currently resolves."""
    return sorted(_RESOLVERS)


def resolve_builtin_target(name: str) -> Path:
    """The local directory of built-in target ``name``; a ValueError when nobody registered it."""
    if name not in _RESOLVERS:
        raise ValueError(
            f"target path 'builtin:{name}' is not registered (registered: {registered_builtin_targets()}). "
            "The demo's targets are registered by the dflash-train command; from Python call "
            "dflash_train.demo.builtin_targets.register() first, or use a checkpoint directory or preset:<name>."
        )
    return Path(_RESOLVERS[name](name))
