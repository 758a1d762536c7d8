"""Write docs/reference/cli.md from the ``hf-janus`` argument parser (``hf_janus.cli.build_parser()``).

The page lists what ``hf-janus --help`` and ``hf-janus <command> --help`` print, as tables built from the parser's
actions (not from argparse's formatted help, whose layout depends on the terminal width and the Python version).
The JANUS and replay options come from the fields' ``metadata["help"]``, like docs/reference/configuration.md.

    python docs/generate_cli_reference.py            # rewrite docs/reference/cli.md
    python docs/generate_cli_reference.py --check    # exit 1, saying so, when the page is stale
                                                     # (tests/cli/test_docs.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # generated_page.py, beside this script
import generated_page  # noqa: E402
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "cli.md"
SCRIPT = "docs/generate_cli_reference.py"


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _help(action: argparse.Action, prog: str) -> str:
    """The help text as argparse prints it (``%(default)s``, ``%%`` expanded), as HelpFormatter._expand_help."""
    if not action.help:
        return ""
    params = dict(vars(action), prog=prog)
    for name in list(params):
        if params[name] is argparse.SUPPRESS:
            del params[name]
        elif hasattr(params[name], "__name__"):
            params[name] = params[name].__name__
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    try:
        return action.help % params
    except (TypeError, ValueError, KeyError) as err:
        raise SystemExit(f"the help of {'/'.join(action.option_strings) or action.dest} ({prog}) cannot be formatted "
                         f"({type(err).__name__}: {err}): `{prog} --help` fails the same way. A literal % in an "
                         "argparse help string must be written %% (add_dataclass_options should escape the fields' "
                         "metadata['help'])") from err


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return " \\| ".join(f"`{c}`" for c in action.choices)
    if action.metavar is not None:
        name = str(action.metavar)
    elif action.type in (int, float):
        name = action.type.__name__.upper()
    else:
        name = "VALUE"
    if action.nargs in ("+", "*"):
        name = f"{name} [{name} ...]"
    return f"`{name}`"


def _default(action: argparse.Action) -> str:
    default = action.default
    if action.nargs == 0 or default is None or default is argparse.SUPPRESS or action.required:
        return ""
    if isinstance(default, (list, tuple)):
        return "`" + (",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in default) or "''") + "`"
    return f"`{default}`"


def _notes(action: argparse.Action, exclusive: dict[int, list[str]]) -> str:
    notes = []
    if action.required:
        notes.append("**required**")
    if isinstance(action, argparse._AppendAction):
        notes.append("repeatable")
    others = exclusive.get(id(action))
    if others:
        notes.append("not with " + ", ".join(f"`{o}`" for o in others))
    return "; ".join(notes)


def _options_tables(parser: argparse.ArgumentParser) -> list[str]:
    exclusive: dict[int, list[str]] = {}
    for group in parser._mutually_exclusive_groups:
        for action in group._group_actions:
            exclusive[id(action)] = [a.option_strings[-1] for a in group._group_actions if a is not action]
    lines = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help is not argparse.SUPPRESS and not isinstance(a, (argparse._HelpAction,
                                                                            argparse._SubParsersAction))]
        if not actions:
            continue
        title = "options" if group.title in ("options", "optional arguments") else group.title
        lines += [f"**{title}**", "", "| option | value | default | notes | description |", "|---|---|---|---|---|"]
        for a in actions:
            names = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}`"
            lines.append(f"| {names} | {_value(a)} | {_default(a)} | {_notes(a, exclusive)} | "
                         f"{_cell(_help(a, parser.prog))} |")
        lines.append("")
    return lines


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from hf_janus.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {a.dest: a.help for a in sub._choices_actions}
    lines = [
        "# Command-line reference",
        "",
        f"<!-- Generated by {SCRIPT} from hf_janus.cli.build_parser(); do not edit by hand.",
        f"     Change the parser and run `python {SCRIPT}`; tests/cli/test_docs.py fails when this page is stale. -->",
        "",
        f"`{parser.prog} COMMAND [options]`: {parser.description} `{parser.prog} --help` and "
        f"`{parser.prog} COMMAND --help` list the same options. The JANUS options of `merge` and `frontier` "
        "are the fields of `JanusConfig` and their replay options those of `ReplayOptions` "
        "([configuration reference](configuration.md)). Errors exit with status 2 and a message naming the fix.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for name in sub.choices:
        lines.append(f"| [`{parser.prog} {name}`](#{parser.prog}-{name}) | {_cell(summaries.get(name, ''))} |")
    lines += ["", *_options_tables(parser)]
    for name, p in sub.choices.items():
        lines += [f"## {parser.prog} {name}", "", _cell(p.description or summaries.get(name, "")), ""]
        lines += _options_tables(p)
        if p.epilog:
            lines += ["```text", p.epilog.rstrip("\n"), "```", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Any = None) -> int:
    return generated_page.main(render, PAGE, SCRIPT, "hf-janus's parser", __doc__.split("\n")[0], argv)


if __name__ == "__main__":
    sys.exit(main())
