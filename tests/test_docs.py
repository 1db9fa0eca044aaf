"""The documents stay true to the code: the generated flag reference is current, the README stays short, links
resolve, and no file outside tests/ reads like a log of past runs."""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README_MAX_LINES = 200
# "session 12", "Session-7", "session_3", "session13": a work-session number, not a decoding session; also broken
# over a line, where the next line may open with a comment marker ("session\n    # 18").
RUN_LOG_PATTERN = re.compile(r"\bsession[ \t_-]*(?:\n[ \t]*(?:#|//|\*|--)?[ \t]*)?\d", re.IGNORECASE)
LINK_PATTERN = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)")  # [text](target) and ![alt](target)


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_config_doc", ROOT / "scripts" / "gen_config_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _project_files() -> list[str]:
    """Tracked files (git ls-files); outside a git checkout every file but build and cache output."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
        return [p for p in out.stdout.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "build"}
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)]


def _docs() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_configuration_doc_matches_the_argument_definitions():
    gen = _gen_module()
    assert (ROOT / "docs" / "configuration.md").read_text() == gen.render(), (
        "docs/configuration.md is stale: run python scripts/gen_config_doc.py")


def test_configuration_check_fails_on_a_stale_file_and_passes_once_regenerated(tmp_path, monkeypatch):
    gen = _gen_module()
    doc = tmp_path / "configuration.md"
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    monkeypatch.setattr(gen, "DOC", doc)
    doc.write_text(gen.render().replace("`--draft-len`", "`--draft-length`", 1))
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0


def test_configuration_flags_are_read_from_any_parser():
    gen = _gen_module()
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--widget-count", type=int, default=7, help="how many | widgets")
    p.add_argument("--mode", choices=["a", "b"], default="b")
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--name")
    p.set_defaults(name="x")
    p.add_argument("--long", help="a help text " * 30)
    flags = gen.render_flags(p)
    assert "- `--widget-count` (default `7`): how many | widgets" in flags
    assert "- `--mode` `a|b` (default `b`)" in flags
    assert "- `--fast`, `--no-fast` (default on)" in flags
    assert "- `--name` (default `x`)" in flags
    assert max(len(line) for line in flags.splitlines()) <= gen.WIDTH  # a long help is wrapped
    assert flags.count("- `--") == 5 and flags.count("\n  ") >= 3  # its continuation lines indented


def test_configuration_defaults_do_not_depend_on_the_environment(monkeypatch):
    gen = _gen_module()
    monkeypatch.setenv("SPECDEC_TLS_CERT", "/tmp/from-the-environment.pem")
    assert "from-the-environment" not in gen.render()
    assert os.environ["SPECDEC_TLS_CERT"] == "/tmp/from-the-environment.pem"  # restored


DOC_LINE_MAX = 300


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_lines_are_wrapped(doc):
    """No line over DOC_LINE_MAX characters: prose is wrapped, and a table whose rows would be longer is a list."""
    long = [f"{n}: {len(line)} characters" for n, line in enumerate(doc.read_text().splitlines(), 1)
            if len(line) > DOC_LINE_MAX]
    assert not long, f"{doc.relative_to(ROOT)}: lines over {DOC_LINE_MAX} characters (wrap them): {long}"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


def test_no_run_log_outside_tests():
    found = []
    for rel in _project_files():
        if rel.startswith("tests/"):
            continue
        if RUN_LOG_PATTERN.search(rel):
            found.append(f"{rel} (its path)")
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary (plots) or deleted in the work tree
        for m in RUN_LOG_PATTERN.finditer(text):
            n = text.count("\n", 0, m.start()) + 1
            found.append(f"{rel}:{n}: {' '.join(m.group().split())[:120]}")
    assert not found, "past-run references (say what the design is and what it measures instead):\n" + "\n".join(found)


def test_run_log_pattern():
    for text in ["Session 23: ...", "session 12 ran", "session-7 CPU", "bench/results/session8/x", "SESSION_3",
                 "an EPYC (session\n    18)", "a run (session\n    # 18)", "session\n// 4"]:
        assert RUN_LOG_PATTERN.search(text), text
    for text in ["8 sessions 2.10x", "session_id", "sessions 4", "per session, 2 tokens", "a session\n\n1. next"]:
        assert not RUN_LOG_PATTERN.search(text), text


def _anchors(doc: pathlib.Path) -> set[str]:
    """The anchors a renderer (GitHub's rule) gives the document's headings: lower case, punctuation dropped,
    spaces to hyphens; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    """Every relative link names a file that exists, and a #anchor into a markdown file names one of its headings
    (a figure is linked to where it stands, not copied)."""
    broken = []
    for m in LINK_PATTERN.finditer(doc.read_text()):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # a URL
        path, _, anchor = target.partition("#")
        file = (doc.parent / path) if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc.relative_to(ROOT)} links to missing files or headings: {broken}"


def test_anchor_rule(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Benchmark: specdec\n## The per-step overhead (the target not met)\n```\n# not a heading\n```\n"
                   "## Current results\n## Current results\n")
    assert _anchors(doc) == {"benchmark-specdec", "the-per-step-overhead-the-target-not-met", "current-results",
                             "current-results-1"}


# A measured figure: a ratio (1.24x, 0.82×), a rate (38 tokens/s), a time (27 ms) or a share (4.5 %).
FIGURE_PATTERN = re.compile(r"\d(?:\.\d+)?\s?(?:×|x\b|%|ms\b|tokens/s|tok/s)")


def test_readme_links_to_the_figures_instead_of_repeating_them():
    """Each figure lives in one place (docs/benchmark.md or the results it is made from); the README links there."""
    found = [f"{n}: {line.strip()[:100]}" for n, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
             if FIGURE_PATTERN.search(line)]
    assert not found, f"README.md repeats measured figures (link to docs/benchmark.md instead): {found}"


def test_bench_writes_one_result_set_per_mode():
    from bench.runner import RESULTS_DIR, parse_args

    assert pathlib.Path(parse_args(["--quick"]).out_dir) == RESULTS_DIR / "quick"
    assert pathlib.Path(parse_args([]).out_dir) == RESULTS_DIR / "full"
    assert parse_args(["--out-dir", "/tmp/x"]).out_dir == "/tmp/x"
    for mode in ("quick", "full"):
        assert (RESULTS_DIR / mode / "latest.json").is_file()
        assert (RESULTS_DIR / mode / "latest.md").is_file()
