"""Options that several ``hf-janus`` subcommands share: dataclass fields (``JanusConfig``, ``ReplayOptions``) as
command-line options and back, and the models, tasks and lm-eval settings of ``eval`` and ``frontier``.

A field becomes an option by carrying ``metadata["help"]``, so the configuration classes stay the one place where
an option is described (``docs/generate_config_reference.py`` reads the same metadata).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

from hf_janus.replay.self_replay import DEFAULT_MAX_NEW_TOKENS, GENERIC, SelfReplay

REPLAY_PREFIX, CONFIG_PREFIX = "replay.", "janus."

ALLOW_PICKLE_HELP = ("read weights stored only as a pickle (adapter_model.bin, pytorch_model.bin), which are refused "
                     "by default because unpickling can run code; they are then read with torch's restricted "
                     "unpickler (weights_only=True). Convert them to safetensors instead when you can")


#: ``--help`` shows first the options most runs set (``metadata["main"]``), then groups whose titles start with
#: :data:`ADVANCED`: the other settings, and last the engine's internals (``metadata["internal"]``)
ADVANCED = "advanced"
ADVANCED_JANUS_TITLE = f"{ADVANCED}: JANUS (step control, replay constraint and acceptance, the repair's training)"
INTERNALS_TITLE = f"{ADVANCED}: JANUS engine internals (precision, memory, compression; the defaults suit most runs)"


def field_tier(f: dataclasses.Field) -> str:
    """Where a dataclass field's option is shown: ``"main"``, ``"advanced"`` or ``"internal"`` (its metadata)."""
    return "internal" if f.metadata.get("internal") else "main" if f.metadata.get("main") else ADVANCED


def add_dataclass_options(group: argparse._ArgumentGroup, cls: type, prefix: str,
                          tier: Optional[str] = None) -> None:
    """One option per field of dataclass ``cls`` that has ``metadata["help"]`` (as PEFT's configs document
    theirs): ``--field-name`` or ``metadata["cli"]``, typed by the default, with its ``choices``/``nargs``.
    Every option defaults to None, so that only what the user gave overrides a config file. ``tier``: only the
    fields of that :func:`field_tier` (None: every field)."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta or tier is not None and field_tier(f) != tier:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        shown = str(default).replace("torch.", "") if default is not None else "none"
        # argparse %-formats every help string, so a literal % in a field's help (kept plain for the docs) must be
        # doubled here or --help fails
        help_text = (meta["help"] + f" (default: {shown})").replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": prefix + f.name, "default": None, "help": help_text}
        if "choices" in meta:
            kwargs["choices"] = list(meta["choices"])
        elif "nargs" in meta:
            kwargs.update(nargs=meta["nargs"], metavar="NAME")
        elif "type" in meta:  # a field whose default (None, a dict) does not say its type
            kwargs["type"] = meta["type"]
            if "metavar" in meta:
                kwargs["metavar"] = meta["metavar"]
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            kwargs["type"] = type(default)
        group.add_argument(meta.get("cli", "--" + f.name.replace("_", "-")), **kwargs)


def dataclass_values(args: argparse.Namespace, cls: type, prefix: str) -> dict[str, Any]:
    """The options of :func:`add_dataclass_options` that the user gave, as ``{field: value}``."""
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, prefix + f.name, None)
        if value is None:
            continue
        if f.metadata.get("zero_is_none") and value == 0:
            value = None
        values[f.name] = value
    return values


def add_evaluation_options(group: Any, *, tasks_required: bool) -> None:
    """The models, tasks and lm-eval settings that ``eval`` and ``frontier`` share."""
    group.add_argument("--reference", required=True, metavar="ID_OR_DIR", help="θ0: Hub repo id or local directory")
    group.add_argument("--finetuned", required=True, metavar="ID_OR_DIR",
                       help="θ̂: full weights or a PEFT adapter (merged on its base), Hub repo id or local directory")
    tasks: dict[str, Any] = {"required": True} if tasks_required else {"default": []}
    group.add_argument("--past-task", action="append", metavar="TASK", **tasks,
                       help="a task the model should keep (repeatable): lm-eval task name or JSONL file")
    group.add_argument("--new-task", action="append", metavar="TASK", **tasks,
                       help="a task fine-tuning taught (repeatable): lm-eval task name or JSONL file")
    group.add_argument("--tokenizer", metavar="ID_OR_DIR", help="tokenizer (default: the one beside --reference)")
    group.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                       help="dtype to load the models in (default: the checkpoint's)")
    group.add_argument("--allow-pickle", action="store_true", help=ALLOW_PICKLE_HELP)
    group.add_argument("--device", default=None,
                       help="device for the models, e.g. cuda:0 (default: cuda when there is a GPU, else cpu)")
    group.add_argument("--batch-size", default="16", help="lm-eval batch size, an int or auto (default: 16)")
    group.add_argument("--limit", type=float, help="at most this many documents per task (a fraction when < 1)")
    group.add_argument("--include-path", metavar="DIR", help="a directory of more lm-eval task YAMLs")


def evaluation_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`hf_janus.evaluate` / :func:`hf_janus.frontier` that
    :func:`add_evaluation_options` gives, beyond the models and tasks."""
    batch_size = args.batch_size if args.batch_size == "auto" else int(args.batch_size)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    return {"tokenizer": args.tokenizer, "batch_size": batch_size, "limit": limit, "include_path": args.include_path,
            "device": args.device, "torch_dtype": args.dtype, "allow_pickle": args.allow_pickle}


