"""The engine flags declared once (`batchgen.cli_types.engine_flags` over `EngineConfig`'s `flag`
metadata): the same flags, defaults and help in `run`, `bench`, `tune` and `plan`, their values
handed to a command as one dict, and the declaration's mistakes refused."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.cli_types import ENGINE_FLAGS, ENGINE_OPTIONS, EngineArgs, engine_flags
from batchgen.config import EngineConfig
from batchgen.tune import TUNE_FLAGS

# EngineConfig fields that are not engine flags: each command declares its own (`--policy`: bench's
# is a comma list) or they are sampling flags (`--seed`, `SamplingDefaults`).
NOT_FLAGS = {"policy", "seed", "decode_buckets"}
# A command's own version of a flag, at the flag's place: (command, field) -> its default (bench's
# --quantization and --speculative-method are comma lists of configurations to run).
OWN_VERSIONS = {
    ("bench", "quantization"): "auto",
    ("bench", "speculative_method"): "none",
    ("tune", "kv_cache_memory"): "64MiB",
}


def command_options(name: str) -> dict[str, tuple]:
    command = typer.main.get_command(app).commands[name]
    return {p.name: (tuple(p.opts), p.default, p.help) for p in command.params if p.name in ENGINE_OPTIONS}


def test_every_engine_flag_has_one_name_default_and_help_in_run_bench_tune_and_plan() -> None:
    """Each flag-carrying field is `--field-name` with EngineConfig's default and its metadata's help
    in run, plan and bench (tune: the flags it names), except the commands' declared own versions,
    which keep the flag's name. Every other field is one of the known non-flags."""
    flag_fields = {f.name: f for f in dataclasses.fields(EngineConfig) if "help" in f.metadata}
    assert set(flag_fields) == set(ENGINE_OPTIONS)
    assert {f.name for f in dataclasses.fields(EngineConfig)} - set(flag_fields) == NOT_FLAGS
    expected = {"run": ENGINE_OPTIONS, "plan": ENGINE_OPTIONS, "bench": ENGINE_OPTIONS, "tune": TUNE_FLAGS}
    for command, names in expected.items():
        options = command_options(command)
        assert list(options) == list(names), command  # all of them, in the field order
        for name in names:
            opts, default, help_text = options[name]
            assert opts == (f"--{name.replace('_', '-')}",), (command, name)
            if (command, name) in OWN_VERSIONS:
                assert default == OWN_VERSIONS[command, name], (command, name)
                assert help_text != flag_fields[name].metadata["help"], (command, name)
            else:
                assert default == flag_fields[name].default, (command, name)
                assert help_text == flag_fields[name].metadata["help"], (command, name)
    assert command_options("run")["max_num_seqs"][1] == EngineConfig.max_num_seqs == 256


def flags_app(**kwargs) -> tuple[typer.Typer, list[EngineArgs]]:
    """A Typer app whose one command takes the engine flags (`engine_flags(**kwargs)`) and records
    what it gets."""
    got: list[EngineArgs] = []
    cli = typer.Typer(add_completion=False)

    @cli.command()
    @engine_flags(**kwargs)
    def command(
        name: Annotated[str, typer.Argument()],
        policy: Annotated[str, typer.Option()] = "fcfs",
        engine: EngineArgs = ENGINE_FLAGS,
        last: Annotated[int, typer.Option()] = 1,
    ) -> None:
        got.append({"name": name, "policy": policy, "last": last, **engine})

    return cli, got


def test_engine_flags_hands_the_values_to_the_command_as_one_dict() -> None:
    """The flags' values arrive as `engine` (parsed: a size in bytes), the command's own parameters
    as they were; a bad size is a usage error naming the reason; an inert flag warns once."""
    cli, got = flags_app()
    runner = CliRunner()
    r = runner.invoke(cli, ["x", "--max-num-seqs", "3", "--kv-cache-memory", "2GiB", "--last", "5"])
    assert r.exit_code == 0, r.output
    assert {name: got[0][name] for name in ENGINE_OPTIONS} == {
        **{name: EngineConfig.__dataclass_fields__[name].default for name in ENGINE_OPTIONS},
        "max_num_seqs": 3,
        "kv_cache_memory": 2 << 30,
    }
    assert (got[0]["name"], got[0]["policy"], got[0]["last"]) == ("x", "fcfs", 5)
    r = runner.invoke(cli, ["x", "--kv-cache-memory", "lots"])
    assert r.exit_code == 2 and "'lots' is not a memory size" in r.output
    r = runner.invoke(cli, ["x", "--aging-steps", "9"])
    assert r.exit_code == 0 and r.output.count("warning: --aging-steps applies only") == 1
    # The flags sit where `engine` is declared: after --policy, before --last.
    names = [p.name for p in typer.main.get_command(cli).params]
    assert names == ["name", "policy", *ENGINE_OPTIONS, "last"]


def test_engine_flags_takes_a_subset_and_refuses_what_it_cannot_place() -> None:
    cli, got = flags_app(only=("model", "dtype"))
    assert [p.name for p in typer.main.get_command(cli).params] == [
        "name",
        "policy",
        "model",
        "dtype",
        "last",
    ]
    assert CliRunner().invoke(cli, ["x", "--dtype", "float32"]).exit_code == 0
    assert {k: got[0][k] for k in ("model", "dtype")} == {"model": None, "dtype": "float32"}
    assert "max_num_seqs" not in got[0]
    with pytest.raises(TypeError, match="policy: not engine flags"):
        engine_flags(only=("policy",))
    with pytest.raises(TypeError, match="has no `engine` parameter"):

        @engine_flags()
        def no_place(name: str) -> None: ...
