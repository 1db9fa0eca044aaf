"""A service's settings as one dataclass: each field's default, help text, flag name and choices are written once, and
its command-line flags are generated from them.

    @dataclass
    class Settings:
        listen: str = setting("127.0.0.1:50051", "address to serve on")
        threads: int = setting(1, "torch threads", flag="--torch-threads")
        internal: float = setting(5.0, cli=False)   # no flag: set in code only

    add_arguments(parser, Settings)        # --listen, --torch-threads
    settings = from_args(Settings, args)   # a Settings from the parsed flags
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

MAX_DRAFT_LEN = 16  # the longest draft a service accepts unless told otherwise (each advertises its own: ModelInfo)
# The longest draft of a drafter that costs nothing per token (the suffix tree) and of a llama.cpp target's Verify:
# a 64-token block, which the goodput policy prices by the target's measured forward cost (orchestrator/draft_length.py).
LONG_DRAFT_LEN = 63
DEVICE_HELP = "auto (cuda if available, else cpu), cpu, cuda or cuda:N"  # specdec.models.resolve_device
DTYPE_HELP = "auto (float32 on cpu, bfloat16 on cuda), float32, bfloat16 or float16"  # specdec.models.resolve_dtype

_UNSET = object()


def setting(default: Any = _UNSET, help: str | None = None, *, flag: str | None = None,
            choices: list | tuple | None = None, cli: bool = True, action: str | None = None,
            default_factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with what its flag needs. ``flag``: the flag's name (default: --field-name); ``cli=False``:
    no flag; ``action="store_true"``: a plain switch (a bool otherwise gets --x / --no-x)."""
    meta = {"help": help, "flag": flag, "choices": choices, "cli": cli, "action": action}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"setting {f.name} has no default")


_TYPES = {"int": int, "float": float, "str": str}


def _value_type(f: dataclasses.Field):
    """The flag's argument type from the field's annotation (`int`, `float | None`, ...)."""
    names = [t.strip() for t in str(f.type).split("|") if t.strip() != "None"]
    if len(names) != 1 or names[0] not in _TYPES:
        raise TypeError(f"setting {f.name}: no flag type for annotation {f.type!r}")
    return _TYPES[names[0]]


def cli_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def default(cls, name: str):
    """The default of setting `name` of `cls` (for a caller that passes it on, e.g. a launcher)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return _default(f)
    raise KeyError(f"{cls.__name__} has no setting {name!r}")


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per field of `cls` that has one, its dest the field's name."""
    for f in cli_fields(cls):
        kwargs: dict = {"dest": f.name, "default": _default(f), "help": f.metadata.get("help")}
        action = f.metadata.get("action")
        if action:
            kwargs["action"] = action
        elif str(f.type) == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _value_type(f)
            if f.metadata.get("choices"):
                kwargs["choices"] = list(f.metadata["choices"])
        parser.add_argument(flag_name(f), **kwargs)


def from_args(cls, args: argparse.Namespace, **overrides):
    """A `cls` from parsed flags (fields without a flag keep their defaults unless in `overrides`)."""
    values = {f.name: getattr(args, f.name) for f in cli_fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **overrides})
