"""The ``hf-janus`` command line: ``demo`` and ``merge``; ``merge``'s JANUS and replay options come from the
``JanusConfig`` and ``ReplayOptions`` fields."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any, Optional, Sequence

from hf_janus.cli_options import (ADVANCED, ADVANCED_JANUS_TITLE, ALLOW_PICKLE_HELP, CONFIG_PREFIX, INTERNALS_TITLE,
                                  REPLAY_HELP, REPLAY_PREFIX, add_dataclass_options, add_evaluation_options,
                                  add_self_replay_options, dataclass_values, evaluation_settings, replay_argument,
                                  replay_input)
from hf_janus.engine.config import STEP_CONTROLS, JanusConfig
from hf_janus.replay.sources import ReplayOptions
from hf_janus.version import __version__


#: A budget well above what the demo's two rectifications take on the CPUs it was run on (the quick start gives the
#: distribution), so that it ends in minutes even where rounding makes the loop longer.
DEMO_MAX_EVALUATIONS = 80


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="fine-tune a tiny model, show forgetting, repair it with JANUS (CPU, a minute or two)",
        description="Pretrain a tiny Llama on NQ-open QA pairs, fine-tune it on GSM8K, then rectify it with JANUS "
                    "and print the past-task and new-task losses before and after. Then the same with a LoRA "
                    "adapter, rectified from disk with JanusMerger and saved as an adapter again. Needs no network.",
    )
    p.add_argument("--quick", action="store_true", help="a smaller, faster run (for smoke tests)")
    p.add_argument("--no-lora", action="store_true", help="skip the LoRA adapter part of the story")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--tau", type=float, default=0.95, help="acceptance threshold τ (default: 0.95)")
    p.add_argument("--compression-rank", type=int, default=32,
                   help="rank r of JANUS's sequence compression (default: 32)")
    p.add_argument("--step-control", choices=STEP_CONTROLS, default="adaptive",
                   help="step-size controller (default: adaptive; paper = Algorithm 1)")
    p.add_argument("--max-evaluations", type=int, default=DEMO_MAX_EVALUATIONS,
                   help="Jacobian-evaluation budget of each of the two rectifications, so that the demo ends in "
                        f"minutes on any machine (default: {DEMO_MAX_EVALUATIONS}; 0 = none)")
    p.add_argument("--require-converged", action="store_true",
                   help="exit with status 1 unless every rectification converged (for CI)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default: 1; the demo's model is so small that more threads cost more in "
                        "synchronization than they save)")
    p.add_argument("--report", metavar="PATH", help="also write the rectification report as JSON to PATH")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from hf_janus.demo import run_cli

    return run_cli(args)


_MERGE_EPILOG = """\
examples:
  hf-janus merge --base meta-llama/Llama-3.2-1B --adapter me/llama-math-lora \\
      --replay me/past-task-qa:train --prompt-field question --response-field answer \\
      --output ./rectified --format adapter --adapter-rank same --refine
  hf-janus merge --base ./base --adapter ./adapter --replay past.jsonl --text-field text \\
      --output ./rectified-full --format full --overwrite --push-to-hub me/rectified