REPLAY_HELP = ("Hub dataset id, local .jsonl/.json/.parquet/.csv file, or datasets directory (save_to_disk or data "
               "files); optional :SPLIT, e.g. data.jsonl:train[:256] (default split: train). Give this, or "
               "--replay-prompts / --replay-self")


def add_self_replay_options(group: Any, advanced: Any) -> None:
    """``--replay-self`` (in ``group``) and ``--replay-prompts`` with its settings (in ``advanced``): replay that θ0
    generates (:class:`hf_janus.SelfReplay`), in place of ``--replay``."""
    advanced.add_argument("--replay-prompts", metavar="FILE[:SPLIT]",
                       help="self-replay: θ0 (the base or reference model, never the fine-tuned one) answers these "
                            f"prompts (greedy, up to {DEFAULT_MAX_NEW_TOKENS} new tokens) and its answers are the "
                            "replay; a local file, datasets directory or Hub dataset id, read from --prompt-field or "
                            "the first of the columns prompt, question, instruction, text. The first --replay-self N "
                            "(else --replay-samples) prompts are answered; answers are cached under $HF_JANUS_CACHE "
                            "(default: $HF_HOME/hf_janus)")
    group.add_argument("--replay-self", type=int, metavar="N",
                       help="self-replay of N samples; without --replay-prompts θ0 answers the package's 100 generic "
                            "prompts (chat instructions alternating with plain-text questions answered to the end of "
                            "the line), for replay without any data of the past task (greedy up to N=100, beyond that "
                            "several sampled answers per prompt, seeded)")
    advanced.add_argument("--replay-stop", action="append", metavar="TEXT",
                       help="with --replay-prompts: a string that ends θ0's answer, kept in it (repeatable; escapes "
                            "such as \\n are read), e.g. --replay-stop '\\n' for prompts like 'Q: ...\\nA:'")
    advanced.add_argument("--replay-no-chat-template", action="store_true",
                       help="with --replay-prompts: give the prompts to θ0 as plain text, not through its tokenizer's "
                            "chat template")


def replay_argument(args: argparse.Namespace, options: Any) -> Any:
    """The ``replay`` of a subcommand with :func:`add_self_replay_options`: ``--replay`` as given, or a
    ``SelfReplay`` (``options``: the ``ReplayOptions`` given, whose ``num_samples`` and ``prompt_field`` it takes)."""
    self_replay = args.replay_prompts is not None or args.replay_self is not None
    if args.replay is not None and self_replay:
        raise ValueError("give --replay (data of the past task) or --replay-prompts/--replay-self (θ0's own answers), "
                         "not both")
    if not self_replay:
        if args.replay is None:
            raise ValueError("give the replay: --replay DATASET (samples of the past task), --replay-prompts FILE "
                             "(θ0 answers them) or --replay-self N (θ0 answers generic prompts)")
        return args.replay
    if args.replay_self is not None and args.replay_self < 1:
        raise ValueError(f"--replay-self must be >= 1, got {args.replay_self}")
    if args.replay_prompts is None and (args.replay_stop or args.replay_no_chat_template):
        raise ValueError("--replay-stop and --replay-no-chat-template shape the answers to --replay-prompts; the "
                         "generic prompts of --replay-self say for themselves how they are answered")
    stop = [text.encode("latin-1", "backslashreplace").decode("unicode_escape") for text in args.replay_stop or ()]
    count = args.replay_self if args.replay_self is not None else options.num_samples
    field: Optional[str] = getattr(args, REPLAY_PREFIX + "prompt_field", None)
    return SelfReplay(prompts=args.replay_prompts or GENERIC, num_samples=count, prompt_field=field,
                      split=options.split, stop=stop or None, chat_template=not args.replay_no_chat_template,
                      progress=not getattr(args, "no_progress", False))


def replay_input(args: argparse.Namespace) -> Optional[str]:
    """The local path the replay is read from (``--replay`` or ``--replay-prompts``), for the checks that an output
    never overwrites an input; None for self-replay of the generic prompts."""
    from hf_janus.replay.sources import parse_replay_spec

    spec = args.replay if args.replay is not None else args.replay_prompts
    return parse_replay_spec(spec)[0] if spec is not None else None
