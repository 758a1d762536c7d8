#!/usr/bin/env python
"""PiSSA fine-tuning with ``Trainer`` + ``JanusCallback``: the adapter starts from the principal singular
directions of each weight, and JANUS rectifies what training changed against forgetting.

    python examples/finetune_pissa.py --model Qwen/Qwen2.5-0.5B --output-dir out/pissa   # a GPU and Hub access
    python examples/finetune_pissa.py --tiny --output-dir /tmp/janus-pissa               # offline, CPU, seconds

PiSSA moves the top-r singular part of every adapted weight into the adapter, so the base layer holds a
*residual* weight and the adapter's initial product is not zero. JanusCallback therefore takes θ0 as the
*effective* weight (residual + initial adapter product) at train begin, rectifies effective weight − θ0, and
writes the result back into the PiSSA factors at the adapter's own rank (PEFT rebuilds the residual base at that
rank when it loads the adapter, so the rank cannot change; ``--init pissa_niter_4`` is the fast randomized SVD
for large models).

Outputs in ``--output-dir``:

* ``adapter-init/``: the adapter right after initialization (as PEFT's PiSSA examples save it);
* ``adapter-rectified/``: the rectified PiSSA adapter as ``trainer.save_model()`` saves it; loading it with
  ``PeftModel.from_pretrained`` on the original base re-runs the PiSSA init of the base;
* ``adapter-rectified-lora/``: the same adapter converted to a plain rank-2r LoRA relative to the *original*
  base (``path_initial_model_for_weight_conversion``), loadable and mergeable like any LoRA;
* ``results.json`` and ``janus_rectification.json``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the example; returns the table ``{model name: {"past_nll", "new_nll"}}``."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer

    from hf_janus import JanusCallback

    parser = common.build_parser(__doc__.splitlines()[1], lr=2e-5, tiny_lr=1e-3)
    parser.add_argument("--lora-rank", type=int, default=16, help="PiSSA rank r")
    parser.add_argument("--target-modules", nargs="+", default=["all-linear"], help="adapted modules")
    parser.add_argument("--init", default="pissa", help="init_lora_weights: pissa (exact SVD) or pissa_niter_N")
    run = common.start(parser, argv)
    args, started, model, tokenizer, data, rows = run.args, run.started, run.model, run.tokenizer, run.data, run.rows
    pad_id = run.pad_id
    targets = common.lora_targets(args)
    pissa = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, target_modules=targets, lora_dropout=0.0,
                       init_lora_weights=args.init, task_type="CAUSAL_LM")
    model = get_peft_model(model, pissa)
    init_dir = os.path.join(args.output_dir, "adapter-init")
    config = model.peft_config["default"]
    config.init_lora_weights = True  # saved as a plain init: it is only ever used for the conversion below
    model.save_pretrained(init_dir)
    config.init_lora_weights = args.init

    janus = JanusCallback(data.replay, common.janus_config(args), peft_output="adapter", adapter_rank="same")
    probe = common.measure_at_train_end(data, pad_id, rows, f"PiSSA r={args.lora_rank} fine-tuned")
    trainer = Trainer(model=model, args=common.training_args(args), train_dataset=data.train,
                      data_collator=common.Collator(pad_id), callbacks=[probe, janus])
    janus.trainer = trainer
    trainer.train()
    rows["+ JanusCallback (in memory)"] = common.measure(trainer.model, data, pad_id)
    print(janus.report.summary())

    device = trainer.model.device
    out_dir = os.path.join(args.output_dir, "adapter-rectified")
    trainer.save_model(out_dir)
    tokenizer.save_pretrained(out_dir)
    lora_dir = os.path.join(args.output_dir, "adapter-rectified-lora")
    trainer.model.save_pretrained(lora_dir, path_initial_model_for_weight_conversion=init_dir)

    base = lambda: AutoModelForCausalLM.from_pretrained(args.model).to(device)  # noqa: E731
    rows["+ JanusCallback, reloaded PiSSA"] = common.measure(PeftModel.from_pretrained(base(), out_dir), data, pad_id)
    rows["+ JanusCallback, reloaded as LoRA"] = common.measure(PeftModel.from_pretrained(base(), lora_dir), data,
                                                               pad_id)
    print()
    common.print_table(rows)
    results = common.save_results(args, rows, janus.report, started)
    print(f"\nadapters and {results} written to {args.output_dir}")
    if args.push_to_hub:
        print("pushed:", common.push_folder(lora_dir, args.push_to_hub))
    return rows


if __name__ == "__main__":
    main()
