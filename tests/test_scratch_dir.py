"""kvaudit.atomic: a scratch directory an interrupt does not leave in the temp dir; an atomic write that fails
names the file asked for."""
import errno
import os
import re
import shutil

import pytest

from kvaudit import atomic


def test_an_interrupt_while_the_directory_is_removed_still_removes_it(tmp_path, monkeypatch):
    """``bench`` interrupted while a trial's TemporaryDirectory was being removed left a kvaudit-bench-*
    directory behind (seen once in ~30 runs of test_interrupts' bench test; the likeliest cause): the removal is finished
    before the interrupt goes on."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(atomic.tempfile, "tempdir", None)  # (tempfile caches the temp dir)
    real, calls = shutil.rmtree, []

    def interrupted_once(path, *a, **k):
        calls.append(path)
        if len(calls) == 1:
            raise KeyboardInterrupt  # a signal landing inside the first removal
        return real(path, *a, **k)

    monkeypatch.setattr(atomic.shutil, "rmtree", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        with atomic.scratch_dir("kvaudit-x-") as d:
            open(os.path.join(d, "f"), "w").close()
    assert len(calls) == 2 and os.listdir(tmp_path) == []


def test_the_directory_is_removed_after_an_error_too(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(atomic.tempfile, "tempdir", None)
    with pytest.raises(ValueError):
        with atomic.scratch_dir("kvaudit-x-") as d:
            assert os.path.basename(d).startswith("kvaudit-x-") and os.path.dirname(d) == str(tmp_path)
            raise ValueError
    assert os.listdir(tmp_path) == []


def test_an_interrupt_that_lands_right_after_the_directory_is_made_still_removes_it(tmp_path, monkeypatch):
    """`bench` interrupted right after a trial's line ("seed 1: found ...") left the next trial's directory:
    the SIGTERM landed inside ``mkdtemp`` after its mkdir, before it returned the name (twice in the merged
    suite; a signal mask did not hold it, since another thread of the process can take a process-directed
    signal). The name is now chosen before the directory is made."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(atomic.tempfile, "tempdir", None)
    real = os.mkdir

    def interrupted_mkdir(path, *a, **k):
        real(path, *a, **k)
        raise KeyboardInterrupt  # the signal, between the mkdir and the next line

    monkeypatch.setattr(os, "mkdir", interrupted_mkdir)
    with pytest.raises(KeyboardInterrupt):
        with atomic.scratch_dir("kvaudit-x-"):
            pass
    assert os.listdir(tmp_path) == []


def test_a_name_another_process_took_meanwhile_is_not_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(atomic.tempfile, "tempdir", None)

    real = os.mkdir

    def taken(path, *a, **k):
        real(path)
        real(os.path.join(path, "theirs"))  # made by someone else since the name was checked
        raise FileExistsError(path)

    monkeypatch.setattr(atomic.os, "mkdir", taken)
    with pytest.raises(FileExistsError):
        with atomic.scratch_dir("kvaudit-x-"):
            pass
    (left,) = os.listdir(tmp_path)
    assert os.listdir(tmp_path / left) == ["theirs"]


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_a_write_that_fails_names_the_file_asked_for_and_leaves_no_temporary(tmp_path, monkeypatch, step):
    """A full disk at fsync names no file (at replace, the temporary): the error names the file the caller
    wrote, so every caller's one-line message does (campaign pull and the run record wrapped it each)."""
    def full(*a):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *(() if step == "fsync" else a[:1]))

    monkeypatch.setattr(os, step, full)
    target = str(tmp_path / "out.json")
    with pytest.raises(OSError) as caught:
        atomic.write_text_atomic(target, "{}")
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, target)
    assert os.listdir(tmp_path) == []


def test_an_atomic_write_through_a_link_replaces_the_file_it_names_and_keeps_the_link(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.txt").write_text("old")
    os.symlink("d/f.txt", tmp_path / "link.txt")
    atomic.write_text_atomic(str(tmp_path / "link.txt"), "new")
    assert os.path.islink(tmp_path / "link.txt") and (tmp_path / "d" / "f.txt").read_text() == "new"
    os.symlink("d/g.txt", tmp_path / "dangling.txt")
    atomic.write_text_atomic(str(tmp_path / "dangling.txt"), "made")
    assert os.path.islink(tmp_path / "dangling.txt") and (tmp_path / "d" / "g.txt").read_text() == "made"
    assert atomic.fd_link(str(tmp_path / "link.txt")) is None and atomic.fd_link(str(tmp_path / "nothing")) is None
    os.symlink("/proc/self/fd/1", tmp_path / "out")
    assert atomic.fd_link("/dev/stdout") == "/dev/stdout"
    assert atomic.fd_link(str(tmp_path / "out")).startswith("/proc/")
    os.symlink("/proc/self/fd", tmp_path / "fdd")  # (tester2 56: a link to the directory of descriptors)
    assert re.fullmatch(r"/proc/\d+/fd/1", atomic.fd_link(str(tmp_path / "fdd" / "1")))


def test_an_atomic_write_keeps_the_permission_bits_only_and_the_owner(tmp_path):
    """tm63: the mode kept from the file written over was all of it (S_IMODE): its setuid, setgid and sticky
    bits were set on the new content (setuid survived where the writer has CAP_FSETID, a root's run); and a
    root's run over another user's file gave it to root. Now the permission bits (0o777) and, where the
    writer may, the owner and group."""
    path = tmp_path / "report.json"
    path.write_text("old")
    path.chmod(0o7755)  # setuid, setgid, sticky
    os.chown(path, 65534, 65534) if os.geteuid() == 0 else None  # (nobody)
    owner = path.stat().st_uid, path.stat().st_gid
    atomic.write_text_atomic(str(path), "new")
    assert path.read_text() == "new"
    assert oct(path.stat().st_mode & 0o7777) == oct(0o755)
    assert (path.stat().st_uid, path.stat().st_gid) == owner
