#!/usr/bin/env python
"""Full fine-tuning with ``transformers.Trainer`` + ``JanusCallback``: learn GSM8K, forget less NQ-open.

    python examples/finetune_full.py --model Qwen/Qwen2.5-0.5B --output-dir out/full    # a GPU and Hub access
    python examples/finetune_full.py --tiny --output-dir /tmp/janus-full                 # offline, CPU, seconds

What it does:

1. loads the model, GSM8K (the new task) and NQ-open (the past task: what the model should keep knowing);
2. measures the answer NLL of both tasks on examples that are neither trained on nor replayed;
3. fine-tunes every weight on GSM8K with ``Trainer``; ``JanusCallback`` snapshots θ0 on the CPU when training
   starts and, when it ends, rectifies the weight update against forgetting by replaying ``--replay-samples``
   NQ-open examples (τ, β, r from the command line);
4. measures again (the row "fine-tuned" is taken just before JANUS runs), prints the table and the
   rectification summary, saves the rectified model + tokenizer + ``janus_rectification.json`` and
   ``results.json`` to ``--output-dir`` and, with ``--push-to-hub``, uploads that directory.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the example; returns the table ``{model name: {"past_nll", "new_nll"}}``."""
    from transformers import Trainer

    from hf_janus import JanusCallback

    parser = common.build_parser(__doc__.splitlines()[1], lr=1e-5, tiny_lr=1e-3)
    parser.add_argument("--snapshot", choices=["cpu", "disk"], default="cpu",
                        help="keep θ0 in host memory or in a safetensors file in --output-dir (large models)")
    run = common.start(parser, argv)
    args, started, model, tokenizer, data, rows = run.args, run.started, run.model, run.tokenizer, run.data, run.rows
    pad_id = run.pad_id

    janus = JanusCallback(data.replay, common.janus_config(args), snapshot=args.snapshot)
    probe = common.measure_at_train_end(data, pad_id, rows, "fine-tuned (θ̂)")  # runs before janus
    trainer = Trainer(model=model, args=common.training_args(args), train_dataset=data.train,
                      data_collator=common.Collator(pad_id), callbacks=[probe, janus])
    janus.trainer = trainer  # janus/* figures go through trainer.log (wandb, tensorboard, ...)
    trainer.train()  # fine-tune, then rectify in place
    rows["JANUS-rectified"] = common.measure(trainer.model, data, pad_id)

    common.print_table(rows)
    print()
    print(janus.report.summary())
    trainer.save_model(args.output_dir)  # the rectified weights
    tokenizer.save_pretrained(args.output_dir)
    print(f"\nrectified model, janus_rectification.json and {common.save_results(args, rows, janus.report, started)} "
          f"written to {args.output_dir}")
    if args.push_to_hub:
        print("pushed:", common.push_folder(args.output_dir, args.push_to_hub))
    return rows


if __name__ == "__main__":
    main()