Only the layers the adapter changes are rectified (--target-modules/--exclude-modules can narrow them).
The output directory is written atomically and also holds janus_rectification.json, the report.
"""


def _add_merge(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "merge",
        help="rectify a PEFT adapter (Hub or disk) against forgetting and save it as an adapter or full model",
        description="Load a base model and a PEFT adapter (LoRA, rsLoRA, DoRA, PiSSA, LoHa, ... anything PEFT can "
                    "merge), rectify the adapter's weight update with JANUS against forgetting of the task in "
                    "--replay, and save the result as a standard LoRA adapter (per-layer truncated SVD) or as full "
                    "weights.",
        epilog=_MERGE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # what most runs set comes first (at most 20 options); the rest in the "advanced" groups after it
    inputs = p.add_argument_group("inputs")
    replay = p.add_argument_group("replay (samples of the past task to protect)")
    janus, output = p.add_argument_group("JANUS"), p.add_argument_group("output")
    advanced = p.add_argument_group(f"{ADVANCED}: inputs, replay and output")
    _add_merge_inputs(inputs, advanced)
    _add_replay(replay, advanced, new_task_help="what the adapter was trained on, read as --replay is, for the repair "
                "after JANUS (--distill-steps): it fits them and keeps --keep-gain of their gain; without them the "
                "repair is skipped and the JANUS point kept")
    advanced.add_argument("--new-task-validation", metavar="DATASET[:SPLIT]",
                          help="with --new-task-samples: samples of the new task it never trained on (as a Trainer's "
                               "eval_dataset), read as --replay is, to measure the gain the repair keeps on; without "
                               "them every eighth of --new-task-samples is held out")
    janus.add_argument("--config", metavar="JSON", help="a JanusConfig JSON file; the options given override it")
    add_dataclass_options(janus, JanusConfig, CONFIG_PREFIX, tier="main")
    _add_merge_output(output, advanced)
    advanced.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_dataclass_options(p.add_argument_group(ADVANCED_JANUS_TITLE), JanusConfig, CONFIG_PREFIX, tier=ADVANCED)
    add_dataclass_options(p.add_argument_group(INTERNALS_TITLE), JanusConfig, CONFIG_PREFIX, tier="internal")
    p.set_defaults(func=_run_merge)


def _add_replay(replay: argparse._ArgumentGroup, advanced: argparse._ArgumentGroup, new_task_help: str) -> None:
    """The past task's replay (``--replay``, self-replay, how it is read) and the new task's samples."""
    replay.add_argument("--replay", metavar="DATASET[:SPLIT]", help=REPLAY_HELP)
    add_self_replay_options(replay, advanced)
    add_dataclass_options(replay, ReplayOptions, REPLAY_PREFIX, tier="main")
    add_dataclass_options(advanced, ReplayOptions, REPLAY_PREFIX, tier=ADVANCED)
    replay.add_argument("--new-task-samples", metavar="DATASET[:SPLIT]", help=new_task_help)


def _add_merge_inputs(src: argparse._ArgumentGroup, advanced: argparse._ArgumentGroup) -> None:
    """``merge``'s base model and adapter, and how they are loaded."""
    src.add_argument("--base", required=True, metavar="ID_OR_DIR", help="base model: Hub repo id or local directory")
    src.add_argument("--adapter", required=True, metavar="ID_OR_DIR",
                     help="PEFT adapter: Hub repo id or local directory")
    src.add_argument("--device", default=None,
                     help="device for the model and the Jacobians, e.g. cuda:0 (default: cuda when there is a GPU, "
                          "else cpu)")
    src.add_argument("--load-in-4bit", action="store_true",
                     help="load the base in 4 bits with bitsandbytes (nf4, double quantization, computing in --dtype "
                          "or float32), to rectify a QLoRA adapter against the base it was trained on; --format "
                          "adapter only. For other settings use JanusMerger(quantization_config=...)")
    advanced.add_argument("--load-in-8bit", action="store_true",
                          help="load the base in 8 bits with bitsandbytes (LLM.int8); --format adapter only")
    advanced.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                          help="dtype to load the base model in (default: the checkpoint's; the update is rectified "
                               "in float32 whatever it is, only --format full rounds to it)")
    advanced.add_argument("--revision", help="revision (branch, tag, commit) of the adapter repo")
    advanced.add_argument("--base-revision", help="revision of the base model repo")
    advanced.add_argument("--initial-adapter", metavar="ID_OR_DIR",
                          help="for an unconverted PiSSA-like adapter with a randomized or data-dependent init "
                               "(pissa_niter_k, olora, corda, lora_ga, loftq): the adapter saved right after "
                               "initialization")
    advanced.add_argument("--allow-base-mismatch", action="store_true",
                          help="warn instead of failing when the adapter names a different base model (shapes are "
                               "still checked)")
    advanced.add_argument("--allow-pickle", action="store_true", help=ALLOW_PICKLE_HELP)


def _add_merge_output(out: argparse._ArgumentGroup, advanced: argparse._ArgumentGroup) -> None:
    """Where and in what form ``merge`` writes the rectified model."""
    out.add_argument("--output", required=True, metavar="DIR", help="output directory (written atomically)")
    out.add_argument("--format", dest="output_format", default="adapter", choices=["adapter", "full"],
                     help="adapter: a standard LoRA adapter re-factorized by truncated SVD (default); full: base + "
                          "rectified update with save_pretrained, sharded like the base")
    out.add_argument("--adapter-rank", default="same", metavar="same|auto|INT|FLOAT",
                     help="LoRA rank for --format adapter: same (each layer's rank in the input adapter, default), "
                          "auto (smallest rank keeping --adapter-energy of each layer's update), an int, or a float "
                          "in (0, 1] as an energy threshold")
    out.add_argument("--overwrite", action="store_true", help="replace an existing non-empty output directory")
    out.add_argument("--push-to-hub", metavar="REPO", help="also upload the output directory to this Hub repo")
    advanced.add_argument("--adapter-energy", type=float, default=0.99,
                          help="energy kept by --adapter-rank auto (default: 0.99)")
    advanced.add_argument("--refine", action="store_true",
                          help="alternate between the rank-k set and the Jacobian null space so that truncation "
                               "gives back less of the repair")
    advanced.add_argument("--refine-iterations", type=int, default=5, help="iterations of --refine (default: 5)")
    advanced.add_argument("--private", action="store_true", help="create the --push-to-hub repo as private")


