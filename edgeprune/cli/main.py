"""The ``edgeprune`` command group and THE error handler of the command line.

:func:`main` is the only place where errors become output:

* :class:`~edgeprune.errors.UserError` -> ``error: <message>`` on stderr, exit ``err.exit_code``
  (2 for a user mistake, 1 for a :class:`~edgeprune.errors.RuntimeFault` of the environment);
* a click usage error (unknown option, bad value) -> one ``error: ...`` line, exit 2;
* Ctrl-C -> ``interrupted``, exit 130; SIGTERM (``kill``, a job scheduler, torchrun stopping its
  other ranks) -> ``terminated``, exit 143 -- both unwind like an exception, so the temporary of
  an output being written is removed (outputs are written atomically: nothing half-written);
* an ``OSError`` while writing (disk full, read-only file system, no permission) -> ``error:
  cannot write <path>: <reason> (free space / choose a writable -o)``, exit 1; safetensors'
  own I/O error (``SafetensorError``) -> one line, exit 1;
* anything else is a bug and keeps its traceback.

Under torchrun (``RANK`` set, ``WORLD_SIZE`` > 1) only rank 0 prints these lines: every rank
checks the same input and fails alike, and one message is enough (docs/distributed.md says what
torchrun prints after it).

The commands live in one module per group: :mod:`.prune`, :mod:`.evalinfo` (eval, info),
:mod:`.heal`, :mod:`.derive`, :mod:`.export`, :mod:`.verify`, :mod:`.build`, :mod:`.device` (bench),
:mod:`.devices`, :mod:`.quantize`, :mod:`.latency_table`, :mod:`.deploy_cmd`.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time

import click

from edgeprune.cli.deploy_cmd import deploy_cmd
from edgeprune.cli.derive import derive_cmd
from edgeprune.cli.device import bench_cmd, build_cmd, devices_cmd
from edgeprune.cli.evalinfo import eval_cmd, info_cmd
from edgeprune.cli.export import export_cmd
from edgeprune.cli.heal import heal_cmd
from edgeprune.cli.latency_table import latency_table_cmd
from edgeprune.cli.prune import prune_cmd
from edgeprune.cli.quantize import quantize_cmd
from edgeprune.cli.verify import verify_cmd
from edgeprune.errors import UserError

#: errno values that mean "the output cannot be written here" (exit 1, a fault of the environment).
WRITE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EFBIG}


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="edgeprune")
def cli() -> None:
    """edgeprune: prune, heal, derive, export, build and benchmark Vision Transformers for the edge.

    \b
    Typical flow:
      edgeprune prune --model fmnist-vit --sparsity 0.5 -o runs/fm50
      edgeprune heal runs/fm50 -o runs/fm50-healed
      edgeprune export runs/fm50-healed -o fm50.onnx
      edgeprune bench fm50.onnx --device cpu

    Errors are one line: 'error: <what> (<how to fix>)'; exit status 2 for a usage mistake,
    1 for a fault of the environment (disk full, missing backend), 130 when interrupted (Ctrl-C),
    143 when terminated (SIGTERM).
    """


def _register() -> None:
    for name, cmd in (("prune", prune_cmd), ("eval", eval_cmd), ("info", info_cmd), ("heal", heal_cmd),
                      ("derive", derive_cmd), ("export", export_cmd), ("verify", verify_cmd)):
        cli.add_command(cmd, name=name)
    for name, cmd in (("quantize", quantize_cmd), ("build", build_cmd), ("bench", bench_cmd),
                      ("devices", devices_cmd), ("latency-table", latency_table_cmd),
                      ("deploy", deploy_cmd)):
        cli.add_command(cmd, name=name)


_register()


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM, so that the clean-up of a write in progress runs
    (``except BaseException`` of :mod:`edgeprune.atomic`), as for Ctrl-C."""


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one clean-up; a second SIGTERM waits for it
    raise Terminated


def _is_quiet_rank() -> bool:
    """A torchrun rank other than 0 (from the environment: the group may not exist yet)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0
    except ValueError:
        return False


def _say(line: str) -> None:
    if not _is_quiet_rank():
        click.echo(line, err=True)


#: seconds a torchrun rank other than 0 waits before it exits on an error: rank 0 prints the same error, and a rank
#: that exits first gets rank 0 killed by torchrun before it says it (seen with a second CPU-bound process running)
QUIET_RANK_GRACE_S = 20.0


def _fail(message: str, code: int) -> None:
    _say(f"error: {_first_line(message)}")
    if _is_quiet_rank():
        try:
            time.sleep(QUIET_RANK_GRACE_S)  # ended early by torchrun's SIGTERM once rank 0 has exited
        except (Terminated, KeyboardInterrupt):
            pass
    sys.exit(code)


def _usage_message(err: click.ClickException) -> str:
    msg = _first_line(err.format_message())
    ctx = getattr(err, "ctx", None)
    if isinstance(err, click.UsageError) and ctx is not None:
        msg += f" (see '{ctx.command_path} --help')"
    return msg


def main(argv: list[str] | None = None) -> None:
    """Run the ``edgeprune`` command line (``argv`` defaults to ``sys.argv[1:]``).

    Exits with the status of the command: 0, 1 (environment fault or a failed check), 2 (user
    mistake), 130 (interrupted), 143 (SIGTERM). Every error is one ``error: ...`` line on stderr.
    """
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm), signal.getsignal(signal.SIGINT)
    try:
        _main(argv)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous[0])
            signal.signal(signal.SIGINT, previous[1])


def _invoke(argv: list[str] | None) -> object:
    """Parse and run the command: click's ``Command.main`` in non-standalone mode minus its own
    Ctrl-C handling, which prints a blank line before re-raising (issue 41: one line)."""
    args = sys.argv[1:] if argv is None else [str(a) for a in argv]
    try:
        with cli.make_context("edgeprune", args) as ctx:
            return cli.invoke(ctx)
    except click.exceptions.Exit as err:
        return err.exit_code


def _main(argv: list[str] | None) -> None:
    try:
        rv = _invoke(argv)
    except UserError as err:
        _fail(str(err) or type(err).__name__, getattr(err, "exit_code", 2))
    except (KeyboardInterrupt, click.exceptions.Abort):
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while exiting: no traceback
        _say("interrupted")
        sys.exit(130)
    except Terminated:
        _say("terminated")
        sys.exit(143)
    except click.exceptions.Exit as err:
        sys.exit(err.exit_code)
    except click.ClickException as err:
        _fail(_usage_message(err), 2 if isinstance(err, click.UsageError) else err.exit_code)
    except OSError as err:
        path = err.filename if err.filename is not None else "the output"
        if err.errno in WRITE_ERRNOS:
            _fail(f"cannot write {path}: {err.strerror} (free space / choose a writable -o)", 1)
        if isinstance(err, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
            _fail(f"{path}: {err.strerror}", 2)
        _fail(f"{path}: {err.strerror or err}", 1)
    except Exception as err:  # noqa: BLE001 - only safetensors' I/O error is mapped; the rest re-raised
        if type(err).__name__ != "SafetensorError":
            raise  # a bug: keep the traceback
        _fail(f"safetensors file I/O failed: {_first_line(str(err))} (free space / check the file)", 1)
    if isinstance(rv, int) and rv:
        sys.exit(rv)


if __name__ == "__main__":
    main()
