"""Recorded frames against the current source (kvaudit.audit.frames), and the freshness of the shipped
corpus: every frame ``kvaudit report`` prints for a shipped replay file lies inside the function it
names and carries that line's text. When engine code moves, refresh the corpus with
``kvaudit replay --update corpora/regressions/*.json corpora/sglang/*.json corpora/vllm/*.json tests/data/report/*.json``."""

import glob
import json
import os
import re
import resource
import subprocess

import pytest
from cli_helpers import invoke, kvaudit_script, plain_env

from kvaudit import replay
from kvaudit.audit.findings import Site, installed, portable_path, source_path
from kvaudit.audit.frames import Frame, RecordedEngine, function_ranges, resolve

ROOT = os.path.join(os.path.dirname(__file__), "..")
CORPUS = sorted(glob.glob(os.path.join(ROOT, "corpora", "regressions", "*.json"))) + \
    [pytest.param(p, marks=pytest.mark.sglang) for p in sorted(glob.glob(os.path.join(ROOT, "corpora", "sglang", "*.json")))] + \
    [pytest.param(p, marks=pytest.mark.vllm) for p in sorted(glob.glob(os.path.join(ROOT, "corpora", "vllm", "*.json")))]
STACKS = ("alloc_sites", "free_sites", "prev_free_sites", "read_sites", "lost_sites")
SOURCE = '''import os


def first(x):
    a = x + 1
    return a


def second(y):
    b = y * 2
    return b
'''


@pytest.fixture
def mod(tmp_path):
    p = tmp_path / "mod.py"
    p.write_text(SOURCE)
    return str(p)


def test_a_current_frame_shows_its_line_without_a_note(mod):
    assert resolve(Site(mod, 5, "first", "a = x + 1")) == resolve(Site(mod, 5, "first"))
    fr = resolve(Site(mod, 5, "first"))
    assert (fr.line, fr.source, fr.note) == (5, "a = x + 1", "")


def test_a_line_outside_its_function_is_flagged_and_its_text_not_shown(mod):
    fr = resolve(Site(mod, 10, "first"))  # line 10 is in second()
    assert fr.source == "" and fr.note.startswith("stale: ")
    assert "line 10 is outside first" in fr.note


def test_recorded_text_that_moved_within_the_function_is_relocated(mod):
    fr = resolve(Site(mod, 9, "second", "b = y * 2"))  # recorded before a line was added above
    assert (fr.line, fr.source) == (10, "b = y * 2")
    assert fr.note.startswith("moved: recorded as line 9")


def test_recorded_text_found_nowhere_is_shown_and_flagged(mod):
    fr = resolve(Site(mod, 5, "first", "a = x - 1"))
    assert fr.source == "a = x - 1" and "now reads something else" in fr.note
    assert "no function gone" in resolve(Site(mod, 5, "gone", "a = x + 1")).note


def test_unreadable_files_and_anonymous_code_are_shown_as_recorded(mod):
    fr = resolve(Site("/nowhere/x.py", 3, "f", "text"))
    assert (fr.line, fr.source, fr.note) == (3, "text", "")
    assert resolve(Site(mod, 10, "<lambda>", "b = y * 2")).note == ""


def _bounded(limit_bytes):
    def cap():  # (an unbounded read of /dev/zero would take the machine's memory: here it fails instead)
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return cap


def test_a_frame_naming_a_fifo_a_device_or_a_huge_file_is_not_read(tmp_path):
    # (tester 61a A6: a replay file's frame naming /dev/zero made `kvaudit report --html` read 23.8 GB, and
    # a FIFO blocks its open forever): only a regular file up to MAX_SOURCE_BYTES is read, never waited on
    fifo, sparse = tmp_path / "fifo", tmp_path / "sparse.py"
    os.mkfifo(fifo)
    with open(sparse, "wb") as fh:
        fh.truncate(8 << 30)  # 8 GiB of holes: no disk used
    doc = json.load(open(os.path.join(ROOT, "tests", "data", "report", "hisparse-prebuilt-skip-finish.json")))
    site = doc["findings"][0]["alloc_sites"][0]
    doc["findings"][0]["alloc_sites"] = [dict(site, file=p) for p in (str(fifo), "/dev/zero", str(sparse))]
    src = tmp_path / "in.json"
    src.write_text(json.dumps(doc))
    proc = subprocess.run([kvaudit_script(), "report", str(src), "--html", str(tmp_path / "x.html")],
                          capture_output=True, text=True, env=plain_env(), timeout=120,
                          preexec_fn=_bounded(4 << 30))
    assert proc.returncode == 0, proc.stderr  # rendered
    for p in (fifo, "/dev/zero", sparse):  # shown as recorded, unchecked
        assert re.search(rf"{re.escape(str(p))}:183\n +{re.escape(site['source'])}\n", proc.stdout), proc.stdout
    assert "<html" in (tmp_path / "x.html").read_text().lower()
    assert all(resolve(Site(p, 183, site["function"], "x")) == Frame(183, "x")
               for p in (str(fifo), "/dev/zero", str(sparse)))