def merge_config(args: argparse.Namespace) -> JanusConfig:
    """The ``JanusConfig`` of ``hf-janus merge``: ``--config`` (or the defaults) overridden by the options given."""
    base = JanusConfig.load(args.config) if args.config else JanusConfig()
    return dataclasses.replace(base, **dataclass_values(args, JanusConfig, CONFIG_PREFIX))


def replay_options(args: argparse.Namespace) -> ReplayOptions:
    """The ``ReplayOptions`` of ``hf-janus merge``; naming columns without ``--replay-format`` picks the format."""
    given = dataclass_values(args, ReplayOptions, REPLAY_PREFIX)
    if "format" not in given:  # naming the columns says how to read them
        if "prompt_field" in given or "response_field" in given:
            given["format"] = "prompt-response"
        elif "text_field" in given:
            given["format"] = "text"
    return ReplayOptions(**given)


def _run_merge(args: argparse.Namespace) -> int:
    from hf_janus.adapters.saved.merger import JanusMerger
    from hf_janus.adapters.low_rank import parse_rank_spec, validate_rank_spec
    from hf_janus.io_utils import check_output_dir
    from hf_janus.publish.hub import push_folder

    if args.load_in_4bit and args.load_in_8bit:
        raise ValueError("--load-in-4bit and --load-in-8bit exclude each other: give one")
    if (args.load_in_4bit or args.load_in_8bit) and args.output_format != "adapter":
        raise ValueError("--load-in-4bit/--load-in-8bit rectify against a quantized base, which gives an adapter "
                         "only: use --format adapter, or drop the flag to get full weights from the "
                         "full-precision base")
    rank = parse_rank_spec(args.adapter_rank) if args.output_format == "adapter" else "same"
    validate_rank_spec(rank, args.adapter_energy)
    if args.refine_iterations < 0:
        raise ValueError(f"--refine-iterations must be >= 0, got {args.refine_iterations}")
    options = replay_options(args)
    replay = replay_argument(args, options)
    # Fail before the expensive part, and never over an input: a replay given as a file, the base or the adapter.
    output = check_output_dir(args.output, args.overwrite, {"base model": args.base, "adapter": args.adapter,
                                                            "replay data": replay_input(args),
                                                            "new-task samples": args.new_task_samples,
                                                            "new-task validation": args.new_task_validation})
    merger = JanusMerger(
        args.base, args.adapter, replay, merge_config(args), revision=args.revision, torch_dtype=args.dtype,
        device=args.device, base_revision=args.base_revision, initial_adapter=args.initial_adapter,
        allow_base_mismatch=args.allow_base_mismatch, replay_options=options,
        progress=not args.no_progress, quantization_config=_quantization_config(args),
        allow_pickle=args.allow_pickle, new_task_samples=args.new_task_samples,
        new_task_validation=args.new_task_validation,
    )
    delta = merger.run()
    if args.output_format == "adapter":
        delta.save_adapter(output, adapter_rank=rank, adapter_energy=args.adapter_energy, refine=args.refine,
                           refine_iterations=args.refine_iterations, overwrite=args.overwrite,
                           progress=not args.no_progress)
    else:
        delta.save_full(output, overwrite=args.overwrite)
    print(delta.report.summary())
    print(f"\nrectified {args.output_format} written to {output}")
    if args.push_to_hub:
        url = push_folder(output, args.push_to_hub, private=args.private or None,
                          commit_message=f"JANUS-rectified {args.output_format} of {args.adapter}")
        print(f"pushed to {args.push_to_hub}: {url}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-janus`` parser with every subcommand (``docs/generate_cli_reference.py`` writes the CLI reference
    from it)."""
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


_EVAL_EPILOG = """\
examples:
  hf-janus eval --reference ./base --finetuned ./finetuned --rectified ./rectified \\
      --past-task nq_open_dev.jsonl --past-task webquestions.jsonl --new-task gsm8k_test.jsonl --output eval.json
  hf-janus eval --reference meta-llama/Llama-3.2-1B --finetuned me/math-lora --past-task nq_open --new-task gsm8k

