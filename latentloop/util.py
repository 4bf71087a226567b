"""Small helpers several parts need, in one leaf module: it imports nothing of latentloop's but
`errors`, so any part may use it (config included) without importing a layer above.

- `first_line(exc)`: the one line a user sees of an error.
- `is_int(value)`: an integer that is not a bool (JSON and YAML give both).
- durable files: `fsync_file`, `fsync_dir`, `write_json_atomic` (temp file, fsync, rename).
- `give_default_mode(file)`: the permissions a plain `open()` gives, for files made another way.
- output folders: `removed_on_failure` (made for a block, gone again if it fails), `staged_folder`.
- `TokenText`: a stream of token ids turned into whole characters, as the CLI, chat and server print.
- `default_cache_dir()`: the root of latentloop's caches (tokens, eval bundle, compiled decode steps).
- `evaluating(model)`: a module in eval mode for a block, each submodule as it was after.
"""

from __future__ import annotations

import codecs
import json
import math
import os
import secrets
import shutil
import sys
import tempfile
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from .errors import OutputError

_T = TypeVar("_T")

CACHE_ENV = "LATENTLOOP_CACHE"  # root of every cache folder (tokens, eval bundle, compiled decode steps)


def default_cache_dir() -> Path:
    """$LATENTLOOP_CACHE, else ~/.cache/latentloop."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "latentloop")


_EVALUATING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> [open blocks, modules to restore]
_EVALUATING_LOCK = threading.Lock()


@contextmanager
def evaluating(model, _finalizing=sys.is_finalizing) -> Iterator[None]:  # bound here: globals may be gone at exit
    """`model` (an `nn.Module`) in eval mode inside the block; after the last open block on it ends
    (decodes interleave: two streams of one model each hold one), the submodules that were training
    train again, the others stay as they were. Restored by the first to end, a stream still decoding
    went on with training's noise. A block that opens while another is open and finds the model set
    to training since (`.train()` beside a paused stream) puts it in eval mode for itself and gives
    it back training at its own end; the paused stream puts it in eval mode again when it resumes
    (`keep_evaluating`). A model already in eval mode is not walked twice: `.eval()` and `.train()`
    over a small model's ~90 modules cost 0.75 ms together, a sixth of a 16-token prompt's prefill on
    the machine this was measured on."""
    own: list = []  # what this block found training beside an open block: given back at its end
    with _EVALUATING_LOCK:
        entry = _EVALUATING.get(model)
        if entry is None:
            entry = _EVALUATING[model] = [0, _switch_to_eval(model)]
        elif model.training:
            own = _switch_to_eval(model)
        entry[0] += 1
    try:
        yield
    finally:
        # a stream dropped unfinished at the interpreter's exit has nothing to give back, and torch is half torn
        # down then (setting a module's flag raised inside torch, printed as a traceback)
        if not _finalizing():
            with _EVALUATING_LOCK:
                entry[0] -= 1
                _train_again(own)
                if entry[0] == 0:
                    # pop: a stream collected with its model (a cycle) finds the weak key cleared already
                    _EVALUATING.pop(model, None)
                    _train_again(entry[1])


def keep_evaluating(model) -> None:
    """Inside an open `evaluating` block (a stream resuming): a model set to training since goes
    back to eval mode, and its training modules train again when the last block ends. One flag read
    when nothing changed."""
    if not model.training:
        return
    with _EVALUATING_LOCK:
        entry = _EVALUATING.get(model)
        if entry is not None:
            entry[1].extend(_switch_to_eval(model))


def _switch_to_eval(model) -> list:
    """The modules of `model` that were training, the model now in eval mode (`_train_again` gives
    them back)."""
    training = [m for m in model.modules() if m.training]
    if training:
        model.eval()
    return training


def _train_again(modules) -> None:
    for module in modules:
        module.training = True  # each its own flag: `.train()` would set its children's too


def json_safe(value: Any) -> Any:
    """`value` with every NaN / infinity replaced by None (null), so that it dumps as strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def first_line(exc: BaseException) -> str:
    """The first line of an error's message, else its class name (an error with no message)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def is_int(value: Any) -> bool:
    """An int and not a bool: `True` is an int to Python, never a count to a user."""
    return isinstance(value, int) and not isinstance(value, bool)


CONTINUATION_BYTES = (0x80, 0xBF)  # UTF-8's bytes that continue a character; any other byte begins one


class TokenText:
    """Token ids -> text as they stream (the CLI, chat and the server all print this way): a character
    split across tokens is held back until its last byte arrives; bytes that can never form one
    become U+FFFD. `tokenizer` is anything with `token_to_bytes(id)`.

    `message_start`: the tokens begin a message encoded on its own (a chat reply), where a
    SentencePiece-style tokenizer prepends a space that its decoding drops ("▁the" -> "the"): the
    text drops it too, so that a reply sent back as history encodes to the ids that were generated
    (" the" encoded again takes one more token)."""

    def __init__(self, tokenizer, message_start: bool = False):
        self._token_bytes = tokenizer.token_to_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._drop_space = message_start and drops_prepended_space(tokenizer)

    def add(self, token_id: int) -> str:
        """The whole characters this token completes ("" while one is still open)."""
        return "".join(self.add_split(token_id))

    def add_split(self, token_id: int) -> tuple[str, str]:
        """`add`'s text as (the U+FFFD of earlier tokens' open character, which this token's first
        byte cannot continue; the text from this token's bytes on): a token's place in the text
        (`text_offset`) comes after what earlier tokens left."""
        data = self._token_bytes(token_id)
        earlier = ""
        if data and not CONTINUATION_BYTES[0] <= data[0] <= CONTINUATION_BYTES[1] and self._decoder.getstate()[0]:
            earlier = self._decoder.decode(b"", final=True)  # the open character can never finish
            self._decoder.reset()
        own = self._decoder.decode(data)
        if self._drop_space and (earlier or own):
            self._drop_space = False
            if not earlier and own.startswith(" "):
                own = own[1:]
        return earlier, own

    def finish(self) -> str:
        """What is left at the end (an unfinished character, replaced)."""
        return self._decoder.decode(b"", final=True)


def encodable(text: str) -> bool:
    """Whether `text` is text UTF-8 can hold: JSON and Python strings admit a lone surrogate (an
    escape such as \\ud800, half of a character), which no UTF-8 text, tokenizer or file can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def drops_prepended_space(tokenizer) -> bool:
    """Whether `tokenizer` prepends a space to a text it encodes on its own and drops it again when
    decoding (SentencePiece's "▁", Metaspace with a prepend scheme): "a" encodes to a first token
    whose bytes begin with a space, and decodes back to "a"."""
    try:
        ids = tokenizer.encode("a")
        return bool(ids) and tokenizer.token_to_bytes(ids[0]).startswith(b" ") and tokenizer.decode(ids) == "a"
    except (AttributeError, TypeError, ValueError):  # a stand-in with token_to_bytes only (tests, tools)
        return False


