"""lm-eval tasks that read local JSONL files, so that evaluation works offline.

Two kinds, built as lm-eval task configs (``dict``) that :func:`hf_janus.evaluate` and ``lm_eval`` itself accept:

* **QA exact match** (:func:`qa_task`): rows with a question and one or more reference answers (NQ-open's
  ``question``/``answer``, WebQuestions' ``qText``/``answers``, or any names you give). Greedy generation from
  ``"Q: <question>?\\nA:"`` (lm-eval's NQ-open prompt), first line, SQuAD-normalized exact match against any answer.
* **Completion likelihood** (:func:`completion_task`): rows with a prompt and a completion (e.g. a GSM8K question
  and its worked answer); the score is the completion's negative log-likelihood per byte (lower is better), the
  likelihood measure that does not depend on the tokenizer's segmentation.

The same tasks ship as YAML for the ``lm_eval`` command line (:func:`task_dir`; the file is given as metadata)::

    lm_eval --model hf --model_args pretrained=./model \\
        --include_path "$(python -c 'import hf_janus.evaluation as e; print(e.task_dir())')" \\
        --tasks janus_nq_open --metadata '{"data_files": "nq_open_dev.jsonl"}'
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Optional, Sequence, Union

from hf_janus.errors import JanusError
from hf_janus.evaluation.scoring import exact_match, first_line, weighted_nll

PathLike = Union[str, os.PathLike]

#: lm-eval's NQ-open prompt (its ``nq_open`` task), which the forgetting benchmark also uses.
QA_PROMPT = "Q: {question}?\nA:"
QUESTION_FIELDS = ("question", "qText", "query")
ANSWER_FIELDS = ("answers", "answer", "targets")
PROMPT_FIELDS = ("prompt", "question", "input")
COMPLETION_FIELDS = ("completion", "answer", "response", "output")


def task_dir() -> str:
    """The directory of the shipped YAML tasks (``janus_nq_open``, ``janus_webqs``, ``janus_completion``), for
    ``lm_eval --include_path`` or ``TaskManager(include_path=...)``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


def read_jsonl(path: PathLike) -> list[dict[str, Any]]:
    """The rows of a JSONL file (one JSON object per non-empty line), with errors that name the line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise JanusError(f"evaluation file {path!r} does not exist; pass a JSONL file with one JSON object per line")
    rows = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise JanusError(f"{path}, line {number}: not JSON ({err})") from err
            if not isinstance(row, dict):
                raise JanusError(f"{path}, line {number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    if not rows:
        raise JanusError(f"evaluation file {path!r} holds no rows")
    return rows


def _pick_field(row: dict[str, Any], given: Optional[str], candidates: Sequence[str], what: str, path: str) -> str:
    if given is not None:
        if given not in row:
            raise JanusError(f"{path}: rows have no field {given!r} for the {what}; fields are {sorted(row)}")
        return given
    for name in candidates:
        if name in row:
            return name
    raise JanusError(f"{path}: no {what} field among {sorted(row)}; name it (one of {list(candidates)} is found "
                     f"by itself)")


def _as_answers(value: Any, path: str, index: int) -> list[str]:
    answers = [value] if isinstance(value, str) else value
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise JanusError(f"{path}, row {index}: answers must be a string or a non-empty list of strings, "
                         f"got {json.dumps(value)[:80]}")
    return answers


def _task_rows(data_files: Optional[PathLike], kind: str, example: str) -> tuple[str, list[dict[str, Any]]]:
    """The path and rows of a task's file; a task built without one names how lm-eval passes it."""
    if data_files is None:
        raise JanusError(f"this {kind} task needs its file: pass data_files (lm_eval: --metadata "
                         f"'{{\"data_files\": \"{example}\"}}')")
    path = os.fspath(data_files)
    return path, read_jsonl(path)


def load_qa(data_files: Optional[PathLike] = None, question_field: Optional[str] = None,
            answers_field: Optional[str] = None, **_: Any) -> Any:
    """A QA JSONL as a ``DatasetDict`` with one ``test`` split of ``question`` (str) and ``answers`` (list[str]).

    lm-eval's ``custom_dataset`` hook: it passes the task metadata as keyword arguments, hence ``**_``.
    """
    from datasets import Dataset, DatasetDict

    path, rows = _task_rows(data_files, "QA", "questions.jsonl")
    q_field = _pick_field(rows[0], question_field, QUESTION_FIELDS, "question", path)
    a_field = _pick_field(rows[0], answers_field, ANSWER_FIELDS, "answers", path)
    docs = []
    for index, row in enumerate(rows):
        if not isinstance(row.get(q_field), str):
            raise JanusError(f"{path}, row {index}: {q_field!r} must be a string")
        docs.append({"question": row[q_field], "answers": _as_answers(row.get(a_field), path, index)})
    return DatasetDict({"test": Dataset.from_list(docs)})


def load_completions(data_files: Optional[PathLike] = None, prompt_field: Optional[str] = None,
                     completion_field: Optional[str] = None, **_: Any) -> Any:
    """A prompt/completion JSONL as a ``DatasetDict`` with one ``test`` split of ``prompt`` and ``completion``."""
    from datasets import Dataset, DatasetDict

    path, rows = _task_rows(data_files, "completion", "completions.jsonl")
    p_field = _pick_field(rows[0], prompt_field, PROMPT_FIELDS, "prompt", path)
    c_field = _pick_field(rows[0], completion_field, COMPLETION_FIELDS, "completion", path)
    docs = []
    for index, row in enumerate(rows):
        prompt, completion = row.get(p_field), row.get(c_field)
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
            raise JanusError(f"{path}, row {index}: {p_field!r} and {c_field!r} must be strings, the completion "
                             "non-empty")
        docs.append({"prompt": prompt, "completion": completion})
    return DatasetDict({"test": Dataset.from_list(docs)})


