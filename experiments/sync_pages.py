"""Copy each table's committed result into its page: the command, machine and date lines and the section "## The
table", from experiments/results/<table>/<table>.md as the table's script wrote it. A page's own prose (what it
measures, how to run it, the reading) is left as it is; the reading is the one part a person writes after a rerun.

    python experiments/sync_pages.py          # rewrite the pages that differ from their results
    python experiments/sync_pages.py --check  # list them and exit 1 (tests/test_pages.py runs this)

A page takes part when it has the "- **Command** (as the result file records it):" line; pages that describe a
longer recipe than the table's one command (eagle3_vs_prophet) keep their own header."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parent
PAGES, RESULTS = EXPERIMENTS / "pages", EXPERIMENTS / "results"
COMMAND = "- **Command** (as the result file records it): "


def parse_result(text: str) -> tuple[str, str, str, str]:
    """A table's result file (title, blank, "`command` · date · machine", blank, body) -> (command, date, machine,
    body)."""
    lines = text.splitlines()
    m = re.fullmatch(r"`(.+)` · (\d{4}-\d{2}-\d{2}) · (.+)", lines[2])
    if m is None:
        raise ValueError(f"line 3 is not '`command` · date · machine': {lines[2]!r}")
    return m[1], m[2], m[3], "\n".join(lines[4:]).strip("\n")


def page_body(name: str, body: str) -> str:
    """The result's body as the page shows it: links relative to the result's folder made relative to pages/."""
    def moved(m: re.Match) -> str:
        target, anchor = m[1].partition("#")[::2]
        path = os.path.relpath(os.path.normpath(RESULTS / name / target), PAGES)
        return f"]({path}{'#' + anchor if anchor else ''})"
    return re.sub(r"\]\((?!https?:|#)([^)\s]+)\)", moved, body)


def synced(name: str, page: str, result: str) -> str:
    """The page with its header lines and its table section taken from the result."""
    command, date, machine, body = parse_result(result)
    page = re.sub(r"^- \*\*Command\*\* \(as the result file records it\): .*$", lambda _: f"{COMMAND}`{command}`",
                  page, count=1, flags=re.M)
    page = re.sub(r"^- \*\*Machine\*\*: .*$", lambda _: f"- **Machine**: {machine}", page, count=1, flags=re.M)
    page = re.sub(r"^- \*\*Date\*\*: .*$", lambda _: f"- **Date**: {date}", page, count=1, flags=re.M)
    link = f"From [results/{name}/{name}.md](../results/{name}/{name}.md):"
    section = f"## The table\n\n{link}\n\n{page_body(name, body)}\n\n"
    # the section runs to the next heading (or the end of the page)
    return re.sub(r"^## The table\n.*?(?=^## |\Z)", lambda _: section, page, count=1, flags=re.M | re.S)


def table_pages() -> list[tuple[str, Path, Path]]:
    """(table, page, result) for every page that records its result's command."""
    out = []
    for page in sorted(PAGES.glob("*.md")):
        result = RESULTS / page.stem / f"{page.stem}.md"
        if COMMAND in page.read_text() and result.exists():
            out.append((page.stem, page, result))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only list the pages out of date; exit 1 if any")
    args = ap.parse_args(argv)
    stale = []
    for name, page, result in table_pages():
        old = page.read_text()
        new = synced(name, old, result.read_text())
        if new != old:
            stale.append(name)
            if not args.check:
                page.write_text(new)
    verb = "out of date" if args.check else "rewritten"
    print(f"pages {verb}: {', '.join(stale)}" if stale else "every table page matches its result")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
