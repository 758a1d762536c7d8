"""The command line shared by the scripts that generate docs pages from the code: write the page, or with
``--check`` exit 1 and show the difference when the committed page no longer matches what the code generates."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]


def main(render: Callable[[], str], page: Path, script: str, source: str, description: str,
         argv: Optional[Any] = None) -> int:
    """Run a generator: ``render()`` makes the page's text from ``source`` (what the page documents)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--check", action="store_true", help=f"do not write; exit 1 if the page differs from {source}")
    ap.add_argument("--output", type=Path, default=page, help=f"the page (default: {page.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.is_file() else ""
        if current != text:
            diff = difflib.unified_diff(current.splitlines(), text.splitlines(), str(args.output), "generated",
                                        lineterm="", n=0)
            print(f"{args.output} is stale: it no longer matches {source}. Run `python {script}` and commit the "
                  "result.\n" + "\n".join(list(diff)[:40]), file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0