# cgroup (v2, v1) files holding this process's memory limit inside a container: lower than the
# machine's RAM there, and the kernel kills the process that crosses it.
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_limit_bytes() -> int | None:
    """The most memory this process can use: the machine's RAM, or its cgroup's limit when that
    is lower (a container). None when neither can be read."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # not a POSIX system
        pass
    for file in CGROUP_MEMORY_LIMITS:
        try:
            text = Path(file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # v2 writes "max" for no limit
            limits.append(int(text))
    return min(limits) if limits else None


def nearest_existing(path: Path | str) -> Path:
    """`path` made absolute if it exists, else the nearest of its parents that does (the folder a new
    one would be made in: what decides whether it can be)."""
    path = Path(os.path.abspath(path))
    return path if path.exists() else next(p for p in path.parents if p.exists())


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (where the platform allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory handles (Windows) order renames themselves
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the rename is as durable as they allow
    finally:
        os.close(fd)


# What `open()` asks for a new file; the umask then takes bits away (0o644 under the usual 0o022).
NEW_FILE_MODE = 0o666
# Linux shows a process's umask here ("Umask:\t0022"), readable without changing it
PROC_STATUS = "/proc/self/status"
_umask_read_by_setting: int | None = None
_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process's umask. Read from /proc where the system shows it: `os.umask` can only read it
    by setting another and putting it back, and a file another thread creates in between would
    get the wrong mode. Elsewhere it is read that way once, and remembered."""
    global _umask_read_by_setting
    try:
        with open(PROC_STATUS) as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass  # not Linux, or a kernel older than 4.7: no Umask line
    with _UMASK_LOCK:
        if _umask_read_by_setting is None:
            _umask_read_by_setting = os.umask(0o077)  # the strictest while it is swapped
            os.umask(_umask_read_by_setting)
        return _umask_read_by_setting


