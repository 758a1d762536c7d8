"""Knowledge EM through lm-evaluation-harness against the benchmark's own greedy decoding (issue 19, item 1).

    python -m benchmarks.forgetting.compare_em      # ~3 min on 2 idle cores, with the shipped θ0 checkpoint

The forgetting benchmark reads its knowledge EM off lm-eval (hf_janus.evaluation: HFLM + a local QA task).
Before that it decoded greedily itself (lib.greedy_answers + lib.exact_match). This script scores the same
models both ways: θ0, a quickly fine-tuned θ̂ (plain AdamW on GSM8K, as the full fine-tuning does with Trainer)
and WiSE-FT points between them, and writes results/compare_em.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from benchmarks.forgetting import lib  # noqa: E402
from benchmarks.forgetting.run import Settings, get_pretrained  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ft-steps", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "compare_em.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lm_eval").setLevel(logging.ERROR)

    s = Settings()
    splits = lib.load_splits(s.n_replay, s.n_eval, s.n_gsm_train, s.n_gsm_test)
    tok, model, _, _ = get_pretrained(s, splits, lib.cache_dir())
    theta0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    train = [lib.make_sample(tok, m.prompt, m.target, s.gsm_max_len, label_prompt=False) for m in splits.gsm_train]
    lib.pretrain(model, train, args.ft_steps, s.ft_lr["full"], s.ft_batch, s.seed, tok.pad_id, log_every=0)
    finetuned = {k: v.detach().clone() for k, v in model.state_dict().items()}
    harness = lib.HarnessEM(tok, {"nq": splits.nq_eval, "wq": splits.wq_eval}, max_new_tokens=16)

    rows = []
    for a in (0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        model.load_state_dict({k: theta0[k] + a * (finetuned[k] - theta0[k]) for k in theta0})
        t0 = time.perf_counter()
        direct = {name: lib.exact_match(lib.greedy_answers(model, tok, [q.prompt for q in qas], 16), qas)
                  for name, qas in (("nq", splits.nq_eval), ("wq", splits.wq_eval))}
        t1 = time.perf_counter()
        through = harness(model, ["nq", "wq"])
        t2 = time.perf_counter()
        rows.append({"a": a, "direct": direct, "harness": through, "direct_seconds": t1 - t0,
                     "harness_seconds": t2 - t1})
        print(f"a={a:.1f}  NQ EM direct {direct['nq']:5.1f} harness {through['nq']:5.1f}   "
              f"WQ EM direct {direct['wq']:5.1f} harness {through['wq']:5.1f}   ({t1 - t0:.1f}s / {t2 - t1:.1f}s)",
              flush=True)
    diff = max(abs(r["direct"][k] - r["harness"][k]) for r in rows for k in ("nq", "wq"))
    print(f"largest difference: {diff:.2f} EM points over {2 * len(rows)} scores")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"ft_steps": args.ft_steps, "rows": rows, "max_abs_difference": diff,
                   "torch": torch.__version__}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
