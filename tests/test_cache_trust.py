"""Code in the cache is loaded only when it is the user's own (`latentloop.cache_trust`): a library
planted in a folder someone else can write never runs, and a damaged one is built again, never mapped."""

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from latentloop import util
from latentloop.inference import cache_trust
from latentloop.inference.cache_trust import record_digest, untrusted_folder, unverified_file

REPO = Path(__file__).resolve().parents[1]
needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
IS_ROOT = hasattr(os, "getuid") and os.getuid() == 0
OTHER_UID = 12345  # a user who is not us


def private(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def shared_group(monkeypatch, members: list[str], primary: bool = False, others_primary: bool = False) -> None:
    """Every group looked up lists `members`; every owner is "me", whose primary group it is or not;
    the accounts are me and "bob", whose primary group it is when `others_primary`."""
    import grp
    import pwd

    def account(name: str, uid: int, gid: int):
        return pwd.struct_passwd((name, "x", uid, gid, "", "/", "/bin/sh"))

    me = account("me", os.getuid(), os.getgid() if primary else 4242)
    bob = account("bob", os.getuid() + 1, os.getgid() if others_primary else 4343)
    monkeypatch.setattr(grp, "getgrgid", lambda gid: grp.struct_group(("g", "x", gid, members)))
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: me if uid == me.pw_uid else bob)
    monkeypatch.setattr(pwd, "getpwall", lambda: [me, bob])


def test_a_private_folder_is_trusted_and_one_others_may_write_is_not(tmp_path):
    root = private(tmp_path / "cache")
    kernels = private(root / "kernels")
    assert untrusted_folder(kernels, root) is None
    kernels.chmod(0o777)
    assert "writable by group or others" in untrusted_folder(kernels, root)
    kernels.chmod(0o700)
    root.chmod(0o770)  # the root itself, group-writable: a group member could swap kernels/ for theirs
    with pytest.MonkeyPatch.context() as patch:
        shared_group(patch, members=["alice", "bob"])
        assert str(root) in untrusted_folder(kernels, root)
    root.chmod(0o700)
    assert untrusted_folder(root / "not" / "made" / "yet", root) is None  # judged by the nearest folder


def test_a_folder_owned_by_someone_else_is_not_trusted(tmp_path, monkeypatch):
    root = private(tmp_path / "cache")
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 1)  # every file here now belongs to "someone else"
    assert f"owned by uid {me}" in untrusted_folder(root, root)


@pytest.mark.parametrize("members, primary, others_primary, trusted", [
    ([], True, False, True),  # a user private group (umask 002's companion): the owner's primary group, no members
    (["me"], False, False, True),  # the owner its only member
    (["me", "bob"], False, False, False),  # bob could swap the folder's contents
    ([], False, False, False),  # nobody listed, and not the owner's own group: whose it is is unknown
    ([], True, True, False),  # everyone's primary group (openSUSE's `users`): /etc/group lists nobody
    (["me"], False, True, False),  # listed alone, but bob's primary group
])
def test_group_write_is_trusted_only_where_the_group_is_the_owners_alone(tmp_path, monkeypatch, members, primary,
                                                                        others_primary, trusted):
    """Under umask 002 the token cache made the cache's root 0775, and from then on no kernel or
    compiled step was ever loaded from it, though the group was the user's alone."""
    old = os.umask(0o002)
    try:
        root = tmp_path / "cache"
        root.mkdir()  # as the token cache makes it: the umask's mode
    finally:
        os.umask(old)
    assert stat.S_IMODE(root.stat().st_mode) == 0o775
    os.chown(root, os.getuid(), os.getgid())  # the folder's group: the one the fake says is the owner's
    shared_group(monkeypatch, members, primary, others_primary)
    verdict = untrusted_folder(root / "kernels", root)
    assert (verdict is None) == trusted, verdict
    if not trusted:
        assert "writable by group or others" in verdict
    root.chmod(0o777)  # write by others is never the owner's alone
    assert "writable by group or others" in untrusted_folder(root / "kernels", root)