def give_default_mode(file: Path | str) -> None:
    """Give a file just written the permissions a plain `open()` would have given it: `NEW_FILE_MODE`
    less the umask. `tempfile.mkstemp` and safetensors' `save_file` create files 0600 whatever the
    umask, which on a shared file system left colleagues unable to read a run's config, its
    checkpoints or an export."""
    os.chmod(file, NEW_FILE_MODE & ~current_umask())


def write_json_atomic(path: Path, payload: Any, indent: int = 2) -> None:
    """Write JSON through a temporary file of this writer's own in the same folder, fsync, then
    rename: never half-written, still there after a crash, and two processes writing one file never
    share a temporary name. An unwritable `path` is an `OutputError`."""
    # made before the file: a payload that does not serialise writes nothing
    write_text_atomic(path, json.dumps(payload, indent=indent, default=str) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """`write_json_atomic` for text (a report, a page): the old file or the new one, never half of it."""
    _write_atomic(Path(path), lambda f: f.write(text.encode()))


def save_figure(fig, path: Path, dpi: int) -> None:
    """Save a matplotlib figure as `write_json_atomic` writes (a reader never sees half a PNG), then
    close it; the format is the path's suffix."""
    path = Path(path)
    try:
        _write_atomic(path, lambda f: fig.savefig(f, dpi=dpi, format=path.suffix.lstrip(".") or "png"))
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def _write_atomic(path: Path, write) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        give_default_mode(tmp)  # mkstemp's 0600, kept, would lock colleagues out of the file
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


PLOT_EXTRA = "pip install 'latentloop[plot]'"


def pyplot(what: str | None = None):
    """matplotlib's pyplot on the Agg backend (files, no screen), or None where matplotlib is not
    installed; then, when `what` names the plot, one line on stderr says it was not drawn and how to
    get it (the plot was skipped silently)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if what is not None:
            print(f"note: matplotlib is not installed: {what} not drawn ({PLOT_EXTRA})", file=sys.stderr)
        return None
    return plt


def read_json_object(path: Path | str) -> dict[str, Any]:
    """A JSON file's object, or {} where the file is missing, does not read (not UTF-8, not JSON,
    nested past the parser's recursion) or holds something other than an object: for a reader that
    takes what a file records and does without (a checkpoint's state.json read for its step, its
    base or its data source). Readers that must have the file read it strictly, with its own error."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # ValueError: JSON's and UTF-8's decoding errors
        return {}
    return value if isinstance(value, dict) else {}


@contextmanager
def removed_on_failure(folder: Path) -> Iterator[None]:
    """For a block that creates `folder` (and any parents it lacks): when the block fails, the
    folders that did not exist before it are removed again, deepest first, each only while empty
    (what someone else put there meanwhile is kept). Errors pass through unchanged."""
    target = Path(os.path.abspath(folder))
    made = [p for p in (target, *target.parents) if not p.exists()]  # deepest first
    try:
        yield
    except BaseException:
        for path in made:
            try:
                path.rmdir()
            except OSError:  # not empty, or gone already
                break
        raise


# The entry of a staged folder moved up into an existing output folder last: a run's or an export's
# config.json is what makes the folder look complete, so an interrupted move never does.
STAGED_LAST = "config.json"


def _staging_name(prefix: str, name: str) -> str:
    """The name of a staging folder for `name` made by this process (`staged_folder`)."""
    return f"{prefix}{name}-{os.getpid()}-{secrets.token_hex(4)}"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # another user's process, or not a pid we can ask
        return True
    return True


def remove_abandoned_staging(folder: Path, prefix: str, name: str | None) -> list[Path]:
    """Remove the staging folders for `name` (None: for any name without a "-") in `folder` that
    `staged_folder` left when its process was killed (SIGKILL, a power cut): named `prefix` + name +
    `-PID-` + a random tail of 8 characters, where no process PID lives on this machine. A leftover
    inside an empty output folder made every retry refuse it as not empty. (Names from a process on
    another machine sharing the folder cannot be told apart: such an export must not write into the
    same folder at the same time.) Returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        named, _, rest = entry.name[len(prefix):].rpartition("-")  # rest: the random tail
        named, _, pid = named.rpartition("-")
        if ((name is not None and named != name) or (name is None and "-" in named) or not pid.isdigit()
                or len(rest) != 8 or not entry.is_dir(follow_symlinks=False) or _process_alive(int(pid))):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed


@contextmanager
def staged_folder(out: Path, prefix: str) -> Iterator[Path]:
    """A folder written whole or not at all: yields a hidden staging folder (named `prefix` + out's
    name + this process's id + a random tail) for the block to fill; one a killed process left beside
    `out` is removed first (`remove_abandoned_staging`).

    `out` missing: the staging folder is made beside it and renamed onto it when the block ends; on
    any failure it and every parent folder made for it are removed again. `out` an existing (empty)
    folder: the staging folder is made inside it and its entries are moved up into it one by one,
    `STAGED_LAST` last, so the folder itself (its mode, group, setgid bit, a link to it) is kept and
    its parent need not take new entries; on any failure the staging folder and whatever was already
    moved up are removed again, leaving `out` as it was. Errors pass through unchanged."""
    target = Path(os.path.abspath(out))
    if target.is_dir():
        yield from _staged_inside(target, prefix)
        return
    made = [p for p in (target.parent, *target.parent.parents) if not p.exists()]  # deepest first
    remove_abandoned_staging(target.parent, prefix, target.name)  # a killed process's, beside it
    staging = target.parent / _staging_name(prefix, target.name)
    done = False
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        yield staging
        os.replace(staging, target)
        fsync_dir(target.parent)
        done = True
    finally:
        if not done:
            shutil.rmtree(staging, ignore_errors=True)
            for parent in made:
                try:
                    parent.rmdir()
                except OSError:  # someone else put something there meanwhile: keep it
                    break


def _staged_inside(target: Path, prefix: str) -> Iterator[Path]:
    """`staged_folder` for an existing folder: staged inside it, the entries moved up at the end."""
    staging = target / _staging_name(prefix, target.name)
    moved: list[Path] = []
    done = False
    try:
        staging.mkdir()
        yield staging
        names = sorted(os.listdir(staging), key=lambda name: (name == STAGED_LAST, name))
        for name in names:
            os.replace(staging / name, target / name)
            moved.append(target / name)
        staging.rmdir()
        fsync_dir(target)
        done = True
    finally:
        if not done:
            for path in moved:  # ours: the folder was empty when the block began (`check_out_folder`)
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            shutil.rmtree(staging, ignore_errors=True)


def progress(iterable: Iterable[_T], total: int | None = None, desc: str = "", enabled: bool = True) -> Iterable[_T]:
    """`iterable` with a progress bar and an ETA on stderr (tqdm, which the package depends on) for
    work that takes more than a few seconds; the iterable itself when not `enabled`. The bar is
    removed when done, so the command's own output stays as it was."""
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=True)


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """One line on stderr per distinct message and process (a refused cache, a clamped request: said
    once, not per call)."""
    if message not in _warned:
        _warned.add(message)
        print(f"latentloop: warning: {message}", file=sys.stderr)