# ---- the functions lm-eval calls per document ---------------------------------------------------------------
def qa_prompt(doc: dict[str, Any]) -> str:
    """lm-eval's NQ-open prompt; a trailing question mark of the question is not doubled."""
    return QA_PROMPT.format(question=doc["question"].rstrip(" ?"))


def qa_target(doc: dict[str, Any]) -> str:
    return doc["answers"][0]


def process_qa(doc: dict[str, Any], results: Sequence[str]) -> dict[str, float]:
    """Exact match of the first line of the greedy continuation against any reference answer."""
    return {"exact_match": exact_match(first_line(results[0]), doc["answers"])}


def completion_prompt(doc: dict[str, Any]) -> str:
    return doc["prompt"]


def completion_target(doc: dict[str, Any], delimiter: str = " ") -> str:
    """The scored text: the delimiter and the completion (lm-eval does not put a delimiter before a
    loglikelihood target by itself, so the task's ``target_delimiter`` is empty)."""
    return delimiter + doc["completion"]


def process_completion(doc: dict[str, Any], results: Sequence[tuple[float, bool]],
                       delimiter: str = " ") -> dict[str, tuple[float, int]]:
    """The scored text's log-likelihood and byte count, summed over documents by :func:`weighted_nll`."""
    loglik = results[0][0]
    return {"nll_per_byte": (loglik, len(completion_target(doc, delimiter).encode("utf-8")))}


# ---- task configs ---------------------------------------------------------------------------------------------
def _task_name(path: str, prefix: str) -> str:
    stem = os.path.splitext(os.path.basename(path))[0]
    return f"{prefix}_{''.join(ch if ch.isalnum() else '_' for ch in stem)}"


def qa_task(data_files: PathLike, name: Optional[str] = None, *, question_field: Optional[str] = None,
            answers_field: Optional[str] = None, max_new_tokens: int = 32) -> dict[str, Any]:
    """An lm-eval task config: SQuAD exact match of greedy answers to the questions of a local JSONL.

    Args:
        data_files: the JSONL, one ``{"question": ..., "answers": [...]}`` per line (other field names are found
            by themselves or named here).
        name: the task name (default ``janus_qa_<file stem>``).
        max_new_tokens: generation budget of an answer; generation also stops at a newline.
    """
    path = os.fspath(data_files)
    load_qa(path, question_field, answers_field)  # fail here, with the file named, not inside lm-eval
    return {
        "task": name or _task_name(path, "janus_qa"),
        "custom_dataset": load_qa,
        "dataset_kwargs": {"data_files": path, "question_field": question_field, "answers_field": answers_field},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": qa_prompt,
        "doc_to_target": qa_target,
        "target_delimiter": " ",
        "generation_kwargs": {"until": ["\n"], "do_sample": False, "max_gen_toks": max_new_tokens},
        "process_results": process_qa,
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }


def completion_task(data_files: PathLike, name: Optional[str] = None, *, prompt_field: Optional[str] = None,
                    completion_field: Optional[str] = None, delimiter: str = " ") -> dict[str, Any]:
    """An lm-eval task config: negative log-likelihood per byte of the completions of a local JSONL.

    Args:
        data_files: the JSONL, one ``{"prompt": ..., "completion": ...}`` per line.
        name: the task name (default ``janus_completion_<file stem>``).
        delimiter: put between the prompt and the completion.
    """
    path = os.fspath(data_files)
    load_completions(path, prompt_field, completion_field)
    return {
        "task": name or _task_name(path, "janus_completion"),
        "custom_dataset": load_completions,
        "dataset_kwargs": {"data_files": path, "prompt_field": prompt_field, "completion_field": completion_field},
        "test_split": "test",
        "output_type": "loglikelihood",
        "doc_to_text": completion_prompt,
        "doc_to_target": functools.partial(completion_target, delimiter=delimiter),
        "target_delimiter": "",
        "process_results": functools.partial(process_completion, delimiter=delimiter),
        "metric_list": [{"metric": "nll_per_byte", "aggregation": weighted_nll, "higher_is_better": False}],
        "metadata": {"version": 1.0},
    }


def task_from_file(path: PathLike, name: Optional[str] = None) -> dict[str, Any]:
    """:func:`qa_task` or :func:`completion_task`, whichever the first row's fields say."""
    rows = read_jsonl(path)
    first = rows[0]
    if any(f in first for f in QUESTION_FIELDS) and any(f in first for f in ("answers", "targets")) or (
            any(f in first for f in QUESTION_FIELDS) and isinstance(first.get("answer"), list)):
        return qa_task(path, name)
    if any(f in first for f in PROMPT_FIELDS) and any(f in first for f in COMPLETION_FIELDS):
        return completion_task(path, name)
    raise JanusError(f"{os.fspath(path)}: cannot tell the task from the fields {sorted(first)}: use QA rows "
                     "({'question': ..., 'answers': [...]}) or completion rows ({'prompt': ..., 'completion': ...}), "
                     "or build the task with hf_janus.evaluation.qa_task / completion_task and name the fields")
