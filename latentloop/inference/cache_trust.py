"""Code loaded from the latentloop cache is trusted only when it is the user's own.

The cache (`util.default_cache_dir()`, moved by `LATENTLOOP_CACHE`) holds native kernel libraries,
ahead-of-time decode packages and inductor's compiled graphs: files a process maps and runs. Where the
cache sits in a folder someone else can write (a shared `/tmp/cache` made by another user, say), a
library planted there would run as whoever calls `latentloop generate`. So, as ssh treats its keys:

- `untrusted_folder(folder)`: the folder, and every folder from it up to the cache's root, must be
  owned by this user and not writable by group or others; the folders above the root must be owned
  by this user or by root and, where others may write them, sticky (as /tmp is: nobody can rename a
  folder of ours away there). Anything else is a one-line reason naming the folder, and the caller
  loads nothing from it (the torch path runs, or a private temporary folder serves this process).
  A folder that does not exist yet is judged by the nearest one above it that does; callers make
  their folder first (`private_folder`) and judge it after, so that one another user makes in
  between is seen.
- Group write is allowed where the group is the owner's alone, by the rule Debian's OpenSSH applies to
  `~/.ssh` (a user private group, which umask 002 goes with): the group lists no member but the
  owner, and no account but the owner has it as its primary group (a group shared as everyone's
  primary one, openSUSE's `users`, lists nobody and is not the owner's alone). A group or an owner
  that cannot be looked up is not.
- `unverified_file(path)`: a file is loaded only when it is this user's, not writable by group or
  others, and its sha256 equals the one recorded beside it when it was built (`record_digest`, a
  `<name>.sha256` file written before the artifact is renamed into place). A damaged file (a library
  cut short maps and then dies of SIGBUS; an empty or foreign file under a kernel's name) or one
  without its digest is built again, never mapped.
- `private_folder(folder)`: make the cache's folders with mode 0700 whatever the umask (a umask of
  002, Debian's default for user groups, would make them group-writable and so untrusted).
- `unwritable_folder(folder)`: `private_folder`, then why this process cannot write there (a folder
  that cannot be made, or a read-only one), or None; such a folder is given up as an untrusted one is.

The digests catch damage, not an attacker (who could rewrite them too): the ownership and mode
checks are what keep another user's file from running. Data in the cache (token shards) is not code
and carries checksums of its own (`data/shards.py`).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from ..util import default_cache_dir

try:
    import fcntl
except ImportError:  # no flock (Windows): artifacts are published and checked unlocked, as before the lock
    fcntl = None

DIGEST_SUFFIX = ".sha256"  # beside each artifact: its hex sha256, written when it was built
LOCK_SUFFIX = ".lock"  # beside each artifact: held while its digest and file change or are checked together
PRIVATE_MODE = 0o700  # the cache's folders: only their owner reads, writes or lists them
FILE_MODE = 0o600  # an artifact: its owner reads and writes it (mapping a library needs no exec bit)
_READ_CHUNK = 1 << 20
_ROOT_UID = 0


def _owner_ok(info: os.stat_result, allow_root: bool) -> bool:
    uid = os.getuid()
    return info.st_uid == uid or (allow_root and info.st_uid == _ROOT_UID)


def _group_is_owners_alone(gid: int, uid: int) -> bool:
    """Whether the group `gid` holds only the user `uid` (a user private group; see the module doc):
    its listed members are the owner at most, and every account whose primary group it is (which
    /etc/group does not list) is the owner."""
    try:
        import grp
        import pwd

        group, owner = grp.getgrgid(gid), pwd.getpwuid(uid)
        accounts = pwd.getpwall()
    except (ImportError, KeyError, OSError):  # an unknown group or owner: nothing says it is theirs alone
        return False
    if any(member != owner.pw_name for member in group.gr_mem):
        return False  # a listed member other than the owner
    if any(account.pw_gid == gid and account.pw_uid != uid for account in accounts):
        return False  # another account's primary group
    return owner.pw_gid == gid or list(group.gr_mem) == [owner.pw_name]


def _writable_by_others(info: os.stat_result) -> bool:
    if info.st_mode & stat.S_IWOTH:
        return True
    return bool(info.st_mode & stat.S_IWGRP) and not _group_is_owners_alone(info.st_gid, info.st_uid)


def _ancestors_reason(root: Path) -> str | None:
    """Why the folders above the cache's root let someone else replace it, or None."""
    for folder in root.parents:
        try:
            info = folder.stat()
        except FileNotFoundError:  # made later, by `private_folder`, for this user alone
            continue
        except OSError as exc:
            return f"{folder} cannot be read ({exc.strerror or exc})"
        if not _owner_ok(info, allow_root=True):
            return f"{folder} is owned by uid {info.st_uid}, not by you (uid {os.getuid()}) or root"
        if _writable_by_others(info) and not info.st_mode & stat.S_ISVTX:
            return f"{folder} is writable by others and not sticky"
    return None


