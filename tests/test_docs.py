"""The docs site (mkdocs.yml, docs/) and the README: the command reference is what the click commands
say now, every page is in the nav, every relative link reaches a file that exists, and the site's copy
of the two set-up commands is the README's."""
import os
import subprocess
import re
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")


def _pages() -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), DOCS) for d, _, fs in os.walk(DOCS) for f in fs if f.endswith(".md"))


def _links(path: str) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link outside code blocks and code spans."""
    out, fence = [], False
    for n, line in enumerate(open(path).read().split("\n"), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            out += [(n, m.group(1)) for m in LINK.finditer(re.sub(r"`[^`]*`", "", line))]
    return out


def _nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def _broken(path: str) -> list[str]:
    here = os.path.dirname(path)
    bad = []
    for n, target in _links(path):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#", 1)[0]
        if not os.path.exists(os.path.normpath(os.path.join(here, file))):
            bad.append(f"{os.path.relpath(path, ROOT)}:{n}: {target}")
    return bad


def test_the_command_reference_is_what_the_click_commands_say_now():
    sys.path.insert(0, DOCS)
    try:
        import gen_commands
    finally:
        sys.path.remove(DOCS)
    with open(gen_commands.PAGE) as fh:
        committed = fh.read()
    assert committed == gen_commands.render(), "docs/reference/commands.md is stale: run python docs/gen_commands.py"
    # every command and every option of --help is on the page
    from click.testing import CliRunner

    from kvaudit.cli import main

    help_ = CliRunner().invoke(main, ["fuzz", "--help"]).output
    for flag in re.findall(r"^\s+(--[a-z][a-z-]*)", help_, re.M):
        assert f"`{flag}`" in committed, flag
    for name in main.list_commands(None):
        assert f"## `kvaudit {name}`" in committed
    # an option declared without a default has none on the page (click 8.3+ keeps a sentinel there, which
    # --help never shows: fuzz --bug, campaign status/pull --db)
    assert "Sentinel" not in committed and "UNSET" not in committed


def test_the_generator_tells_a_stale_page(tmp_path):
    sys.path.insert(0, DOCS)
    try:
        import gen_commands
    finally:
        sys.path.remove(DOCS)
    page = tmp_path / "commands.md"
    assert not gen_commands.is_current(str(page))
    page.write_text(gen_commands.render())
    assert gen_commands.is_current(str(page))
    page.write_text(gen_commands.render().replace("Show this message and exit.", "Show help.", 1))
    assert not gen_commands.is_current(str(page))


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    with open(os.path.join(ROOT, "mkdocs.yml")) as fh:
        config = yaml.safe_load(fh)
    assert config["theme"]["name"] == "material"
    nav = _nav_pages(config["nav"])
    assert sorted(nav) == _pages()


@pytest.mark.parametrize("page", ["README.md", *[os.path.join("docs", p) for p in _pages()]])
def test_every_link_of_the_readme_and_the_docs_reaches_a_file(page):
    assert _broken(os.path.join(ROOT, page)) == []


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "a.md").write_text("[ok](a.md) [gone](b.md#x) `[code](c.md)` [web](https://x.org)\n")
    assert _broken(str(tmp_path / "a.md")) == [f"{os.path.relpath(str(tmp_path / 'a.md'), ROOT)}:1: b.md#x"]


def test_the_site_shows_the_readmes_two_set_up_commands():
    readme = open(os.path.join(ROOT, "README.md")).read()
    index = open(os.path.join(DOCS, "index.md")).read()
    block = readme[readme.index("```bash\n"):readme.index("```\n", readme.index("```bash\n") + 1) + 4]
    assert block.count("pip install torch==2.13.0") == 2
    assert block in index


def test_the_readme_stays_short():
    with open(os.path.join(ROOT, "README.md")) as fh:
        assert len(fh.read().splitlines()) <= 300


def _ends_mid_sentence(text: str) -> bool:
    """A page whose last line of text ends in a word or a comma was cut off (a split that lost its tail)."""
    last = [line for line in text.splitlines() if line.strip()][-1].rstrip()
    return not last.endswith((".", ")", "|", "`", ":", "!", "?"))


@pytest.mark.parametrize("page", ["README.md", *[os.path.join("docs", p) for p in _pages()]])
def test_no_page_ends_mid_sentence(page):
    with open(os.path.join(ROOT, page)) as fh:
        assert not _ends_mid_sentence(fh.read())


def test_a_page_cut_mid_sentence_is_caught():
    assert _ends_mid_sentence("`ci` writes its JUnit with a\n\n")
    assert not _ends_mid_sentence("the end.\n")


def test_the_exit_codes_table_names_every_option_of_every_command():
    """The table's synopsis of fuzz and replay lacked --paranoid (which has an exit code of its own):
    every option of every command is on its row (``REPORT FLAGS`` stands for the report options; an
    option counts when any of its spellings is there: ``-o``, ``--no-resolve``)."""
    import click

    from kvaudit.cli import main

    with open(os.path.join(DOCS, "reference", "exit-codes.md")) as fh:
        heads = [line.split(" | ")[0] for line in fh if line.startswith("| `kvaudit ")]

    def commands(group, path=()):
        for name, cmd in group.commands.items():
            yield from commands(cmd, path + (name,)) if isinstance(cmd, click.Group) else [(path + (name,), cmd)]

    report_flags = {"--html", "--sarif", "--junit", "--json"}
    for path, cmd in commands(main):
        rows = " ".join(h for h in heads if f"`kvaudit {' '.join(path)}" in h)
        assert rows, f"no row for kvaudit {' '.join(path)}"
        for p in cmd.params:
            names = [*p.opts, *p.secondary_opts] if isinstance(p, click.Option) else []
            if not names or "--help" in names or (set(names) & report_flags and "REPORT FLAGS" in rows):
                continue
            assert any(re.search(rf"\[{re.escape(n)}[\] ]|{re.escape(n)}[ \]|`]", rows) for n in names), \
                f"kvaudit {' '.join(path)}: {names[-1]} is not on its row of exit-codes.md"


def test_the_exit_codes_table_has_every_code_a_commands_help_names():
    """ci's --help said "2 on bad input" (a bad --presets, a target's own mistake met running: tc62) while its
    row of exit-codes.md listed 0, 1, 5, 69 and 130: every code a command's help names ("Exits 0 when ..., 2 on
    ...") is on its row's exit codes."""
    import click

    from kvaudit.cli import main

    with open(os.path.join(DOCS, "reference", "exit-codes.md")) as fh:
        rows = [line.split(" | ") for line in fh if line.startswith("| `kvaudit ")]

    def commands(group, path=()):
        for name, cmd in group.commands.items():
            yield from commands(cmd, path + (name,)) if isinstance(cmd, click.Group) else [(path + (name,), cmd)]

    for path, cmd in commands(main):
        said = re.search(r"Exits? (.*)", " ".join((cmd.help or "").split()))
        if said is None:
            continue
        codes = re.findall(r"(?:^|[,;] |\band )(\d{1,3})(?= (?:if|when|on|for|once|clean|a |bad|nothing|atheris|"
                           r"interrupted))", said.group(1))
        codes_cell = " ".join(r[-1] for r in rows if f"`kvaudit {' '.join(path)}" in r[0])
        missing = [c for c in codes if not re.search(rf"(?<![\w.]){c} ", codes_cell)]
        assert codes and not missing, f"kvaudit {' '.join(path)}: exit code(s) {missing or codes} of its --help " \
                                      "not on its row of exit-codes.md"


