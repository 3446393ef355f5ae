"""Docs check: the README and docs/ stay true to the repository. Fast (no services, no model load):

(a) README.md is a front page: at most 12,500 bytes, with a table of contents whose links resolve
    to its headings and that lists every `##` section;
(b) every relative link (and `#anchor`) in README.md, CHANGELOG.md, flows/README.md and docs/*.md
    points to an existing file (and heading);
(c) every `make X` in their code (fenced blocks and inline spans) names a Makefile target;
(d) every `tidespec ...` command line in a fenced shell block parses against the CLI: its subcommand
    path resolves in the typer app and its options and arguments are accepted
    (`click.Command.make_context`; placeholders such as `<DIR>` are substituted); inline
    `tidespec ...` spans must name real subcommands and options;
(e) the README's quick start shows exactly the two set-up commands, `make demo` and `make test`
    (the one CI runs);
(f) every documented `tidespec serve` line passes the command's own checks as typed
    (`cli.serve_preflight`), against the shipped params.yaml, in the repository root, with only the
    environment the line itself sets: a shipped default must never make a documented command fail;
(g) CHANGELOG.md, docs/ and bench/results/ speak of the product (dates, versions, hardware), never of
    how its development was organised (work sessions, borrowed machines, their time limits).
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from tidespec.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", ROOT / "flows" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
README_MAX_BYTES = 12_500

FENCE = re.compile(r"^(`{3,}|~{3,})[ \t]*([\w+-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
MAKE = re.compile(r"(?:^|[\s;&|(\"'])make\s+([A-Za-z][\w.-]*)")
TIDESPEC = re.compile(r"(?:^|(?<=[\s;&|(\"'`])|(?<=/bin/))tidespec(?=[ \t]+\S)")
PLACEHOLDER = re.compile(r"<[^<>\s]+>")


def page_id(p: Path) -> str:
    return str(p.relative_to(ROOT))


def fences(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced code block."""
    return [(m.group(2).lower(), m.group(3)) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces → '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown page (duplicates get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(prose(text)):
        s = slug(m.group(2))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(text: str) -> list[str]:
    """Link targets outside code (fenced blocks and inline code spans)."""
    return [m.group(1) for m in LINK.finditer(INLINE_CODE.sub("", prose(text)))]


def inline_code(text: str) -> list[str]:
    return [m.group(2).strip() for m in INLINE_CODE.finditer(prose(text))]


def strip_comment(line: str) -> str:
    """A shell line without its trailing `# comment` (a `#` that starts a word, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def code_lines(text: str, langs=SHELL_LANGS) -> list[str]:
    """Command lines of the fenced blocks in `langs`: backslash continuations joined, comments dropped."""
    out = []
    for lang, body in fences(text):
        if lang in langs:
            out += [strip_comment(line) for line in body.replace("\\\n", " ").splitlines()]
    return out


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    targets = set()
    for m in re.finditer(r"^([A-Za-z0-9_.\-][A-Za-z0-9_.\- \t]*?)[ \t]*::?(?!=)", text, re.M):
        targets.update(t for t in m.group(1).split() if not t.startswith("."))
    return targets


def cli_root():
    """The click command typer builds for `tidespec` (typer may vendor click: duck-typed below)."""
    return typer.main.get_command(app)


def is_group(cmd) -> bool:
    return isinstance(getattr(cmd, "commands", None), dict)


def tidespec_invocations(line: str) -> list[list[str]]:
    """The argument lists after each `tidespec` (or `.venv/bin/tidespec`) on a shell line, up to the
    end of that command (`;`, `&&`, `|`, `)`, a comment). Placeholders `<X>` become `X`."""
    line = PLACEHOLDER.sub("X", line)
    out = []
    for m in TIDESPEC.finditer(line):
        lex = shlex.shlex(line[m.end():], posix=True, punctuation_chars=";&|()")
        lex.whitespace_split = True
        lex.commenters = "#"
        args = []
        for tok in lex:
            if tok and set(tok) <= set(";&|()"):
                break
            args.append(tok)
        out.append(args)
    return out


def script_parser(path: list[str]):
    """The argparse parser of a `tidespec bench` experiment script (`bench.scripts.SCRIPTS`), or None."""
    import importlib

    from tidespec.bench.scripts import SCRIPTS
    if path[:2] != ["tidespec", "bench"] or len(path) != 3 or path[2] not in SCRIPTS:
        return None
    return importlib.import_module(f"tidespec.bench.{SCRIPTS[path[2]][0]}").parser()


def check_script_args(ap, args: list[str], where: str) -> str | None:
    """None when an experiment script's parser accepts `args` (as typed), else its error."""
    import contextlib
    import io
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ap.parse_args(args)
    except SystemExit as e:
        return None if e.code == 0 else f"`{where} {' '.join(args)}`: {err.getvalue().strip().splitlines()[-1]}"
    return None


def check_command_line(args: list[str]) -> str | None:
    """None when `tidespec <args>` parses, else why not."""
    cmd, path = cli_root(), ["tidespec"]
    while is_group(cmd):
        if not args or args[0].startswith("-"):
            return None if "--help" in args else f"`{' '.join(path)}` is a group: name a subcommand"
        sub = cmd.commands.get(args[0])
        if sub is None:
            return f"`{' '.join(path)}` has no subcommand {args[0]!r} (has: {', '.join(sorted(cmd.commands))})"
        cmd, path, args = sub, path + [args[0]], args[1:]
    if (ap := script_parser(path)) is not None:
        return check_script_args(ap, args, " ".join(path))
    try:
        cmd.make_context(" ".join(path), list(args), resilient_parsing=False)
    except typer.Exit:  # --help
        return None
    except Exception as e:  # click's UsageError / BadParameter (typer's click may be vendored)
        if not hasattr(e, "format_message"):
            raise
        return f"`{' '.join(path)} {' '.join(args)}`: {e.format_message()}"
    return None


def check_inline_span(span: str) -> str | None:
    """An inline `tidespec a b --opt ...`: the words name real subcommands, `--opt`s exist."""
    words = span.split()[1:]
    cmd, path = cli_root(), ["tidespec"]
    while is_group(cmd) and words and re.fullmatch(r"[a-z][a-z0-9-]*", words[0]):
        sub = cmd.commands.get(words[0])
        if sub is None:
            return f"`{span}`: `{' '.join(path)}` has no subcommand {words[0]!r}"
        cmd, path, words = sub, path + [words[0]], words[1:]
    if is_group(cmd):
        return None
    known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    if (ap := script_parser(path)) is not None:
        known = {o for a in ap._actions for o in a.option_strings}
    for w in words:
        opt = w.strip("[]()").split("=", 1)[0]
        if opt.startswith("--") and opt not in known:
            return f"`{span}`: `{' '.join(path)}` has no option {opt}"
    return None


# -- (a) the README is a front page with a table of contents ---------------------------------------
def test_readme_is_small_and_has_a_table_of_contents():
    data = README.read_bytes()
    assert len(data) <= README_MAX_BYTES, (
        f"README.md is {len(data)} bytes (limit {README_MAX_BYTES}): move reference to docs/"
    )
    text = data.decode()
    body = prose(text)
    toc = re.search(r"^##[ \t]+(?:Contents|Table of contents)[ \t]*\n(.*?)(?=^#)", body, re.M | re.S | re.I)
    assert toc, "README.md has no '## Contents' section"
    entries = re.findall(r"^[ \t]*[-*][ \t]+\[[^\]]+\]\(#([^)]+)\)", toc.group(1), re.M)
    assert len(entries) >= 4, f"the table of contents lists {len(entries)} entries"
    heads = anchors(text)
    assert not [e for e in entries if e not in heads], \
        f"table-of-contents links without a heading: {[e for e in entries if e not in heads]}"
    sections = [slug(h) for h in re.findall(r"^##[ \t]+(.+?)[ \t]*$", body, re.M)]
    missing = [s for s in sections if s not in entries and s not in ("contents", "table-of-contents")]
    assert not missing, f"README sections missing from the table of contents: {missing}"


# -- (b) relative links ------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve(page: Path):
    assert page.exists(), page
    bad = []
    for target in links(page.read_text()):
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page_id(page)}: broken links: {bad}"