A task is an lm-eval task name, or a local JSONL: rows {"question", "answers"} are scored by exact match of the
greedy answer, rows {"prompt", "completion"} by the completion's negative log-likelihood per byte.
"""


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="score θ0, the fine-tuned and the rectified model with lm-evaluation-harness: AP1/AP2/AP",
        description="Run lm-evaluation-harness tasks on the model before fine-tuning (--reference), after it "
                    "(--finetuned) and after rectification (--rectified), and report the paper's AP1 (past tasks, "
                    "relative to --reference), AP2 (new tasks, relative to --finetuned) and AP. Needs the [eval] "
                    "extra: pip install 'hf-janus[eval]'.",
        epilog=_EVAL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_evaluation_options(p, tasks_required=False)
    p.add_argument("--rectified", metavar="ID_OR_DIR", help="the rectified model or adapter")
    p.add_argument("--model", action="append", default=[], metavar="LABEL=ID_OR_DIR",
                   help="another model to score, e.g. wise0.5=./interpolated (repeatable)")
    p.add_argument("--output", metavar="PATH", help="also write the scores and AP figures as JSON to PATH")
    p.set_defaults(func=_run_eval)


def _run_eval(args: argparse.Namespace) -> int:
    from hf_janus.evaluation.harness import evaluate

    others = {}
    for item in args.model:
        label, sep, name = item.partition("=")
        if not sep or not label or not name:
            raise ValueError(f"--model takes LABEL=ID_OR_DIR, got {item!r}")
        others[label] = name
    if not args.past_task and not args.new_task:
        raise ValueError("give at least one --past-task or --new-task")
    result = evaluate(args.reference, args.finetuned, args.rectified, past_tasks=args.past_task,
                      new_tasks=args.new_task, others=others, **evaluation_settings(args))
    print(result.to_markdown())
    if args.output:
        result.save(args.output)
        print(f"\nscores written to {args.output}")
    return 0


_FRONTIER_EPILOG = """\
examples:
  hf-janus frontier --reference ./base --finetuned ./math-lora --replay past.jsonl --text-field text \\
      --past-task nq_open_dev.jsonl --new-task gsm8k_test.jsonl --min-ap2 95 --output ./frontier --save ./chosen