def test_ranges_are_reread_when_the_file_changes(mod):
    assert function_ranges(mod, "second") == [(9, 11)]
    with open(mod, "w") as fh:
        fh.write("\n\n" + SOURCE + "# longer now\n")
    assert function_ranges(mod, "second") == [(11, 13)]


def _frames_checked(path):
    """Every recorded frame of ``path``: (where, problem) for each that does not match the current
    source (line outside its function, or recorded text not the line's current text)."""
    _, _, findings, _ = replay.load(path)
    bad, n = [], 0
    for i, f in enumerate(findings):
        for key in STACKS:
            for depth, s in enumerate(getattr(f, key)):
                n += 1
                where = f"finding {i} {key} #{depth} {s.function} {os.path.basename(s.file)}:{s.line}"
                ranges = function_ranges(s.file, s.function)
                if ranges is None:
                    if os.path.isabs(s.file) and not os.path.exists(s.file):
                        pytest.skip(f"{s.file}: recorded on another installation")
                    bad.append((where, "file or function not readable"))
                    continue
                if not any(a <= s.line <= b for a, b in ranges):
                    bad.append((where, "line outside the function"))
                    continue
                with open(source_path(s.file)) as fh:
                    current = fh.read().splitlines()[s.line - 1].strip()
                if s.source != current:
                    bad.append((where, f"recorded text {s.source!r} is not the line's {current!r}"))
    return bad, n


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: os.path.relpath(p, os.path.join(ROOT, "corpora")))
def test_shipped_replay_files_match_the_current_source(path):
    if os.sep + "sglang" + os.sep in path:
        from kvaudit.targets.sglang.boot import SglangUnavailable, load
        try:
            load()
        except SglangUnavailable as e:
            pytest.skip(str(e))
    if os.sep + "vllm" + os.sep in path:
        from kvaudit.targets.vllm.boot import VllmUnavailable, load
        try:
            load()
        except VllmUnavailable as e:
            pytest.skip(str(e))
    bad, n = _frames_checked(path)
    assert not bad, (f"{len(bad)} of {n} frames are stale; refresh with 'kvaudit replay --update "
                     "corpora/regressions/*.json corpora/sglang/*.json corpora/vllm/*.json':\n"
                     + "\n".join(f"  {w}: {why}" for w, why in bad[:12]))
    # and what `kvaudit report` prints: every frame line inside its function, no frame flagged
    result = invoke("report", path)
    assert result.exit_code == 0, result.output
    printed = re.findall(r"^\s+#\d+ (\S+)  (\S+):(\d+)$", result.stdout, re.M)
    assert len(printed) == n
    for function, file, line in printed:
        assert any(a <= int(line) <= b for a, b in function_ranges(file, function)), (function, file, line)
    assert "stale:" not in result.stdout and "moved:" not in result.stdout


def test_sarif_and_junit_show_the_resolved_line_and_the_note():
    """Every renderer goes through resolve(): a frame recorded before the code moved is shown at
    the line its text is on now, with the note, in SARIF and JUnit as on the console."""
    from kvaudit.reports.junit import failure_text
    from kvaudit.reports.sarif import to_sarif

    _, _, findings, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", "overlap-abort-double-free.json"))
    f = findings[0]
    now = f.free_sites[0]
    f.free_sites[0] = Site(now.file, now.line - 7, now.function, now.source)  # as if recorded 7 lines up
    loc = to_sarif([f])["runs"][0]["results"][0]["locations"][0]
    assert loc["physicalLocation"]["region"]["startLine"] == now.line
    assert loc["physicalLocation"]["region"]["snippet"]["text"] == now.source
    assert loc["properties"]["frameNote"].startswith(f"moved: recorded as line {now.line - 7}")
    text = failure_text(f)
    assert f"{now.file}:{now.line} in {now.function}\n        {now.source}\n        (moved: " in text



def test_a_sarif_message_names_the_lines_its_locations_point_at():
    """A frame recorded before the code moved: the SARIF result was located at the line its text is on now, but
    its message, what code scanning shows there, still said 'freed at scheduler.py:<recorded line> in
    handle_abort ... allocated at scheduler.py:<recorded line> in alloc_for_extend' and its 'See also' link the
    recorded line of the allocation: lines that now hold other code."""
    from kvaudit.reports.sarif import to_sarif

    _, _, findings, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", "overlap-abort-double-free.json"))
    f = findings[0]
    free, alloc = f.free_sites[0], f.alloc_sites[0]
    f.free_sites[0] = Site(free.file, free.line - 7, free.function, free.source)  # as if recorded 7 lines up
    f.alloc_sites[0] = Site(alloc.file, alloc.line - 3, alloc.function, alloc.source)
    result = to_sarif([f])["runs"][0]["results"][0]
    assert result["locations"][0]["physicalLocation"]["region"]["startLine"] == free.line
    text = result["message"]["text"]
    assert f"freed at {free.short()} while" in text and text.count(alloc.short()) == 2, text  # headline, See also
    assert f.free_sites[0].short() not in text and f.alloc_sites[0].short() not in text, text
    related = {loc["id"]: loc for loc in result["relatedLocations"]}
    link = int(re.search(r"allocated at \[alloc_for_extend\]\((\d+)\)", text)[1])
    assert related[link]["physicalLocation"]["region"]["startLine"] == alloc.line

