"""``blendmatch serve``'s flags, generated from :class:`~blendmatch.service.config.ServiceConfig`.

Question answered: "which flag sets which setting, with what help and default?" Every
``ServiceConfig`` field is one flag, ``--field-name``, defined nowhere else: its help is the
field's ``description``, its default the field's default (so ``--help`` and the config cannot
disagree), its type and choices come from the annotation (``Literal`` -> choices), and the
field's ``json_schema_extra`` adds the rest (see the ``ServiceConfig`` docstring): the LMCache
equivalent, the default as shown, the help section, the metavar. A ``bool`` field that is off
by default is one ``store_true`` flag; one that is on by default is a pair,
``--enable-x``/``--disable-x`` (or ``--x``/``--no-x``), mutually exclusive.
:func:`config_from_args` is the one way back: every parsed field, by name, into
``ServiceConfig`` (which validates; the CLI turns its errors into usage errors naming the flag).

LMCache 0.5.6 coordinator flags that mean nothing here are accepted and ignored with a warning
(:data:`LMCACHE_IGNORED_FLAGS`), so that an existing launch command works unchanged.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

__all__ = ["LMCACHE_IGNORED_FLAGS", "add_config_flags", "add_lmcache_only_flags", "config_from_args",
           "flag_help", "flag_name", "ignored_flag_warnings", "shown_default"]

_COORDINATOR = "the coordinator's"


def flag_help(text: str, lmcache: str | None = None, default: str = "%(default)s") -> str:
    """A flag's help: what it does, its default, and its LMCache equivalent if there is one."""
    where = f"; LMCache: {lmcache}" if lmcache else ""
    return f"{text} (default: {default}{where})"


def flag_name(field: str) -> str:
    """``max_batch_tokens`` -> ``--max-batch-tokens``."""
    return "--" + field.replace("_", "-")


def _extra(info: Any) -> dict[str, Any]:
    extra = info.json_schema_extra
    return dict(extra) if isinstance(extra, dict) else {}


def _lmcache(text: str | None) -> str | None:
    """``"--host"`` -> ``"the coordinator's --host"``; anything else as written."""
    return f"{_COORDINATOR} {text}" if text and text.startswith("--") else text


def shown_default(info: Any) -> str:
    """The default as ``--help`` states it: ``shown`` when the field gives one, on/off for a
    bool, else the value itself."""
    extra = _extra(info)
    if "shown" in extra:
        return str(extra["shown"])
    if isinstance(info.default, bool):
        return "on" if info.default else "off"
    return str(info.default)


def _scalar(annotation: Any) -> tuple[Any, tuple[str, ...] | None]:
    """``(argparse type, choices)`` of a field's annotation (``X | None`` -> ``X``)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is Literal:
        choices = tuple(typing.get_args(annotation))
        return type(choices[0]), choices
    return annotation, None


def _bool_pair(name: str) -> tuple[str, str]:
    """The on/off flags of a default-on bool field."""
    if name.startswith("enable_"):
        return flag_name(name), flag_name("disable_" + name.removeprefix("enable_"))
    return flag_name(name), flag_name("no_" + name)


def add_config_flags(parser: argparse.ArgumentParser, config_class: type | None = None) -> None:
    """Add one flag per ``ServiceConfig`` field (see the module docstring)."""
    if config_class is None:
        from .config import ServiceConfig as config_class

    groups: dict[str, Any] = {}
    for name, info in config_class.model_fields.items():
        extra = _extra(info)
        if extra.get("flag", True) is False:
            continue
        title = extra.get("group")
        target = parser if title is None else groups.setdefault(title, parser.add_argument_group(title))
        help_text = flag_help(info.description or name.replace("_", " "), _lmcache(extra.get("lmcache")),
                              default=shown_default(info))
        kind, choices = _scalar(info.annotation)
        if kind is bool and info.default is True:
            on, off = _bool_pair(name)
            pair = target.add_mutually_exclusive_group()
            pair.add_argument(on, dest=name, action="store_true", default=True, help=help_text)
            pair.add_argument(off, dest=name, action="store_false",
                              help=flag_help(extra.get("off", f"the opposite of {on}"),
                                             _lmcache(extra.get("off_lmcache")), default="off"))
        elif kind is bool:
            target.add_argument(flag_name(name), dest=name, action="store_true", default=info.default,
                                help=help_text)
        else:
            kwargs: dict[str, Any] = {"type": kind, "default": info.default, "help": help_text}
            if choices is not None:
                kwargs["choices"] = choices
            if "metavar" in extra:
                kwargs["metavar"] = extra["metavar"]
            target.add_argument(flag_name(name), dest=name, **kwargs)


def config_from_args(args: argparse.Namespace, config_class: type | None = None):  # -> ServiceConfig
    """The ``ServiceConfig`` the parsed flags describe: every field present in ``args``, by
    name (a parser built without some flags leaves those fields at their defaults). Raises
    pydantic's ``ValidationError``."""
    if config_class is None:
        from .config import ServiceConfig as config_class

    values = vars(args)
    return config_class(**{name: values[name] for name in config_class.model_fields if name in values})


#: LMCache 0.5.6 coordinator flags that mean nothing here: accepted (so that an existing
#: launch command works unchanged) and answered with one warning line each at start-up.
#: ``(flag, argparse kwargs, why it is ignored)``.
LMCACHE_IGNORED_FLAGS: tuple[tuple[str, dict, str], ...] = (
    ("--eviction-check-interval", {"type": float}, "blendmatch runs no L2 eviction controller"),
    ("--eviction-ratio", {"type": float}, "blendmatch runs no L2 eviction controller"),
    ("--trigger-watermark", {"type": float}, "blendmatch runs no L2 eviction controller"),
    ("--extra-config", {}, "blendmatch loads no out-of-tree controllers (run in front of an LMCache coordinator "
                           "with --upstream-coordinator to keep them)"),
    ("--metadata-path", {}, "blendmatch keeps no pins or quotas (--upstream-coordinator proxies them to an LMCache "
                            "coordinator)"),
    ("--disable-metrics", {"action": "store_true"}, "blendmatch serves Prometheus metrics at /metrics"),
    ("--otlp-endpoint", {}, "blendmatch serves Prometheus metrics at /metrics (no OTLP push)"),
)

_IGNORED_PREFIX = "accepted for LMCache compatibility and ignored"


def add_lmcache_only_flags(p: argparse.ArgumentParser) -> None:
    """Accept every LMCache coordinator flag this build gives no meaning. A flag that some
    other part of blendmatch already defines (with a meaning) is left to that definition:
    call this last."""
    for flag, kwargs, why in LMCACHE_IGNORED_FLAGS:
        try:
            p.add_argument(flag, default=None, help=f"{_IGNORED_PREFIX}: {why}", **kwargs)
        except argparse.ArgumentError:
            continue  # defined elsewhere, with a meaning


def ignored_flag_warnings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """One line per LMCache-only flag given on the command line (see LMCACHE_IGNORED_FLAGS)."""
    out = []
    for flag, _, why in LMCACHE_IGNORED_FLAGS:
        action = parser._option_string_actions.get(flag)  # noqa: SLF001 - argparse's one index of flags
        if action is None or not action.help or not action.help.startswith(_IGNORED_PREFIX):
            continue
        value = getattr(args, action.dest, None)
        if value not in (None, False):
            out.append(f"{flag} is {_IGNORED_PREFIX}: {why}")
    return out
