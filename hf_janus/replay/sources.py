"""Load past-task replay samples from a Hub dataset, a local file or a ``datasets`` directory, and tokenize them.

Returns the list-of-dicts replay the engine accepts (``input_ids``, ``attention_mask`` and, for
prompt/response data, ``labels`` with the prompt masked by -100). Sources:

* a Hub dataset id (``"user/name"``), through ``datasets.load_dataset``;
* a local ``.jsonl``/``.json``/``.parquet``/``.csv``/``.txt``/``.arrow`` file (``load_dataset`` with the
  matching builder);
* a directory written by ``Dataset.save_to_disk``/``DatasetDict.save_to_disk`` (``load_from_disk``), or a
  directory of data files (``load_dataset``).

A split can be appended as ``SOURCE:SPLIT`` (``"data.jsonl:train[:256]"``); the default split is ``train``
(or the only split of a saved ``DatasetDict``).

Formats (``format=``): ``"text"`` (every token of ``text_field`` counts), ``"prompt-response"`` (only the
response tokens count), ``"tokens"`` (already tokenized ``input_ids`` [``attention_mask``, ``labels``]) or
``"auto"``: ``tokens`` if there is an ``input_ids`` column, else ``prompt-response`` if the prompt and
response columns exist, else ``text``.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from hf_janus.errors import JanusError
from hf_janus.io_utils import looks_like_local_path

logger = logging.getLogger(__name__)

FORMATS = ("auto", "text", "prompt-response", "tokens")
DEFAULT_NUM_SAMPLES = 256
DEFAULT_MAX_LENGTH = 1024



@dataclass
class ReplayOptions:
    """How replay given by name (a Hub dataset id, a file or a directory) is read and tokenized.

    The help texts are the command line's (``hf-janus merge --replay-format ...``).
    """

    format: str = field(default="auto", metadata={
        "help": "text: every token of text_field counts; prompt-response: only response_field tokens count; "
                "tokens: an input_ids column; auto: tokens if input_ids exists, else prompt-response if both "
                "fields exist, else text", "choices": FORMATS, "cli": "--replay-format"})
    text_field: str = field(default="text", metadata={"help": "the text column"})
    prompt_field: str = field(default="prompt", metadata={"main": True, "help": "the prompt column"})
    response_field: str = field(default="response", metadata={"main": True, "help": "the response column"})
    max_length: Optional[int] = field(default=DEFAULT_MAX_LENGTH, metadata={
        "help": "cut replay sequences to this many tokens"})
    num_samples: Optional[int] = field(default=DEFAULT_NUM_SAMPLES, metadata={
        "help": "use the first N rows (256 as in the paper; 0 = all)", "cli": "--replay-samples", "zero_is_none": True})
    split: Optional[str] = field(default=None, metadata={
        "help": "the split to read (default: the SOURCE:SPLIT suffix, else train)", "cli": "--replay-split"})

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise JanusError(f"replay format {self.format!r} is invalid; choose one of {', '.join(FORMATS)}")
        if self.max_length is not None and self.max_length < 2:
            raise JanusError(f"max_length={self.max_length} is too small: a replay sample needs at least 2 tokens")
        if self.num_samples is not None and self.num_samples < 1:
            raise JanusError(f"num_samples={self.num_samples} is invalid: expected None (all rows) or an int >= 1")


_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text",
             ".arrow": "arrow"}
_SPLIT_SUFFIX = re.compile(r"^(?P<source>.+?):(?P<split>[A-Za-z_][\w.\-]*(?:\[[^\]]*\])?)$")


def parse_replay_spec(spec: str) -> tuple[str, Optional[str]]:
    """``"name:split"`` -> ``("name", "split")``; an existing path is never split."""
    spec = os.fspath(spec)
    if os.path.exists(os.path.expanduser(spec)):
        return spec, None
    match = _SPLIT_SUFFIX.match(spec)
    if match:
        return match.group("source"), match.group("split")
    return spec, None


def _is_saved_dataset(path: str) -> bool:
    names = set(os.listdir(path))
    return "dataset_dict.json" in names or {"dataset_info.json", "state.json"} <= names


def _pick_split(dataset_dict: Any, split: Optional[str], source: str) -> Any:
    if split is not None:
        base = split.split("[", 1)[0]
        if base not in dataset_dict:
            raise JanusError(f"replay dataset {source!r} has no split {base!r}; its splits are {sorted(dataset_dict)}")
        if base != split:
            raise JanusError(f"slicing ({split!r}) is not supported for a saved DatasetDict; use split {base!r}")
        return dataset_dict[base]
    if "train" in dataset_dict:
        return dataset_dict["train"]
    if len(dataset_dict) == 1:
        return next(iter(dataset_dict.values()))
    raise JanusError(f"replay dataset {source!r} has splits {sorted(dataset_dict)}; choose one with {source}:SPLIT")


def check_replay_source(source: Any, what: str = "replay") -> None:
    """Refuse, without reading it, a named source that cannot be read: a local file or directory that does not exist
    (a name that looks like a path, or ends like a data file), a file of an unsupported type, an empty file. A Hub
    dataset id passes (it is checked when it is opened)."""
    source = os.fspath(source)
    name, _ = parse_replay_spec(source)
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        ext = os.path.splitext(path)[1].lower()
        if ext not in _BUILDERS:
            raise JanusError(f"{what} file {name!r} has an unsupported extension {ext or '(none)'}; use one of "
                             f"{', '.join(sorted(_BUILDERS))}, a datasets directory or a Hub dataset id")
        if os.path.getsize(path) == 0:
            raise JanusError(f"{what} file {name!r} is empty: write the samples into it (one JSON object per line "
                             "for .jsonl, rows with a header for .csv)")
    elif not os.path.isdir(path) and (looks_like_local_path(name) or os.path.splitext(path)[1].lower() in _BUILDERS):
        raise JanusError(f"{what} file or directory {name!r} does not exist")


def load_replay_dataset(source: str, split: Optional[str] = None, revision: Optional[str] = None,
                        token: Any = None) -> Any:
    """Open ``source`` as one ``datasets.Dataset`` (see the module docstring for what ``source`` may be)."""
    import datasets

    path = os.path.expanduser(os.fspath(source))
    try:
        check_replay_source(source)
        if os.path.isfile(path):
            ext = os.path.splitext(path)[1].lower()
            return datasets.load_dataset(_BUILDERS[ext], data_files=path, split=split or "train")
        if os.path.isdir(path):
            if _is_saved_dataset(path):
                loaded = datasets.load_from_disk(path)
                if isinstance(loaded, datasets.DatasetDict):
                    return _pick_split(loaded, split, source)
                if split is not None:
                    raise JanusError(f"replay dataset {source!r} is a single saved Dataset; drop the ':{split}' suffix")
                return loaded
            return datasets.load_dataset(path, split=split or "train")
        kwargs: dict[str, Any] = {"split": split or "train"}
        if revision:
            kwargs["revision"] = revision
        if token is not None:
            kwargs["token"] = token
        return datasets.load_dataset(source, **kwargs)
    except JanusError:
        raise
    except Exception as err:
        raise JanusError(
            f"could not load replay data {source!r} (split {split or 'train'!r}): {type(err).__name__}: {err}"
        ) from err


def _resolve_format(columns: Sequence[str], fmt: str, text_field: str, prompt_field: str, response_field: str,
                    source: str) -> str:
    if fmt == "auto":
        if "input_ids" in columns:
            fmt = "tokens"
        elif prompt_field in columns and response_field in columns:
            fmt = "prompt-response"
        elif text_field in columns:
            fmt = "text"
        else:
            raise JanusError(
                f"cannot tell how to read replay {source!r} (columns {list(columns)}): name the text column with "
                f"text_field (--text-field), or the prompt and response columns with prompt_field/response_field "
                f"(--prompt-field/--response-field), or provide input_ids"
            )
    needed = {"text": [text_field], "prompt-response": [prompt_field, response_field], "tokens": ["input_ids"]}[fmt]
    missing = [c for c in needed if c not in columns]
    if missing:
        raise JanusError(f"replay {source!r} has no column(s) {missing} needed for format {fmt!r}; its columns are "
                         f"{list(columns)}")
    return fmt


def _token_ids(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _row_tokens(row: Any, i: int, fmt: str, tokenizer: Any, opts: ReplayOptions, eos: Optional[int],
                source: str) -> tuple[list[int], list[int], Optional[list[int]]]:
    """``(input_ids, attention_mask, labels)`` of row ``i`` read as ``fmt`` (labels ``None``: every token counts);
    a prompt/response pair already fits ``max_length``, other rows are cut by :func:`_cut_sample`."""
    labels: Optional[list[int]] = None
    if fmt == "tokens":
        ids = [int(t) for t in row["input_ids"]]
        mask = [int(t) for t in row["attention_mask"]] if row.get("attention_mask") is not None else [1] * len(ids)
        if row.get("labels") is not None:
            labels = [int(t) for t in row["labels"]]
    elif fmt == "text":
        text = row[opts.text_field]
        if not isinstance(text, str):
            raise JanusError(f"replay {source!r} row {i}: column {opts.text_field!r} holds {type(text).__name__}, "
                             "expected a string")
        ids = _token_ids(tokenizer, text, True)
        mask = [1] * len(ids)
    else:
        prompt_field, response_field, max_length = opts.prompt_field, opts.response_field, opts.max_length
        prompt, response = row[prompt_field], row[response_field]
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise JanusError(f"replay {source!r} row {i}: {prompt_field!r} and {response_field!r} must be strings")
        p = _token_ids(tokenizer, prompt, True)
        r = _token_ids(tokenizer, response, False) + ([int(eos)] if eos is not None else [])
        if max_length is not None and len(p) + len(r) > max_length:  # cut the prompt's end before the answer
            r = r[: max(max_length - len(p), max_length // 2)]
            p = p[: max_length - len(r)]
        ids, mask, labels = p + r, [1] * (len(p) + len(r)), [-100] * len(p) + r
    return ids, mask, labels


def _cut_sample(ids: list[int], mask: list[int], labels: Optional[list[int]],
                max_length: Optional[int]) -> Optional[dict[str, list[int]]]:
    """The engine sample of one row, cut to ``max_length`` tokens; ``None`` when it has nothing to predict."""
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
        labels = labels[:max_length] if labels is not None else None
    targets = labels[1:] if labels is not None else ids[1:]
    if len(ids) < 2 or all(t == -100 for t in targets):
        return None
    sample = {"input_ids": ids, "attention_mask": mask}
    if labels is not None:
        sample["labels"] = labels
    return sample


def tokenize_replay(dataset: Any, tokenizer: Any = None, options: Optional[ReplayOptions] = None, *,
                    source: str = "replay") -> list[dict[str, list[int]]]:
    """Turn rows into engine samples; the first ``num_samples`` rows are used (``None``: all), in order.

    ``text``: the whole text counts (BOS etc. as the tokenizer adds them). ``prompt-response``: prompt
    (with special tokens) + response (+ EOS when the tokenizer has one), labels -100 on the prompt.
    Sequences are cut to ``max_length`` tokens (for prompt/response, the prompt's end is cut first, keeping
    at least half of ``max_length`` for the response); rows left with nothing to predict are skipped.
    """
    opts = options if options is not None else ReplayOptions()
    text_field, prompt_field, response_field = opts.text_field, opts.prompt_field, opts.response_field
    max_length, num_samples = opts.max_length, opts.num_samples
    columns = list(getattr(dataset, "column_names", None) or (list(dataset[0]) if len(dataset) else []))
    if len(dataset) == 0:
        raise JanusError(f"replay {source!r} is empty: JANUS needs samples of the past task (typically ~256)")
    fmt = _resolve_format(columns, opts.format, text_field, prompt_field, response_field, source)
    if fmt != "tokens" and tokenizer is None:
        raise JanusError(
            f"replay {source!r} is raw text but no tokenizer is available: the base model has none; pass a "
            "tokenizer, or replay data that is already tokenized (an input_ids column)"
        )
    count = len(dataset) if num_samples is None else min(len(dataset), int(num_samples))
    if num_samples is not None and num_samples > len(dataset) and num_samples != DEFAULT_NUM_SAMPLES:
        logger.warning("replay %r has %d row(s), fewer than the %d asked for (num_samples / --replay-samples): "
                       "JANUS replays all %d; the report's num_samples says how many it used", source,
                       len(dataset), num_samples, len(dataset))
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    samples: list[dict[str, list[int]]] = []
    skipped = 0
    for i in range(count):
        sample = _cut_sample(*_row_tokens(dataset[i], i, fmt, tokenizer, opts, eos, source), max_length)
        if sample is None:
            skipped += 1
        else:
            samples.append(sample)
    if skipped:
        logger.warning("skipped %d replay row(s) of %r with nothing to predict (empty, or cut by max_length=%s)",
                       skipped, source, max_length)
    if not samples:
        raise JanusError(f"replay {source!r} has no usable sample: every row is empty or has nothing to predict "
                         f"after cutting to max_length={max_length}")
    return samples


def open_replay(source: str, options: Optional[ReplayOptions] = None, *, revision: Optional[str] = None,
                token: Any = None) -> tuple[Any, Optional[str]]:
    """The dataset ``source`` names (with a ``:split`` suffix or ``options.split``) and the split it was read at."""
    split = options.split if options is not None else None
    name, spec_split = parse_replay_spec(source)
    if split is not None and spec_split is not None and split != spec_split:
        raise JanusError(f"replay {source!r} names split {spec_split!r} but split={split!r} was also given")
    split = split or spec_split
    return load_replay_dataset(name, split, revision=revision, token=token), split


def load_replay(source: str, tokenizer: Any = None, options: Optional[ReplayOptions] = None, *,
                revision: Optional[str] = None, token: Any = None) -> list[dict[str, list[int]]]:
    """:func:`open_replay` + :func:`tokenize_replay`: the engine's samples of the replay ``source`` names."""
    dataset, _ = open_replay(source, options, revision=revision, token=token)
    return tokenize_replay(dataset, tokenizer, options, source=source)
