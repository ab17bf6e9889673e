"""The ``schedspec`` command line. Conventions (``--scheduler``, ``--set``, exit codes 0/1/2/3) are
in :mod:`schedspec.cli_common` and hold for every command."""

from __future__ import annotations

import importlib

import click

from schedspec.cli_common import OneLineErrors

COMMANDS = ("replay", "check", "lab", "compare", "diff", "prove", "calibrate")
"""Each is a module ``schedspec.commands.NAME`` defining a click command named ``command``."""


class _LazyCommands(OneLineErrors):
    """Imports a command's module only when that command runs (or ``--help`` lists them all), so that
    ``schedspec check`` does not pay for the imports of the lab, the proofs or Hypothesis (about 0.2 s of
    start-up, part of every ``schedspec check`` figure in ``benchmarks/check_speed.py``)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if self.get_command(ctx, name) is not None)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        try:
            module = importlib.import_module(f"schedspec.commands.{cmd_name}")
        except ModuleNotFoundError as error:  # a command whose module is not written yet
            if error.name != f"schedspec.commands.{cmd_name}":
                raise
            return None
        return module.command


@click.group(cls=_LazyCommands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="schedspec")
def cli() -> None:
    """schedspec: an executable specification of iteration-level LLM schedulers."""


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="schedspec")