def untrusted_folder(folder: Path, root: Path | None = None) -> str | None:
    """None when code in `folder` (inside the cache's `root`) can only have been written by this user,
    else one line saying which folder is not and why. A folder that does not exist yet is judged by
    the nearest one that does (it will be made private: `private_folder`)."""
    if sys.platform == "win32" or not hasattr(os, "getuid"):  # no POSIX owners: nothing to compare
        return None
    root = Path(os.path.abspath(root if root is not None else default_cache_dir()))
    folder = Path(os.path.abspath(folder))
    if not folder.is_relative_to(root):
        raise ValueError(f"{folder} is not inside the cache {root}")
    chain = [folder, *(p for p in folder.parents if p.is_relative_to(root))]
    for path in chain:
        try:
            info = path.stat()
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"{path} cannot be read ({exc.strerror or exc})"
        if not stat.S_ISDIR(info.st_mode):
            return f"{path} is not a folder"
        if not _owner_ok(info, allow_root=False):
            return f"{path} is owned by uid {info.st_uid}, not by you (uid {os.getuid()})"
        if _writable_by_others(info):
            return f"{path} is writable by group or others (chmod go-w {path})"
    return _ancestors_reason(root)


def private_folder(folder: Path) -> Path:
    """`folder` made (with its missing parents) with mode 0700, whatever the umask."""
    folder = Path(folder)
    missing = []
    for path in [folder, *folder.parents]:
        if path.exists():
            break
        missing.append(path)
    folder.mkdir(parents=True, exist_ok=True)
    for path in missing:
        try:
            os.chmod(path, PRIVATE_MODE)
        except OSError:
            pass  # made by another process of ours meanwhile: judged by `untrusted_folder` when read
    return folder


def unwritable_folder(folder: Path) -> str | None:
    """`folder` made private (`private_folder`); None when this process can then write in it, else one
    line saying why not: it cannot be made (a parent that is a file, a folder we may not write), or it
    is read-only to us. The caller keeps nothing there (a private temporary folder serves this process)
    rather than failing at the first write, as inductor does with a traceback."""
    try:
        private_folder(folder)
    except OSError as exc:
        return f"{folder} cannot be made ({exc.strerror or exc})"
    # access(2) asks the kernel, so a read-only mount, an immutable folder and an ACL count, as they do
    # for root, who may write a folder of any mode
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable"
    return None


def private_temporary_folder(prefix: str) -> Path:
    """A new folder of mode 0700 in the system's temporary folder, removed when this process exits
    (each process that cannot trust the cache compiles into one: it must not pile up in /tmp)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


def record_digest(artifact: Path, final: Path | None = None) -> None:
    """Record `artifact`'s sha256 beside `final` (where it will be renamed to; itself by default),
    atomically, and make the artifact readable by its owner only. Call it before the rename: a reader
    that finds the artifact then finds its digest (`publish_artifact` does both, locked)."""
    final = final or artifact
    os.chmod(artifact, FILE_MODE)
    fd, temp = tempfile.mkstemp(dir=final.parent, suffix=DIGEST_SUFFIX + ".partial")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(sha256_of(artifact) + "\n")
        os.replace(temp, digest_path(final))
    finally:
        Path(temp).unlink(missing_ok=True)


@contextlib.contextmanager
def _artifact_lock(path: Path, exclusive: bool):
    """`path`'s lock file (`LOCK_SUFFIX`) held, exclusively to change the artifact and its digest,
    shared to check them. Two processes building one artifact at once (a cold cache, two `generate`s)
    each wrote its digest and then renamed its file: one build's digest beside the other's file, which
    both then found "damaged", one deleting what the other had just made, each falling back to the
    slow path. A folder where the lock cannot be made (a read-only cache: nobody builds there) is
    used unlocked."""
    try:
        if fcntl is None:
            raise OSError("no flock here")
        fd = os.open(path.with_name(path.name + LOCK_SUFFIX), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def publish_artifact(built: Path, final: Path) -> None:
    """A freshly built artifact renamed to `final` with its digest recorded, as one step for every
    other process (`_artifact_lock`)."""
    with _artifact_lock(final, exclusive=True):
        record_digest(built, final)
        os.replace(built, final)


def unverified_file(path: Path) -> str | None:
    """None when `path` is this user's own file, not writable by others, and matches its recorded
    digest; else why not (one line: the caller builds it again or loads nothing). Checked under the
    artifact's shared lock: never between another process's digest and its rename."""
    with _artifact_lock(path, exclusive=False):
        return _unverified_file(path)


def _unverified_file(path: Path) -> str | None:
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is not a plain file"
    if hasattr(os, "getuid") and not _owner_ok(info, allow_root=False):
        return f"{path} is owned by uid {info.st_uid}, not by you (uid {os.getuid()})"
    if _writable_by_others(info):
        return f"{path} is writable by group or others"
    try:
        recorded = digest_path(path).read_bytes().decode("ascii").strip()
    except OSError:
        return f"{path} has no recorded digest ({digest_path(path).name})"
    except UnicodeDecodeError:  # a damaged digest file: the artifact is unverified, not a crash
        return f"{path}'s recorded digest ({digest_path(path).name}) is not a digest (damaged)"
    try:
        found = sha256_of(path)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    if found != recorded:
        return f"{path} differs from the digest recorded when it was built (damaged or replaced)"
    return None


def remove_artifact(path: Path) -> str | None:
    """An artifact that failed its check, and its digest, removed (to be built again); None, or why it
    could not be (a read-only cache: the caller loads nothing from there, where an OSError ended the
    generation). One that another process has published since it failed is kept."""
    with _artifact_lock(path, exclusive=True):
        if path.exists() and _unverified_file(path) is None:
            return None
        return _remove_pair(path)


def _remove_pair(path: Path) -> str | None:
    for stale in (path, digest_path(path)):
        try:
            stale.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            return f"{stale} failed its check and cannot be removed to build it again ({exc.strerror or exc})"
    return None