Every candidate costs one evaluation of the tasks, and every JANUS candidate one rectification; the progress bar
shows the time left. --output gets frontier.json, frontier.md and frontier.png.
"""


def _add_frontier(sub: argparse._SubParsersAction) -> None:
    from hf_janus.evaluation.candidates import DEFAULT_GRID, DEFAULT_PEERS, NEW_TASK_PEERS, kinds

    p = sub.add_parser(
        "frontier",
        help="score WiSE-FT, JANUS and hybrids on your tasks, plot AP1 against AP2 and save the point you ask for",
        description="Build the stability-plasticity frontier between θ0 (--reference) and θ̂ (--finetuned): WiSE-FT "
                    "interpolations, JANUS at several τ, damped JANUS, JANUS followed by interpolation toward θ0 or "
                    "θ̂, and interpolation followed by JANUS; for a LoRA adapter also PEFT's intruder-dimension "
                    "reduction and intruder reduction followed by JANUS; the post-hoc peers (replay fine-tuning, the "
                    "input-covariance null space, RegMean, Fisher interpolation, LiNeS, DG-Hard); or the candidates "
                    "--candidates names. Each is scored with lm-evaluation-harness (AP1 on --past-task, AP2 on "
                    "--new-task); the point meeting the criterion is chosen and can be saved or pushed with its "
                    "record. Needs the [eval] extra: pip install 'hf-janus[eval]'.",
        epilog=_FRONTIER_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("models and tasks")
    add_evaluation_options(src, tasks_required=True)

    rep = p.add_argument_group("replay (samples of the past task, for JANUS)")
    # groups are shown in the order they are made: every main one before the advanced ones
    jan = p.add_argument_group("candidates and JANUS")
    out = p.add_argument_group("choice and output")
    advanced = p.add_argument_group(f"{ADVANCED}: replay and output")
    _add_replay(rep, advanced, new_task_help="samples of the new task (what fine-tuning trained on), read as --replay "
                f"is, for {NEW_TASK_PEERS} (the repair after JANUS, added to the default candidates when given) and "
                "replay-sft's new_task_weight=, which fit them beside the replay so that the gain is kept")

    jan.add_argument("--candidates", metavar="SPEC",
                     help="the candidates to score after θ0 and θ̂, e.g. 'wise:0.25,0.5,0.7 janus:tau=0.95 "
                          "replay-sft:passes=4,8:loss=kl input-null fisher lines dg-hard': space-separated "
                          "NAME[:KEY=V,V...]... (an option left out takes the kind's default grid); kinds: "
                          + ", ".join(kind.name for kind in kinds()) + f" (default: '{DEFAULT_GRID}', intruder "
                          f"reduction only for a LoRA adapter, then the post-hoc peers '{DEFAULT_PEERS}', those that "
                          "beat JANUS on a benchmark run, left out where they cannot run; with --new-task-samples also "
                          f"'{NEW_TASK_PEERS}'; see the evaluate-and-frontier guide)")
    jan.add_argument("--config", metavar="JSON", help="a JanusConfig JSON file; the options given override it")
    add_dataclass_options(jan, JanusConfig, CONFIG_PREFIX, tier="main")

    crit = out.add_mutually_exclusive_group()
    crit.add_argument("--min-ap2", type=float, help="choose the largest AP1 among points with AP2 >= this (%%)")
    crit.add_argument("--min-ap1", type=float, help="choose the largest AP2 among points with AP1 >= this (%%)")
    out.add_argument("--output", metavar="DIR", help="write frontier.json, frontier.md and frontier.png here")
    out.add_argument("--save", metavar="DIR", help="save the chosen model (full weights, record, card) here")
    out.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --save directory")
    out.add_argument("--push-to-hub", metavar="REPO", help="also upload the chosen model to this Hub repo")
    advanced.add_argument("--private", action="store_true", help="create the --push-to-hub repo as private")
    advanced.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_dataclass_options(p.add_argument_group(ADVANCED_JANUS_TITLE), JanusConfig, CONFIG_PREFIX, tier=ADVANCED)
    add_dataclass_options(p.add_argument_group(INTERNALS_TITLE), JanusConfig, CONFIG_PREFIX, tier="internal")
    p.set_defaults(func=_run_frontier)


def _run_frontier(args: argparse.Namespace) -> int:
    import os

    from hf_janus.evaluation.frontier_search import frontier
    from hf_janus.io_utils import check_output_dir
    from hf_janus.replay.sources import parse_replay_spec

    options = replay_options(args)
    replay = replay_argument(args, options)
    inputs = {"reference": args.reference, "finetuned": args.finetuned, "replay data": replay_input(args),
              "new-task samples": (None if args.new_task_samples is None
                                   else parse_replay_spec(args.new_task_samples)[0])}
    if args.save:  # fail before the expensive part, and never over an input
        check_output_dir(args.save, args.overwrite, inputs)
    if args.output:
        check_output_dir(args.output, True, inputs)
    result = frontier(args.reference, args.finetuned, replay, past_tasks=args.past_task,
                      new_tasks=args.new_task, config=merge_config(args), candidates=args.candidates,
                      new_task_samples=args.new_task_samples, replay_options=options, progress=not args.no_progress,
                      **evaluation_settings(args))
    result.select(min_ap2=args.min_ap2, min_ap1=args.min_ap1)
    table = result.to_markdown()
    print(table)
    if args.output:
        os.makedirs(args.output, exist_ok=True)
        result.save(os.path.join(args.output, "frontier.json"))
        from hf_janus.io_utils import atomic_write_text

        atomic_write_text(os.path.join(args.output, "frontier.md"), table + "\n")
        result.plot(os.path.join(args.output, "frontier.png"))
        print(f"\nfrontier written to {args.output} (frontier.json, frontier.md, frontier.png)")
    if args.save:
        result.save_pretrained(args.save, overwrite=args.overwrite)
        print(f"chosen model written to {args.save}")
    if args.push_to_hub:
        url = result.push_to_hub(args.push_to_hub, private=args.private or None)
        print(f"pushed to {args.push_to_hub}: {url}")
    return 0


_SUBCOMMANDS = [_add_demo, _add_merge, _add_eval, _add_frontier]


def _quantization_config(args: argparse.Namespace) -> Any:
    """The ``BitsAndBytesConfig`` of ``--load-in-4bit``/``--load-in-8bit`` (None without them)."""
    if not (args.load_in_4bit or args.load_in_8bit):
        return None
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ValueError("--load-in-4bit/--load-in-8bit need bitsandbytes: pip install 'hf-janus[qlora]'") from err
    import torch
    from transformers import BitsAndBytesConfig

    if args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = getattr(torch, args.dtype) if args.dtype not in (None, "auto") else torch.float32
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute)


def default_device() -> Optional[str]:
    """``--device`` when it is not given: the first CUDA device when there is one (what a user with a GPU expects of
    a command that runs a model), else None (the CPU)."""
    import torch

    return "cuda" if torch.cuda.is_available() else None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line as the commands read it: parsed, with the defaults that depend on the machine filled in."""
    args = build_parser().parse_args(argv)
    if getattr(args, "device", "unset") is None:
        args.device = default_device()
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"hf-janus {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