def test_an_installed_packages_frame_is_recorded_from_its_package_and_read_back_here():
    """A replay file carries no machine's site-packages path: an installed package's module is recorded from
    its package (``numpy/...``, as ``vllm/v1/...``) and read back from where that package is installed here;
    an old file's absolute path of another machine reads as the package installed here; kvaudit's own files
    stay relative to the checkout."""
    import numpy

    real = os.path.realpath(os.path.join(os.path.dirname(numpy.__file__), "core", "__init__.py"))
    assert portable_path(real) == "numpy/core/__init__.py"
    assert installed("numpy/core/__init__.py") and os.path.samefile(source_path("numpy/core/__init__.py"), real)
    old = "/elsewhere/lib/python3.11/site-packages/numpy/core/__init__.py"  # recorded on another machine
    assert portable_path(old) == "numpy/core/__init__.py" and os.path.samefile(source_path(old), real)
    ours = os.path.join(ROOT, "kvaudit", "replay.py")
    assert portable_path(os.path.abspath(ours)) == "kvaudit/replay.py" and not installed("kvaudit/replay.py")
    assert portable_path("/usr/lib/no-such/thing.py") == "/usr/lib/no-such/thing.py"


def test_a_package_in_a_venv_inside_the_checkout_is_recorded_from_its_package(tmp_path, monkeypatch):
    # a newcomer's `python -m venv .venv` in the clone: its site-packages is inside the checkout, and its
    # packages' frames were recorded as .venv/lib/... (the checkout's files), not from their package
    from kvaudit.audit import findings

    site = tmp_path / ".venv" / "lib" / "python3.11" / "site-packages"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("")
    (site / "pkg" / "mod.py").write_text("x = 1\n")
    monkeypatch.setattr(findings, "_SOURCE_ROOT", str(tmp_path))
    findings._portable.cache_clear()
    try:
        assert findings._portable(str(site / "pkg" / "mod.py"), (str(tmp_path), str(site))) == "pkg/mod.py"
        (tmp_path / "own").mkdir()
        assert findings._portable(str(tmp_path / "own" / "a.py"), (str(tmp_path), str(site))) == "own/a.py"
    finally:
        findings._portable.cache_clear()


def test_a_frame_of_another_release_is_shown_as_recorded_and_never_read_from_the_installed_file(tmp_path):
    """A frame in the engine's package recorded on another release than the installed one: its line and
    text are that release's. ``resolve`` read them against the installed file (a "moved" note, or the
    installed line's text for a frame recorded without one); now it names the release and claims nothing."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text(SOURCE)
    path = str(pkg / "mod.py")
    other = RecordedEngine("pkg", "2.0", "1.0")
    fr = resolve(Site(path, 9, "second", "b = y * 2"), other)  # installed: "b = y * 2" is line 10
    assert (fr.line, fr.source, fr.release) == (9, "b = y * 2", "1.0")
    assert fr.note == "pkg 1.0's line, as recorded: not checked against the installed pkg 2.0"
    fr = resolve(Site(path, 10, "second"), other)  # no recorded text: the installed line's is not shown
    assert (fr.line, fr.source, fr.release) == (10, "", "1.0")
    fr = resolve(Site(path, 9, "second", "b = y * 2"), RecordedEngine("pkg", None, "1.0"))
    assert fr.note == "pkg 1.0's line, as recorded: not checked against no pkg here"
    # an overlay's path names its release, whatever the file says
    overlay = Site("/h/.cache/kvaudit/releases/pkg-0.9/pkg/mod.py", 3, "f", "x = 1")
    assert resolve(overlay, RecordedEngine("pkg", "2.0")).release == "0.9"
    # the installed release, no release named, or a frame outside the package: checked as before
    for engine in (RecordedEngine("pkg", "2.0", "2.0"), RecordedEngine("pkg", "2.0"), None,
                   RecordedEngine("other", "2.0", "1.0")):
        fr = resolve(Site(path, 9, "second", "b = y * 2"), engine)
        assert (fr.line, fr.release) == (10, "") and fr.note.startswith("moved: recorded as line 9"), engine