# -- (c) make targets ---------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_make_targets_exist(page: Path):
    text = page.read_text()
    targets = makefile_targets()
    mentioned = {t for line in code_lines(text) + inline_code(text) for t in MAKE.findall(line)}
    assert not mentioned - targets, f"{page_id(page)}: no Makefile target {sorted(mentioned - targets)}"


# -- (d) tidespec command lines ---------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_tidespec_commands_parse(page: Path):
    text = page.read_text()
    bad = [f"{line.strip()!r}: {why}" for line in code_lines(text)
           for args in tidespec_invocations(line) if (why := check_command_line(args))]
    bad += [why for span in inline_code(text) if span.startswith("tidespec ") and (why := check_inline_span(span))]
    assert not bad, f"{page_id(page)}:\n" + "\n".join(bad)


def test_the_docs_show_commands_at_all():
    """Guards the checks above against a parser that finds nothing."""
    found = [a for p in PAGES for line in code_lines(p.read_text()) for a in tidespec_invocations(line)]
    assert len(found) >= 20, found
    assert {"make", "demo"} <= set(makefile_targets()) | {"make"}


# -- (e) the two set-up commands ------------------------------------------------------------------------
def test_readme_quick_start_is_make_demo_and_make_test():
    text = README.read_text()
    m = re.search(r"^##[ \t]+Quick start[ \t]*\n(.*?)(?=^##[ \t])", text, re.M | re.S)
    assert m, "README.md has no '## Quick start' section"
    commands = []
    for lang, body in fences(m.group(1)):
        if lang in SHELL_LANGS:
            commands += [c for line in body.splitlines() if (c := strip_comment(line).strip())]
    assert commands == ["make demo", "make test"], f"README quick start shows {commands}"
    assert re.search(r"^\s*make test\s*$", (ROOT / ".ci" / "run").read_text(), re.M), \
        "CI (.ci/run) no longer runs the README's `make test`"


