"""``serve``'s flags are generated from ``ServiceConfig``: one definition per setting, so the
``--help`` defaults, the parsed defaults and the config's defaults cannot drift apart."""

from __future__ import annotations

import argparse
import re

import pytest
from pydantic import Field

from blendmatch.service import cli
from blendmatch.service.config import ServiceConfig
from blendmatch.service.flags import add_config_flags, config_from_args, flag_name, shown_default

#: ``serve`` flags that are the process supervisor's, not ``ServiceConfig`` settings.
PROCESS_FLAGS = {"workers", "worker_ports_from", "reuse_port", "own_port"}


def _serve_parser() -> argparse.ArgumentParser:
    return cli.build_parser()._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001


def _flat_help(sep: str = " ") -> str:
    return sep.join(_serve_parser().format_help().split())


def test_every_setting_is_one_flag_and_every_flag_one_setting():
    parser = _serve_parser()
    ignored = {f for f, _, _ in cli.LMCACHE_IGNORED_FLAGS}
    dests = {a.dest for a in parser._actions  # noqa: SLF001
             if a.option_strings and not isinstance(a, argparse._HelpAction)
             and not set(a.option_strings) & ignored}
    assert dests == set(ServiceConfig.model_fields) | PROCESS_FLAGS


def test_help_defaults_are_the_config_defaults():
    """Each flag's parsed default is the field's default, and its help states that default
    (the value itself, or the field's ``shown`` words for it)."""
    parser = _serve_parser()
    text = _flat_help("")
    by_dest: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:  # noqa: SLF001
        by_dest.setdefault(action.dest, []).append(action)
    for name, info in ServiceConfig.model_fields.items():
        first = by_dest[name][0]
        assert first.default == info.default, name
        shown = shown_default(info)
        # the help as printed (wrapped, also inside hyphenated words: compared without spaces)
        assert re.sub(r"\s", "", first.help % {"default": first.default}) in text, (name, first.help)
        assert f"(default: {shown}" in first.help, (name, first.help)
        if not isinstance(info.default, bool) and "shown" not in (info.json_schema_extra or {}):
            assert f"(default: {info.default}" in first.help, name


def test_no_flags_give_the_default_config():
    args = _serve_parser().parse_args([])
    assert config_from_args(args) == ServiceConfig()
    assert cli.config_from_args(args).model_dump() == ServiceConfig().model_dump()


def test_gc_freeze_has_one_default():
    """It was 0 in the config and 64 MiB on the command line; now 64 MiB everywhere."""
    assert ServiceConfig().gc_freeze_ingest_bytes == 64 << 20
    assert "--gc-freeze-ingest-bytes GC_FREEZE_INGEST_BYTES after this many bytes" in _flat_help()
    args = _serve_parser().parse_args(["--gc-freeze-ingest-bytes", "0"])
    assert config_from_args(args).gc_freeze_ingest_bytes == 0


def test_release_free_heap_is_on_unless_turned_off():
    assert ServiceConfig().release_free_heap is True
    p = _serve_parser()
    assert config_from_args(p.parse_args(["--no-release-free-heap"])).release_free_heap is False
    assert config_from_args(p.parse_args(["--release-free-heap"])).release_free_heap is True


def test_bool_fields_become_flags_and_pairs():
    p = _serve_parser()
    assert config_from_args(p.parse_args(["--disable-blend-lookup"])).enable_blend_lookup is False
    assert config_from_args(p.parse_args(["--enable-blend-lookup"])).enable_blend_lookup is True
    assert config_from_args(p.parse_args(["--access-log", "--require-checkpoint"])).model_dump(
        include={"access_log", "require_checkpoint"}) == {"access_log": True, "require_checkpoint": True}
    with pytest.raises(SystemExit):
        p.parse_args(["--enable-blend-lookup", "--disable-blend-lookup"])


def test_choices_come_from_the_annotation(capsys):
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["--engine", "tpu"])
    assert "choose from 'auto', 'gpu', 'cpu', 'reference'" in capsys.readouterr().err


def test_a_new_field_is_a_new_flag():
    """What another issue does to add a setting: a field with a description, nothing else."""

    class Extended(ServiceConfig):
        new_knob: int = Field(default=7, ge=1, description="a knob added later")
        new_switch: bool = Field(default=True, description="on unless told", json_schema_extra={"off": "off"})

    p = argparse.ArgumentParser()
    add_config_flags(p, Extended)
    helps = {a.dest: a.help for a in p._actions}  # noqa: SLF001
    assert helps["new_knob"] == "a knob added later (default: 7)"
    cfg = config_from_args(p.parse_args(["--new-knob", "9", "--no-new-switch"]), Extended)
    assert (cfg.new_knob, cfg.new_switch) == (9, False)


def test_bad_values_are_usage_errors_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["serve", "--port", "70000"])
    assert ei.value.code == 2 and "--port: Input should be less than or equal to 65535" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        cli.main(["serve", "--gc-freeze-ingest-bytes", "-1"])
    assert ei.value.code == 2 and "--gc-freeze-ingest-bytes: " in capsys.readouterr().err


def test_upstream_without_a_scheme_means_http():
    assert ServiceConfig(upstream_coordinator="coord:9300/").upstream_coordinator == "http://coord:9300"
    with pytest.raises(ValueError, match="must be an http"):
        ServiceConfig(upstream_coordinator="ftp://coord")