def test_a_cache_whose_parents_are_not_made_yet_is_trusted_and_made_private(tmp_path, monkeypatch):
    """LATENTLOOP_CACHE=~/newproj/cache before ~/newproj existed: every process distrusted it, compiled
    into a temporary folder of its own and left it behind."""
    from latentloop.inference import fast

    root = tmp_path / "newproj" / "cache"
    assert untrusted_folder(root / "kernels", root) is None
    monkeypatch.setenv("LATENTLOOP_CACHE", str(root))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(fast, "_private_compile_dirs", {})
    chosen = fast.compile_cache_dir()
    assert chosen == root / "inductor"
    for folder in (chosen, root, root.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_folders_above_the_root_must_not_let_others_replace_it(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    root = private(shared / "cache")
    shared.chmod(0o777)  # anyone may rename cache/ away and put their own in its place
    assert "writable by others and not sticky" in untrusted_folder(root, root)
    shared.chmod(0o1777)  # as /tmp: sticky, so only the owner of cache/ may rename it
    assert untrusted_folder(root, root) is None


def test_a_file_is_verified_by_owner_mode_and_the_digest_recorded_when_built(tmp_path):
    folder = private(tmp_path / "kernels")
    artifact = folder / "lib.so"
    artifact.write_bytes(b"\x7fELF" + bytes(range(256)) * 4)
    assert "no recorded digest" in unverified_file(artifact)
    record_digest(artifact)
    assert unverified_file(artifact) is None
    assert stat.S_IMODE(artifact.stat().st_mode) == cache_trust.FILE_MODE
    with open(artifact, "r+b") as handle:  # one flipped bit
        handle.seek(100)
        byte = handle.read(1)[0]
        handle.seek(100)
        handle.write(bytes([byte ^ 1]))
    assert "differs from the digest" in unverified_file(artifact)
    record_digest(artifact)
    artifact.chmod(0o666)
    assert "writable by group or others" in unverified_file(artifact)


def test_private_folders_are_made_0700_whatever_the_umask(tmp_path):
    old = os.umask(0o002)  # Debian's umask for user-private groups: folders would be group-writable
    try:
        made = cache_trust.private_folder(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert stat.S_IMODE(made.parent.stat().st_mode) == 0o700


# ---- the kernels, in a child process with its own cache ----------------------------------------------

PLANTED_C = textwrap.dedent("""
    #include <stdio.h>
    __attribute__((constructor)) static void planted(void) {
        FILE *f = fopen(MARKER, "w");
        if (f) { fputs("ran", f); fclose(f); }
    }
    int latentloop_rows_linear_lanes(void) { return 16; }
""")


def child(cache: Path, code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "LATENTLOOP_CACHE": str(cache), "LATENTLOOP_NATIVE": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)


LOAD_KERNELS = textwrap.dedent("""
    from pathlib import Path
    from latentloop.inference import native
    for name in ("rows_linear", "int8_linear"):
        lib = native.native_library(name)
        print(name, Path(lib._name).name if lib is not None else "none", native.native_status(name))
""")


def built_kernels(cache: Path) -> dict[str, str]:
    done = child(cache, LOAD_KERNELS)
    assert done.returncode == 0, done.stderr
    names = dict(line.split(" ", 2)[:2] for line in done.stdout.splitlines())
    assert all(name != "none" for name in names.values()), done.stdout
    return names


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A cache with this machine's kernels built once for the module, and their file names."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    cache = private(tmp_path_factory.mktemp("names") / "cache")
    return cache, built_kernels(cache)


@pytest.fixture(scope="module")
def kernel_names(built_cache):
    return built_cache[1]


def planted_library(tmp_path: Path, marker: Path) -> bytes:
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_C)
    target = tmp_path / "planted.so"
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", f'-DMARKER="{marker}"', str(source), "-o",
                    str(target)], check=True, capture_output=True)
    return target.read_bytes()