# -- the checker itself ---------------------------------------------------------------------------------
def test_the_command_checker_catches_mistakes():
    assert check_command_line(["serve", "--port", "8000"]) is None
    assert check_command_line(["deploy", "sagemaker", "--profile", "gpu", "--dry-run"]) is None
    assert "No such option: --prot" in check_command_line(["serve", "--prot", "8000"])
    assert "no subcommand" in check_command_line(["bench", "engin"])
    assert check_command_line(["bench", "inprocess-ab", "--out", "x", "--passes", "2", "--breakdown"]) is None
    assert "unrecognized arguments: --bogus" in check_command_line(["bench", "inprocess-ab", "--out", "x", "--bogus"])
    assert "required: --out" in check_command_line(["bench", "inprocess-ab", "--passes", "2"])
    assert "no option --bogus" in check_inline_span("tidespec bench static-baseline --bogus")
    assert "Missing option" in check_command_line(["promote", "3"])
    assert tidespec_invocations('eval "$(tidespec services up)"') == [["services", "up"]]
    assert tidespec_invocations(".venv/bin/tidespec snapshots pull <SID>") == [["snapshots", "pull", "X"]]
    assert (
        strip_comment("tidespec serve --port 8000   # 'tidespec bench' in a comment") == "tidespec serve --port 8000   "
    )
    assert tidespec_invocations("ls src/tidespec/ && tidespec-draft x") == []
    assert check_inline_span("tidespec serve --backend sglang --sglang-url URL") is None
    assert "no option" in check_inline_span("tidespec serve --sglang URL")
    assert (
        slug("Goodput policy: adaptive k, proposer and off-switch")
        == "goodput-policy-adaptive-k-proposer-and-off-switch"
    )
    assert slug("Every load: concurrency 1/4/8/16") == "every-load-concurrency-14816"


# -- (f) documented serve commands pass their own checks, as typed ------------------------------------
ASSIGN = re.compile(r"^([A-Z_][A-Z0-9_]*)=(\S*)\s+")


def split_env(line: str) -> tuple[dict[str, str], str]:
    """A shell line's leading `VAR=value` assignments (the command's environment) and the rest."""
    env, line = {}, line.strip()
    while m := ASSIGN.match(line):
        env[m.group(1)] = m.group(2)
        line = line[m.end():]
    return env, line


def serve_lines() -> list[tuple[str, str]]:
    """(page, line) of every documented shell line that runs `tidespec serve`."""
    return [(page_id(p), line.strip()) for p in PAGES if p.name != "CHANGELOG.md" for line in code_lines(p.read_text())
            if any(args[:1] == ["serve"] for args in tidespec_invocations(line))]


@pytest.mark.parametrize("page,line", serve_lines(), ids=[f"{p}:{line[:60]}" for p, line in serve_lines()])
def test_documented_serve_commands_pass_their_checks_as_typed(page, line, monkeypatch):
    import inspect

    from tidespec.cli.serve import serve_preflight
    env, rest = split_env(line)
    (args,) = tidespec_invocations(rest)
    cmd = cli_root().commands["serve"]
    ctx = cmd.make_context("tidespec serve", list(args[1:]), resilient_parsing=False)
    monkeypatch.chdir(ROOT)  # --root and --params default to the checkout and its params.yaml
    # the commands' own checks, not this machine's: an SGLang environment exists on GPU machines only
    monkeypatch.setattr("tidespec.cli.serve._engine_runs_here", lambda launch: None)
    names = set(inspect.signature(serve_preflight).parameters) - {"env"}
    serve_preflight(**{k: v for k, v in ctx.params.items() if k in names}, env=env)


def test_the_documented_serve_commands_are_found():
    lines = [line for _, line in serve_lines()]
    assert len(lines) >= 3 and any("--backend vllm" in x for x in lines) and any("--backend sglang" in x for x in lines)
    assert split_env("TIDESPEC_ADMIN_TOKEN=change-me tidespec serve --port 8000") == (
        {"TIDESPEC_ADMIN_TOKEN": "change-me"}, "tidespec serve --port 8000")


ORGANISATION = re.compile(r"\bstops? \d+\b|\(stop\b|\b(lent|lends)\b|device time|this session|the machine's 15 minutes",
                          re.I)


def test_the_product_docs_speak_of_the_product():
    pages = [ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "bench" / "results").rglob("*.md"))]
    hits = [f"{p.relative_to(ROOT)}:{i}: {m.group(0)}" for p in pages
            for i, line in enumerate(p.read_text().splitlines(), 1) if (m := ORGANISATION.search(line))]
    assert not hits, hits
    assert ORGANISATION.search("## 2026-12-05 (stop 53)") and ORGANISATION.search("one GPU was lent")
