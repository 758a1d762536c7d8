"""The ``hf-janus`` command line: ``demo`` (and further subcommands registered in :func:`build_parser`)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from . import __version__


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="fine-tune a tiny model, show forgetting, repair it with JANUS (CPU, about a minute)",
        description="Pretrain a tiny Llama on NQ-open QA pairs, fine-tune it on GSM8K, then rectify it with JANUS "
                    "and print the past-task and new-task losses before and after. Needs no network.",
    )
    p.add_argument("--quick", action="store_true", help="a smaller, faster run (for smoke tests)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--tau", type=float, default=0.95, help="acceptance threshold τ (default: 0.95)")
    p.add_argument("--rank", type=int, default=32, help="sequence compression rank r (default: 32)")
    p.add_argument("--report", metavar="PATH", help="also write the rectification report as JSON to PATH")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from .config import JanusConfig
    from .demo import run_demo

    config = JanusConfig(tau=args.tau, rank=args.rank, replay_batch_size=48, seed=args.seed)
    result = run_demo(seed=args.seed, quick=args.quick, progress=not args.no_progress, config=config)
    print(result.markdown())
    print()
    print(result.report.summary())
    print(f"\ndemo finished in {result.seconds:.1f}s")
    if args.report:
        result.report.save(args.report)
        print(f"report written to {args.report}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-janus",
        description="JANUS: repair catastrophic forgetting after fine-tuning by projecting the weight update onto "
                    "the null space of the past task's per-sample Jacobian.",
    )
    parser.add_argument("--version", action="version", version=f"hf-janus {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details (per-trial cosines, timings)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


_SUBCOMMANDS = [_add_demo]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"hf-janus {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