@needs_cc
@pytest.mark.parametrize("how", ["writable by others", "owned by someone else"])
def test_a_library_planted_in_a_cache_someone_else_controls_never_runs(tmp_path, kernel_names, how):
    if how == "owned by someone else" and not IS_ROOT:
        pytest.skip("giving a folder to another user needs root")
    marker = tmp_path / "planted-ran"
    cache = tmp_path / "shared-cache"
    (cache / "kernels").mkdir(parents=True)
    planted = planted_library(tmp_path, marker)
    for file_name in kernel_names.values():  # the names this machine's kernels are built under, with digests
        (cache / "kernels" / file_name).write_bytes(planted)
        record_digest(cache / "kernels" / file_name)
    if how == "owned by someone else":
        for path in [cache, cache / "kernels", *(cache / "kernels").iterdir()]:
            os.chown(path, OTHER_UID, OTHER_UID)
        cache.chmod(0o1777)
        (cache / "kernels").chmod(0o755)
    else:
        cache.chmod(0o1777)
        (cache / "kernels").chmod(0o777)
    done = child(cache, LOAD_KERNELS)
    assert done.returncode == 0, done.stderr
    assert not marker.exists(), "the planted library's constructor ran"
    assert "rows_linear none not loading kernels from" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if "not loading kernels from" in line]
    assert len(warnings) == 1 and str(cache / "kernels") in warnings[0], done.stderr  # said once, naming it


