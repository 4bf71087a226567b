"""The `latentloop` command line: train, eval, generate, tokenizer, analyze, compare, demo, serve,
import-hf, export, export-dcp, plan.

Every user mistake ends in one line on stderr (`latentloop: error: ...`) and exit code 2, with no
traceback; anything else is a bug and keeps its traceback. Under torchrun the line is printed once:
an error every process raised alike (agreed on, or raised before the processes could talk) is
printed by rank 0 alone; an error of one process alone names its rank.
"""

from __future__ import annotations

import sys

from ..errors import LatentloopError
from .decoding import cmd_chat, cmd_generate
from .parser import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_USAGE, build_parser
from .planning import cmd_plan
from .scoring import cmd_analyze, cmd_compare, cmd_eval
from .tools import cmd_demo, cmd_export, cmd_export_dcp, cmd_import_hf, cmd_serve, cmd_tokenizer
from .training import cmd_train

# A process whose peers vanished mid-collective waits this long for torchrun to stop it: the peer
# that failed first has printed the cause, and torchrun ends the others within its monitor interval.
PEER_GRACE_S = 10.0

COMMANDS = {"train": cmd_train, "eval": cmd_eval, "generate": cmd_generate, "tokenizer": cmd_tokenizer,
            "chat": cmd_chat, "demo": cmd_demo, "compare": cmd_compare, "analyze": cmd_analyze, "serve": cmd_serve,
            "import-hf": cmd_import_hf, "export": cmd_export, "export-dcp": cmd_export_dcp, "plan": cmd_plan}


def _report(exc: LatentloopError) -> None:
    """Print a user error's line, once per job (see the module docstring)."""
    from ..distributed import a_peer_of_torchrun, current_dist

    env = current_dist()
    shared, own = getattr(exc, "shared", False), getattr(exc, "rank_specific", False)
    if shared and not env.is_main:
        return  # every process has it; rank 0 prints it
    if not env.distributed and a_peer_of_torchrun() and not own:
        return  # before the process group: torchrun started every process alike, and rank 0 fails alike
    prefix = f"rank {env.rank}: " if env.world_size > 1 and not env.is_main and not shared else ""
    print(f"latentloop: error: {prefix}{exc}", file=sys.stderr)


class StdoutUnwritable(LatentloopError, OSError):
    """Standard output refuses writes (`> /dev/full`, a full disk): the command's output cannot go
    anywhere. An OSError too: `exit_without_finalizing`'s last flush passes over it as over any."""


class _GuardedStdout:
    """sys.stdout while a command runs: a write or flush that fails (but for a closed pipe, which
    `main` ends quietly) raises `StdoutUnwritable`, one line, where it was an OSError's traceback
    from wherever the command printed."""

    def __init__(self, stream):
        self._stream = stream
        self._refused = False  # once it refused a write, what follows is discarded: the error was said

    def _guarded(self, call, *args):
        if self._refused:
            return None
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            self._refused = True
            raise StdoutUnwritable(f"cannot write to standard output: {exc.strerror or exc}") from None

    def write(self, text: str) -> int:
        written = self._guarded(self._stream.write, text)
        return len(text) if written is None else written

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code. Without `argv` (sys.argv) this is the process's own
    command line, and after a command that joined a process group it ends the process itself
    (`runtime.exit_without_finalizing`); with `argv` (tests, other Python code) it always returns."""
    if sys.stdout is None:  # closed by the caller (`>&-`): what a command prints is discarded, as asked
        import os

        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - the process's own stdout
    stdout, sys.stdout = sys.stdout, _GuardedStdout(sys.stdout)
    try:
        try:
            code = _main(argv)
        except SystemExit:  # argparse's --help and usage errors: what it printed is flushed in the guard too
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # output still buffered (stdout is not a terminal) fails here, not at the exit
        return code
    except StdoutUnwritable as exc:
        print(f"latentloop: error: {exc}", file=sys.stderr)
        _silence_stdout()  # what is still buffered would fail again at the interpreter's exit
        return EXIT_USAGE
    finally:
        sys.stdout = stdout


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None) is not None:  # generate, chat, serve: before anything is built or compiled
        import torch

        torch.set_num_threads(args.threads)
    try:
        code = COMMANDS[args.command](args)
    except LatentloopError as exc:
        _report(exc)
        if isinstance(exc, StdoutUnwritable):  # what is still buffered would fail again, and be said twice
            _silence_stdout()
        from ..distributed import exit_without_finalizing, in_process_group

        # the group is not left (a peer may wait in a collective; torchrun ends it), but its threads
        # still outlive the command and can abort the interpreter's teardown: see exit_without_finalizing
        if in_process_group() and argv is None:
            exit_without_finalizing(EXIT_USAGE)
        return EXIT_USAGE
    except KeyboardInterrupt:
        from ..distributed import current_dist, exit_without_finalizing, in_process_group

        if current_dist().is_main:  # torchrun forwards a Ctrl+C to every process: said once
            print("latentloop: interrupted", file=sys.stderr)
        if in_process_group() and argv is None:  # as after an error (see exit_without_finalizing)
            exit_without_finalizing(EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `latentloop generate ... | head`: the reader has what it wanted
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except RuntimeError as exc:
        from ..distributed import current_dist, is_collective_failure

        # a collective that broke: most likely a peer failed first, so torchrun gets the time to end
        # this process and report that peer's error; a failure of this process's own is raised at once
        if current_dist().world_size > 1 and is_collective_failure(exc):
            import time

            time.sleep(PEER_GRACE_S)
        raise
    from ..distributed import destroy_distributed, exit_without_finalizing

    # after a failure the process exits instead: leaving a group can wait on its peers
    if destroy_distributed() and argv is None:  # this process's own command line (the script, python -m)
        exit_without_finalizing(code)  # a process group's threads outlive it: see there
    return code


def _silence_stdout() -> None:
    """Point stdout at the null device: the interpreter's last flush of what is still buffered
    would meet the closed pipe again and print "Exception ignored ... BrokenPipeError"."""
    import os

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a test's captured stdout: nothing to flush at exit
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


__all__ = ["COMMANDS", "EXIT_USAGE", "build_parser", "main"]
