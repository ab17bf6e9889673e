"""Conventions shared by every ``schedspec`` command, and the one validation layer at the edge.

- ``--scheduler NAME``: a registered scheduler (``schedspec.reference.scheduler.REGISTRY``) or
  ``module:factory`` (a Python function or class that takes a ``SchedulerConfig`` and returns a
  scheduler; built-in functions such as ``os:system`` are refused).
- ``--set key=value`` (repeatable): change a :class:`~schedspec.spec.config.SchedulerConfig` field.
  Values are parsed as JSON scalars where possible (``16``, ``true``), else kept as strings.
- Exit status: 0 all checks passed; 1 a check failed (expectation, invariant, divergence, theorem
  not proved), naming it and the step; 2 unusable input; 3 the chosen scheduler cannot express the
  scenario (a feature it lacks).

Bad input (exit 2) is found before any work starts, and reported as **one line** on stderr,
``schedspec: error: WHERE: WHAT``, naming the option (``--steps``), or the file, line and field
(``trace.csv:7: ContextTokens``), in the user's terms; never a traceback. User text (paths, ids,
scenario fields) is printed as plain text: every Rich console of the CLI is made by :func:`console`,
which interprets neither markup (``[red]``) nor emoji codes (``:100:``); :func:`one_line` escapes
control characters so a message stays on one line.

Outputs (files such as ``--steps-out``, ``--save``, ``calibrate --out``; folders such as ``--plot``,
``diff --out``, ``prove --save-cases``) are all checked before any work by :func:`check_outputs`, with
one rule: **what you name is created, the folder it goes in must exist** (a missing folder is
created only when it is the output itself, never its parents: ``--plot new`` yes,
``--plot missing/new`` and ``--save missing/run.json`` no). A file output is refused if it is an
input (any file the command reads: a trace, a cost profile, a model folder's files; also through a
symbolic link) or another output, a directory, or not writable; a folder output if it is a file or not
writable. Files are written by :func:`atomic_output` (a temporary file in the same folder, renamed
over the target only when complete), so no input is ever overwritten and a failed run leaves no half
file; a new file gets the usual ``0666`` less the umask (an existing one keeps its mode), as any Unix
tool's output.

Several outputs of one option (``lab --compare`` or ``--sweep``) follow one naming rule,
:func:`numbered_output`: ``FILE.EXT`` becomes ``FILE-LABEL.EXT``, the label being the run's name
(``--compare``) or the sweep point's number, zero-padded to the width of the largest
(``run-01.json`` .. ``run-12.json``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

import click
from rich.console import Console

from schedspec.spec.config import ConfigError, SchedulerConfig
from schedspec.spec.request import printable

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UNSUPPORTED = 3

MAX_MESSAGE_CHARS = 2000
"""A message longer than this is cut (a 10 MB path must not flood the terminal)."""


def one_line(text: object) -> str:
    """``text`` as one printable line: newlines, tabs and other control characters are written as
    escapes (``\\n``, ``\\x1b``), and anything past :data:`MAX_MESSAGE_CHARS` characters is cut."""
    line = printable(text)
    if len(line) > MAX_MESSAGE_CHARS:
        line = line[:MAX_MESSAGE_CHARS] + f"... ({len(line) - MAX_MESSAGE_CHARS} more characters)"
    return line


def plural(count: int, noun: str, many: str | None = None) -> str:
    """``"1 violation"``, ``"2 violations"``, ``"1,000 steps"``: a count and its noun, in the singular for one."""
    return f"{count:,} {noun if count == 1 else many or noun + 's'}"


def fail(message: str, status: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print ``schedspec: error: message`` (one line, plain text) to stderr and exit with ``status``."""
    click.echo(f"schedspec: error: {one_line(message)}", err=True)
    sys.exit(status)


