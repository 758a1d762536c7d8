"""Copy the subsets of the real datasets that the benchmarks use from ``../shared/data`` into this folder.

Rows are copied unchanged (one JSON object per line), in their original order; only the selection is ours:
the first rows of each file (NQ-open / WebQuestions: the first rows whose first answer is at most
``MAX_ANSWER_CHARS`` characters, so that a few-M-parameter model can memorize them). See README.md here for
origins and licenses. Run from the repository root:  python benchmarks/data/make_subsets.py [SHARED_DATA_DIR]
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_ANSWER_CHARS = 24
N_NQ, N_WQ, N_GSM_TRAIN, N_GSM_TEST = 768, 384, 3000, 300
# The "questions" scenario (issue 19): an English-question language model, evaluated on questions it never saw.
N_DPR_QUESTIONS, N_WQ_VAL = 8192, 256


def _first(rows, n, answers_key):
    out = [r for r in rows if r[answers_key] and len(r[answers_key][0]) <= MAX_ANSWER_CHARS]
    if len(out) < n:
        raise SystemExit(f"only {len(out)} rows qualify, {n} needed")
    return out[:n]


def _write(name, rows):
    with open(os.path.join(HERE, name), "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{name}: {len(rows)} rows")


def main(src: str) -> None:
    with open(os.path.join(src, "nq_open", "NQ-open.dev.jsonl"), encoding="utf-8") as fh:
        nq = [json.loads(line) for line in fh if line.strip()]
    with open(os.path.join(src, "webquestions", "trainmodel.json"), encoding="utf-8") as fh:
        wq = json.load(fh)
    with open(os.path.join(src, "gsm8k", "train.jsonl"), encoding="utf-8") as fh:
        gsm_train = [json.loads(line) for _, line in zip(range(N_GSM_TRAIN), fh)]
    with open(os.path.join(src, "gsm8k", "test.jsonl"), encoding="utf-8") as fh:
        gsm_test = [json.loads(line) for _, line in zip(range(N_GSM_TEST), fh)]
    _write("nq_open_dev_subset.jsonl", _first(nq, N_NQ, "answer"))
    _write("webquestions_trainmodel_subset.jsonl", _first(wq, N_WQ, "answers"))
    _write("gsm8k_train_subset.jsonl", gsm_train)
    _write("gsm8k_test_subset.jsonl", gsm_test)
    with open(os.path.join(src, "nq_open", "dpr_split", "nq_open_dpr.dev.jsonl"), encoding="utf-8") as fh:
        dpr = [json.loads(line) for _, line in zip(range(N_DPR_QUESTIONS), fh)]
    with open(os.path.join(src, "webquestions", "val.json"), encoding="utf-8") as fh:
        wq_val = json.load(fh)[:N_WQ_VAL]
    _write("nq_open_dpr_dev_subset.jsonl", dpr)
    _write("webquestions_val_subset.jsonl", wq_val)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "..", "shared", "data"))