@needs_cc
@pytest.mark.parametrize("damage", ["truncated", "empty", "text", "foreign ELF", "no digest"])
def test_a_damaged_library_in_the_cache_is_built_again_never_mapped(tmp_path, built_cache, damage):
    cache = tmp_path / "cache"
    shutil.copytree(built_cache[0], cache)  # a copy of the module's build: each damage starts from good files
    private(cache)
    names = built_cache[1]
    target = cache / "kernels" / names["rows_linear"]
    good = target.read_bytes()
    if damage == "truncated":  # mapped as it is, this ended every generate with SIGBUS
        target.write_bytes(good[: len(good) // 3])
    elif damage == "empty":
        target.write_bytes(b"")
    elif damage == "text":
        target.write_text("not a library\n")
    elif damage == "foreign ELF":
        target.write_bytes((cache / "kernels" / names["int8_linear"]).read_bytes())
    else:
        cache_trust.digest_path(target).unlink()
    done = child(cache, LOAD_KERNELS)
    assert done.returncode == 0, done.stderr  # no SIGBUS (-7), no traceback
    assert "rows_linear " + names["rows_linear"] + " native" in done.stdout, done.stdout + done.stderr
    assert target.read_bytes() == good  # the same build as before, made again
    assert unverified_file(target) is None


def test_an_untrusted_compile_cache_is_replaced_by_a_private_folder_for_the_process(tmp_path, monkeypatch, capsys):
    from latentloop.inference import fast

    shared = tmp_path / "shared-inductor"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    monkeypatch.setattr(fast, "_private_compile_dirs", {})
    monkeypatch.setattr(util, "_warned", set())
    chosen = fast.compile_cache_dir()
    assert chosen != shared and shared not in chosen.parents
    assert stat.S_IMODE(chosen.stat().st_mode) == 0o700 and chosen.stat().st_uid == os.getuid()
    assert fast.compile_cache_dir() == chosen  # one private folder a process
    err = capsys.readouterr().err
    assert err.count("not loading compiled code from") == 1 and str(shared) in err
    shutil.rmtree(chosen)
    shared.chmod(0o700)
    assert fast.compile_cache_dir() == shared  # the user's own folder is used as it is


def _aot_step(tmp_path, monkeypatch):
    """An ahead-of-time decode step of a test gpt over a frozen cache (3 tokens prefilled), its
    compile cache in tmp_path/inductor: (step, cache)."""
    import latentloop as ll
    from latentloop.engine import model_options
    from latentloop.inference import aot
    from latentloop.inference.fast import FastDecoder

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(private(tmp_path / "inductor")))
    model = ll.build("gpt", preset="test").eval()
    options = model_options(model, {})
    fast = FastDecoder(model, compile=False, **options)
    cache = fast.new_cache(1, 24)
    with torch.inference_mode():
        model.prefill(torch.tensor([[256, 5, 9]]), cache, **options)
    fast.begin_decoding(cache)
    cache.set_window()
    step = aot.AotDecodeStep(model, options, None)
    return step, cache


def test_a_package_that_fails_its_check_is_compiled_again_not_loaded(tmp_path, monkeypatch):
    """A `.pt2` without its digest (or damaged, or replaced) is never handed to the loader."""
    from latentloop.inference import aot

    step, cache = _aot_step(tmp_path, monkeypatch)
    path = (tmp_path / "inductor" / aot.AOT_SUBDIR /
            f"{aot.package_key(step.model, step.options, cache, aot.cache_fields(cache))}.pt2")
    private(path.parent)
    path.write_bytes(b"planted")  # no digest: not ours
    loaded, compiled = [], []
    monkeypatch.setattr(step, "_load", lambda shape, where: loaded.append(where.read_bytes()))

    def compile_(cache, fields, where):
        compiled.append(where)
        where.write_bytes(b"package")
        record_digest(where)

    monkeypatch.setattr(step, "_compile", compile_)
    step.prepare(cache)
    assert compiled == [path] and loaded == [b"package"]  # the planted bytes were never loaded
    step.packages.clear()
    compiled.clear()
    loaded.clear()
    step.prepare(cache)  # now verified: loaded as it is
    assert compiled == [] and loaded == [b"package"]


def test_the_kernels_folder_is_judged_after_it_is_made_and_a_fresh_build_before_it_is_mapped(tmp_path, monkeypatch):
    """The folder was judged before it existed, so one another user made in between was built into and
    loaded from; and a library just built was mapped unchecked."""
    from latentloop.inference import native

    monkeypatch.setenv("LATENTLOOP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(native.NATIVE_ENV, "1")
    monkeypatch.setattr(util, "_warned", set())
    monkeypatch.setattr(native, "_compiler", lambda: "cc")

    def raced(folder):  # someone else's folder, made between our check and our build
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder).chmod(0o777)
        return Path(folder)

    built = []
    monkeypatch.setattr(native, "private_folder", raced)
    monkeypatch.setattr(native, "_build", lambda cc, source, target, *rest: built.append(target))
    native.native_library.cache_clear()
    try:
        assert native.native_library("int8_linear") is None
        assert built == [] and "writable by group or others" in native.native_status("int8_linear")

        def unchecked_build(cc, source, target, *rest):  # a file under the name, with no digest
            target.write_bytes(b"not a library")
            built.append(target)

        monkeypatch.setattr(native, "private_folder", cache_trust.private_folder)
        monkeypatch.setattr(native, "_build", unchecked_build)
        shutil.rmtree(tmp_path / "cache")
        native.native_library.cache_clear()
        assert native.native_library("int8_linear") is None
        assert built and "has no recorded digest" in native.native_status("int8_linear")
    finally:
        native.native_library.cache_clear()


def test_a_package_compiled_now_is_checked_before_it_is_loaded(tmp_path, monkeypatch):
    from latentloop.inference import aot

    step, cache = _aot_step(tmp_path, monkeypatch)
    loaded = []
    monkeypatch.setattr(step, "_load", lambda shape, where: loaded.append(where))
    monkeypatch.setattr(step, "_compile", lambda cache, fields, where: (private(where.parent),
                                                                       where.write_bytes(b"swapped")))
    with pytest.raises(aot.AotUnavailable, match="no recorded digest"):
        step.prepare(cache)
    assert loaded == []


def test_a_process_that_compiles_into_a_temporary_folder_removes_it_when_it_exits(tmp_path):
    shared = tmp_path / "shared-inductor"
    shared.mkdir()
    shared.chmod(0o777)
    done = child(tmp_path / "cache", "from latentloop.inference import fast; print(fast.compile_cache_dir())",
                 {"TORCHINDUCTOR_CACHE_DIR": str(shared)})
    assert done.returncode == 0, done.stderr
    used = Path(done.stdout.strip())
    assert used != shared and used.name.startswith("latentloop-compiled-")
    assert not used.exists()


def test_a_damaged_digest_or_an_artifact_that_cannot_be_removed_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    """A digest file that is not text (UnicodeDecodeError from every eager generate before) reads as
    unverified; an artifact that failed its check in a read-only cache cannot be removed, which is
    said as a reason (an OSError ended the generation)."""
    from latentloop.inference.cache_trust import digest_path, remove_artifact

    folder = private(tmp_path / "kernels")
    artifact = folder / "lib.so"
    artifact.write_bytes(b"\x7fELF" + bytes(range(64)))
    record_digest(artifact)
    digest_path(artifact).write_bytes(b"\xff\xfe")
    assert "is not a digest" in unverified_file(artifact)

    def read_only(self, *args, **kwargs):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(Path, "unlink", read_only)
    reason = remove_artifact(artifact)
    assert reason is not None and "cannot be removed" in reason and "Read-only file system" in reason
    monkeypatch.undo()
    assert remove_artifact(artifact) is None and not artifact.exists() and not digest_path(artifact).exists()


def test_kernels_that_cannot_be_written_are_said_not_switched_off_silently(tmp_path, monkeypatch, capsys):
    """A cache this process cannot write: the kernel library is not built, the slower torch path runs,
    and a line says so (the kernels were off without a word, so packages were built without them)."""
    from latentloop import util
    from latentloop.inference import native

    monkeypatch.setenv("LATENTLOOP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(util, "_warned", set())
    monkeypatch.setattr(native, "_compiler", lambda: "cc")
    monkeypatch.setattr(native, "_build", lambda cc, source, target, *rest:
                        f"cannot write {target.parent}: Read-only file system")
    native.native_library.cache_clear()
    try:
        assert native.native_library("int8_linear") is None
        err = capsys.readouterr().err
        assert "Read-only file system" in err and "slower torch path" in err and "LATENTLOOP_CACHE" in err
    finally:
        native.native_library.cache_clear()


def test_two_builds_published_at_once_leave_one_file_with_its_own_digest(tmp_path, monkeypatch):
    """Two processes building one artifact (a cold cache): each wrote its digest, then renamed its file,
    so one build's digest could sit beside the other's file; both then found it "damaged", one deleting
    what the other had just made, and each fell back to the slow path. The digest and the rename are one
    step now for every other process: a second publisher and a reader wait while the first is between
    them, and a removal keeps a file published since its check failed."""
    import threading

    from latentloop.inference.cache_trust import digest_path, publish_artifact, remove_artifact

    folder = private(tmp_path / "kernels")
    final = folder / "lib.so"
    first, second = folder / "a.partial", folder / "b.partial"
    first.write_bytes(b"first build")
    second.write_bytes(b"second build, other bytes")
    between, go_on = threading.Event(), threading.Event()
    real_record = cache_trust.record_digest

    def paused_record(artifact, final_path=None):
        real_record(artifact, final_path)
        if artifact == first:  # the first publisher stops between its digest and its rename
            between.set()
            assert go_on.wait(30)

    monkeypatch.setattr(cache_trust, "record_digest", paused_record)
    writer = threading.Thread(target=publish_artifact, args=(first, final))
    writer.start()
    assert between.wait(30)
    done = {}
    other = threading.Thread(target=lambda: done.setdefault("second", publish_artifact(second, final)))
    reader = threading.Thread(target=lambda: done.setdefault("check", unverified_file(final)))
    other.start()
    reader.start()
    other.join(0.5)
    reader.join(0.1)
    assert other.is_alive() and reader.is_alive() and not done  # both wait for the first to finish
    go_on.set()
    for thread in (writer, other, reader):
        thread.join(30)
    assert unverified_file(final) is None  # whichever came last: its file beside its own digest
    assert final.read_bytes() in (b"first build", b"second build, other bytes")
    assert done["check"] is None
    # a reader whose check failed before a fresh build was published does not delete that build
    assert remove_artifact(final) is None and final.exists() and digest_path(final).exists()
    final.write_bytes(b"damaged")
    assert remove_artifact(final) is None and not final.exists()


def test_without_flock_artifacts_are_published_and_checked_unlocked(tmp_path, monkeypatch):
    """`fcntl` is not everywhere (Windows): importing it at the top made `import latentloop.engine` fail
    there (a review). The lock is skipped where it cannot be taken, as in a read-only cache."""
    import subprocess
    import sys

    from latentloop.inference.cache_trust import publish_artifact

    script = ("import sys\nsys.modules['fcntl'] = None\nimport latentloop.inference.cache_trust as trust\n"
              "print(trust.fcntl)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr[-2000:]
    monkeypatch.setattr(cache_trust, "fcntl", None)
    folder = private(tmp_path / "kernels")
    built = folder / "lib.so.partial"
    built.write_bytes(b"a build")
    publish_artifact(built, folder / "lib.so")
    assert unverified_file(folder / "lib.so") is None and not (folder / "lib.so.lock").exists()