def torch_backend_model(model_dir: str | None, what: str) -> tuple[Any, Any]:
    """``(schedspec.gpu_backend, its ModelConfig for model_dir)`` (the built-in tiny model for ``None``), for
    the commands that run the torch backend. Exits 3 without the torch extra (``what`` names the option
    that asked for it) and 2 on an unusable ``--model`` directory."""
    try:
        from schedspec import gpu_backend
    except ImportError as error:
        fail(f"{what} needs the torch extra (pip install 'schedspec[torch]'): {error}", status=EXIT_UNSUPPORTED)
    try:
        config = gpu_backend.tiny_model_config() if model_dir is None else \
            gpu_backend.ModelConfig.from_model_dir(model_dir)
    except gpu_backend.BackendError as error:
        fail(f"--model: {error}")
    return gpu_backend, config


def note(message: str) -> None:
    """Print ``schedspec: note: message`` (one line, plain text) to stderr: something the user should
    know about the input that did not stop the run (e.g. a trace that had to be sorted)."""
    click.echo(f"schedspec: note: {one_line(message)}", err=True)


MIN_TABLE_WIDTH = 100
"""The width rule of every table the CLI prints (``lab``, ``compare``, ``calibrate``): the terminal's width
(``$COLUMNS`` when set; 120 when not a terminal), but at least this many columns, cells wrapping inside
it; except the tables with one row per configuration (``lab --sweep``, ``--capacity``), printed at their
natural width, never cut or wrapped, so that each configuration stays one line (their width grows with
the number of swept fields: about 150 columns for two). :func:`table_width`, :func:`wide_console`."""


def table_width() -> int:
    """The width tables are printed at (:data:`MIN_TABLE_WIDTH`'s rule)."""
    import shutil

    return max(shutil.get_terminal_size((120, 24)).columns, MIN_TABLE_WIDTH)


def wide_console() -> Console:
    """A console for the tables with one row per configuration: their natural width, never cut
    (:data:`MIN_TABLE_WIDTH`)."""
    return console(width=1000)


def console(**kwargs: Any) -> Console:
    """A Rich console that prints text as text: no markup, no emoji codes, no highlighting.

    Styled parts are built with :class:`rich.text.Text` (``Text("FAIL", style="red")``); plain
    strings (user paths, request ids, scenario text) are printed exactly as they are.
    """
    return Console(markup=False, emoji=False, highlight=False, **kwargs)


# --------------------------------------------------------------------------------------------------
# Option types: finite numbers in range; click's own FloatRange accepts nan and inf.


class Number(click.ParamType):
    """A finite float with optional bounds: ``minimum`` (inclusive, or exclusive with
    ``strict``) and ``maximum`` (inclusive). ``nan``, ``inf`` and out-of-range values are refused."""

    name = "number"

    def __init__(self, minimum: float | None = None, strict: bool = False, maximum: float | None = None) -> None:
        self.minimum, self.strict, self.maximum = minimum, strict, maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            number = value
        else:
            try:
                number = float(str(value).strip())
            except ValueError:
                self.fail(f"{one_line(value)!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{one_line(value)!r}: must be a finite number", param, ctx)
        if self.minimum is not None and (number <= self.minimum if self.strict else number < self.minimum):
            self.fail(f"{number:g}: must be {'>' if self.strict else '>='} {self.minimum:g}", param, ctx)
        if self.maximum is not None and number > self.maximum:
            self.fail(f"{number:g}: must be <= {self.maximum:g}", param, ctx)
        return number


class Count(click.ParamType):
    """An integer in ``[minimum, maximum]`` (decimal digits only)."""

    name = "integer"

    def __init__(self, minimum: int = 0, maximum: int | None = None) -> None:
        self.minimum, self.maximum = minimum, maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip()
            digits = text[1:] if text[:1] in "+-" else text
            if not digits.isascii() or not digits.isdigit():
                self.fail(f"{one_line(value)!r} is not an integer", param, ctx)
            if len(digits) > 30:
                self.fail(f"{one_line(text[:40])}...: out of range", param, ctx)
            number = int(text)
        if number < self.minimum:
            self.fail(f"{number}: must be >= {self.minimum}", param, ctx)
        if self.maximum is not None and number > self.maximum:
            self.fail(f"{number}: must be <= {self.maximum:,}", param, ctx)
        return number


