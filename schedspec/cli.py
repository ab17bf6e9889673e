"""The ``schedspec`` command line. Conventions (``--scheduler``, ``--set``, exit codes 0/1/2/3) are
in :mod:`schedspec.cli_common` and hold for every command."""

from __future__ import annotations

import importlib

import click

from schedspec.cli_common import OneLineErrors

COMMANDS = ("replay", "check", "lab", "compare", "diff", "prove", "calibrate")
"""Each is a module ``schedspec.commands.NAME`` defining a click command named ``command``."""


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="schedspec")
def cli() -> None:
    """schedspec: an executable specification of iteration-level LLM schedulers."""


for _name in COMMANDS:
    try:
        _module = importlib.import_module(f"schedspec.commands.{_name}")
    except ModuleNotFoundError as _error:  # a command whose module is not written yet
        if _error.name != f"schedspec.commands.{_name}":
            raise
        continue
    cli.add_command(_module.command, _name)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="schedspec")