def test_the_command_reference_leaves_out_an_installed_plugin_packages_kind(tmp_path):
    """With a package registering a kvaudit.targets entry point installed, --check failed: the page's
    --target choices read [eut|sglang|vllm|mine]."""
    (tmp_path / "mine_kind.py").write_text(
        "import rowtoy_plugin\n\ndef kind():\n    return rowtoy_plugin.KIND\n")
    dist = tmp_path / "mine_kind-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mine-kind\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvaudit.targets]\nmine = mine_kind:kind\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.path.join(ROOT, "tests"), ROOT]))
    seen = subprocess.run([sys.executable, "-c", "from kvaudit.targets import registry; print(registry.kinds())"],
                          env=env, capture_output=True, text=True, cwd=ROOT)
    assert "rowtoy" in seen.stdout, seen.stdout + seen.stderr  # (the entry point does load)
    done = subprocess.run([sys.executable, "docs/gen_commands.py", "--check"], env=env, capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_gen_commands_refuses_an_argument_it_does_not_know_and_help_writes_nothing():
    """'python docs/gen_commands.py --help' (any argument but --check) rewrote the page."""
    before = os.stat(os.path.join(ROOT, "docs", "reference", "commands.md")).st_mtime_ns
    helped = subprocess.run([sys.executable, "docs/gen_commands.py", "--help"], capture_output=True, text=True, cwd=ROOT)
    wrong = subprocess.run([sys.executable, "docs/gen_commands.py", "--chek"], capture_output=True, text=True, cwd=ROOT)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: python docs/gen_commands.py"), helped.stdout
    assert wrong.returncode == 2 and "unrecognized arguments: --chek" in wrong.stderr, wrong.stderr
    assert os.stat(os.path.join(ROOT, "docs", "reference", "commands.md")).st_mtime_ns == before