# --------------------------------------------------------------------------------------------------
# --set and the config


def parse_value(text: str) -> Any:
    """A ``--set`` value: a JSON scalar (int, float, true/false, null), a JSON list (``kv_cache_groups=[{"kind":
    "full_attention"}, ...]``), or else the string itself."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text
    if isinstance(value, float) and not math.isfinite(value):
        return text  # NaN, Infinity: kept as text, refused by the field's type check
    return value if isinstance(value, int | float | bool | str | list) or value is None else text


def parse_sets(items: tuple[str, ...]) -> dict[str, Any]:
    """``("block_size=16", ...)`` -> ``{"block_size": 16, ...}``; exits 2 on a malformed item."""
    changes: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            fail(f"--set {item!r}: expected key=value")
        if key.strip() in changes:
            fail(f"--set {key.strip()!r}: given twice")
        changes[key.strip()] = parse_value(value.strip())
    return changes


def build_config(base: dict[str, Any], changes: dict[str, Any], where: str = "--set") -> SchedulerConfig:
    """``SchedulerConfig`` from ``base`` with ``changes`` applied; exits 2 naming ``where`` and the
    field if it is invalid, or too large to simulate
    (:func:`~schedspec.reference.fake_model.simulation_size_problem`)."""
    from schedspec.reference.fake_model import simulation_size_problem

    data = dict(base)
    data.update(changes)
    try:
        config = SchedulerConfig.from_dict(data)
    except ConfigError as error:
        fail(f"{where}: {error}")
    except (TypeError, ValueError, OverflowError) as error:
        fail(f"{where}: {error}")
    problem = simulation_size_problem(config)
    if problem is not None:
        fail(f"{where}: {problem}")
    return config


def check_scheduler(name: str, config: SchedulerConfig | None, where: str = "--scheduler",
                    unsupported_ok: bool = False) -> None:
    """Exit 2 (naming ``where``) unless ``name`` is a scheduler; with a ``config``, also build it
    for that config, exiting 3 if the scheduler cannot run it (:class:`UnsupportedFeature`; or
    return, with ``unsupported_ok``) and 2 if its engine's environment is unusable
    (:class:`~schedspec.reference.scheduler.EngineEnvironmentError`: a variable naming a missing
    interpreter, a worker that dies at start).

    A ``module:factory`` must name a Python function or class (not a built-in such as
    ``os:system`` or ``builtins:print``), and calling it with the config must return an object
    with ``add_request``, ``abort_request``, ``schedule`` and ``update``.
    """
    from schedspec.reference.scheduler import (
        REGISTRY,
        EngineEnvironmentError,
        UnknownScheduler,
        UnsupportedFeature,
        make_scheduler,
        resolve_factory,
    )

    shown = one_line(name)
    if name not in REGISTRY:  # a module:factory: imported now (a registered adapter only when built)
        try:
            resolve_factory(name)
        except UnknownScheduler as error:
            fail(f"{where} {shown!r}: {error.detail}")
    if config is None:
        return
    try:
        scheduler = make_scheduler(name, config)
    except UnsupportedFeature as error:
        if unsupported_ok:
            return
        fail(str(error), status=EXIT_UNSUPPORTED)
    except UnknownScheduler as error:
        fail(f"{where} {shown!r}: {error.detail}")
    except EngineEnvironmentError as error:  # the engine's environment is unusable (names the variable)
        fail(f"{where} {shown}: {error}")
    except Exception as error:  # noqa: BLE001 - a user factory that fails is unusable input
        fail(f"{where} {shown!r}: the factory failed ({type(error).__name__}: {error})")
    missing = [m for m in ("add_request", "abort_request", "schedule", "update") if not callable(getattr(scheduler, m, None))]
    if missing:
        fail(f"{where} {shown!r}: the factory returned {type(scheduler).__name__}, not a scheduler "
             f"(no {', '.join(missing)})")


# --------------------------------------------------------------------------------------------------
# Output files


def check_path(option: str, text: str | None) -> None:
    """Exit 2 naming ``option`` if ``text`` cannot be a path at all (empty, or a NUL character)."""
    if text is None:
        return
    if not text.strip():
        fail(f"{option}: empty path")
    if "\x00" in text:
        fail(f"{option} {one_line(text)}: a path cannot contain a NUL character")


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


def input_files(paths: Sequence[str | Path | None]) -> list[Path]:
    """The files a command reads, for :func:`check_outputs`: each path given, and for a folder (a
    ``--model`` directory) every file in it (``None`` and missing paths are left out)."""
    files: list[Path] = []
    for text in paths:
        if text is None:
            continue
        path = Path(text)
        if path.is_dir():
            try:
                files.extend(sorted(entry for entry in path.rglob("*") if entry.is_file()))
            except OSError:
                continue
        elif os.path.lexists(path):
            files.append(path)
    return files


def numbered_output(path: str, label: str) -> str:
    """The output of one of several runs (the module docstring's naming rule):
    ``run.json`` -> ``run-LABEL.json``, ``steps`` -> ``steps-LABEL``, ``a.b/c.jsonl`` -> ``a.b/c-LABEL.jsonl``."""
    target = Path(path)
    if target.suffix:
        return str(target.with_name(f"{target.stem}-{label}{target.suffix}"))
    return str(target.with_name(f"{target.name}-{label}"))


def run_labels(count: int) -> list[str]:
    """``count`` sweep point labels, 1-based and zero-padded to the width of the largest (``01`` .. ``12``)."""
    width = len(str(count))
    return [f"{i + 1:0{width}d}" for i in range(count)]


def _folder_problem(text: str, folder: Path) -> str | None:
    """Why ``folder`` cannot be the folder an output is created in (``None``: it can)."""
    shown = one_line(folder if str(folder) else ".")
    if os.path.lexists(folder) and not folder.is_dir():
        what = "a symbolic link to nothing" if folder.is_symlink() and not folder.exists() else "a file"
        return f"{shown} is {what}, not a folder"
    if not folder.is_dir():
        return f"folder {shown} does not exist (create it first)"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"folder {shown} is not writable"
    try:  # the permission bits do not tell everything (a read-only mount, /proc, root): try it
        with tempfile.TemporaryFile(dir=folder, prefix=".schedspec-probe-"):
            pass
    except OSError as error:
        return f"folder {shown} is not writable ({error.strerror or error})"
    return None


def check_outputs(outputs: Sequence[tuple[str, str | None]], inputs: Sequence[str | Path | None],
                  folders: Sequence[tuple[str, str | None]] = ()) -> None:
    """Refuse (exit 2, naming the option) before any work: output files that would overwrite an input
    or each other (also through a symbolic link), are directories, are not writable or whose folder does
    not exist; output folders that are files, not writable, or whose parent folder does not exist
    (the module docstring's one rule).

    Args:
        outputs: ``(option, path)`` pairs of files to be written (``None``: not asked for).
        inputs: every file the command reads (a folder stands for every file in it: :func:`input_files`).
        folders: ``(option, path)`` pairs of folders to be created or filled.
    """
    sources = input_files(inputs)
    seen: list[tuple[str, Path]] = []
    for option, text in outputs:
        if text is None:
            continue
        check_path(option, text)
        path = Path(text)
        for source in sources:
            if _same_file(path, source):
                fail(f"{option} {one_line(text)}: is an input file ({one_line(source)}); refusing to overwrite it")
        for other_option, other in seen:
            if _same_file(path, other):
                fail(f"{option} {one_line(text)}: same file as {other_option}")
        if path.is_dir():
            fail(f"{option} {one_line(text)}: is a directory, expected a file path")
        problem = _folder_problem(text, path.parent if str(path.parent) else Path("."))
        if problem is not None:
            fail(f"{option} {one_line(text)}: {problem}")
        if path.exists() and not os.access(path, os.W_OK):
            fail(f"{option} {one_line(text)}: not writable")
        seen.append((option, path))
    for option, text in folders:
        if text is None:
            continue
        check_path(option, text)
        folder = Path(text)
        if os.path.lexists(folder):
            problem = _folder_problem(text, folder)
        else:
            problem = _folder_problem(text, folder.parent if str(folder.parent) else Path("."))
        if problem is not None:
            fail(f"{option} {one_line(text)}: {problem}")


def _new_file_mode() -> int:
    """``0o666`` less the process's umask: the mode ``open(path, "w")`` gives a new file."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_output(path: str | Path, mode: str = "w", **kwargs: Any) -> Iterator[IO]:
    """Open a temporary file next to ``path`` for writing; on normal exit it replaces ``path``
    (``os.replace``, atomic on one filesystem; a symbolic link at ``path`` is replaced, never written
    through), on any exception it is deleted and ``path`` is left as it was. The file gets the mode of
    the regular file it replaces, or ``0666`` less the umask (not ``tempfile``'s ``0600``)."""
    path = Path(path)
    try:  # an existing regular file keeps its mode; a new one gets 0666 less the umask, as open() gives
        existing = os.stat(path, follow_symlinks=False)
        file_mode = existing.st_mode & 0o7777 if os.path.isfile(path) and not path.is_symlink() else _new_file_mode()
    except OSError:
        file_mode = _new_file_mode()
    handle = tempfile.NamedTemporaryFile(mode, dir=path.parent if str(path.parent) else ".",  # noqa: SIM115
                                         prefix=f".{path.name}.", suffix=".tmp", delete=False, **kwargs)
    try:
        with handle:
            os.chmod(handle.fileno(), file_mode)
            yield handle
        os.replace(handle.name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(handle.name)
        raise


# --------------------------------------------------------------------------------------------------
# Click wiring


class OneLineErrors(click.Group):
    """The ``schedspec`` group: click's usage errors (unknown option, bad option value, missing
    argument) are printed as one line, ``schedspec: error: COMMAND: MESSAGE (see COMMAND --help)``,
    exit 2, instead of click's usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as error:  # bare `schedspec`: the help, not an error
            click.echo(error.ctx.get_help() if error.ctx is not None else error.format_message())
            sys.exit(0)
        except click.UsageError as error:
            where = error.ctx.command_path if error.ctx is not None else (prog_name or "schedspec")
            fail(f"{where}: {error.format_message()} (see {where} --help)")
        except click.ClickException as error:
            fail(error.format_message(), status=error.exit_code)
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except OSError as error:
            # standard output full (`> /dev/full`): one line on stderr, not a traceback (a closed pipe,
            # `| head`, click itself ends quietly)
            if error.errno != errno.ENOSPC:
                raise
            with contextlib.suppress(OSError):  # nothing more goes to the closed stream at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            fail(f"cannot write the output: {error.strerror or error}")
        sys.exit(result if isinstance(result, int) else 0)


def scheduler_names_help() -> str:
    """The ``--scheduler`` help, generated from the registry (every registered scheduler and engine adapter)."""
    from schedspec.reference.scheduler import names

    return (f"Scheduler: {', '.join(names('reference'))}; engine adapters: {', '.join(names('engine-adapter'))}; "
            "or module:factory.")


scheduler_option = click.option(
    "--scheduler", "scheduler_name", default=None, metavar="NAME", help=scheduler_names_help(),
)
set_option = click.option(
    "--set", "sets", multiple=True, metavar="KEY=VALUE",
    help="Change a SchedulerConfig field (repeatable), e.g. --set max_num_seqs=8.",
)
