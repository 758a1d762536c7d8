#!/usr/bin/env python
"""LoRA fine-tuning with ``Trainer`` + ``JanusCallback``, then the same adapter rectified offline with
``JanusMerger``: two ways to get a LoRA adapter that forgets less.

    python examples/finetune_lora.py --model Qwen/Qwen2.5-0.5B --output-dir out/lora    # a GPU and Hub access
    python examples/finetune_lora.py --tiny --output-dir /tmp/janus-lora                 # offline, CPU, seconds
    python examples/finetune_lora.py --tiny --load-in-4bit --output-dir /tmp/janus-qlora # QLoRA (bitsandbytes)

1. A LoRA adapter (``--lora-rank``, every linear layer) is trained on GSM8K with ``Trainer``.
   ``JanusCallback(peft_output="adapter")`` snapshots the effective weights of the adapted layers at train begin
   and, at train end, rectifies each layer's update and writes it back into the LoRA factors (truncated SVD at
   ``--adapter-rank``), so ``trainer.save_model()`` saves a stock adapter: ``OUTPUT/adapter-rectified``.
   (``--peft-output merged`` instead saves the merged full model.)
2. Unless ``--skip-merger``: the *un-rectified* adapter of the same run is saved too (``OUTPUT/adapter``) and
   rectified afterwards from disk with ``JanusMerger`` — what you would do with an adapter somebody else trained
   (``hf-janus merge`` is the same from the shell). Result: ``OUTPUT/adapter-merger-rectified``.

With ``--load-in-4bit`` (QLoRA) the base is loaded in 4 bits (nf4, double quantization) for training, and both
rectifications work against that quantized base: θ0 is the dequantized base, the update goes into the adapter,
the base stays as it is. Every adapter is reloaded with stock ``PeftModel.from_pretrained`` and measured.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402


def rank_spec(text: str):
    """``same``/``auto``, an int rank, or a float energy threshold."""
    if text in ("same", "auto"):
        return text
    return float(text) if "." in text else int(text)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the example; returns the table ``{model name: {"past_nll", "new_nll"}}``."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback

    from hf_janus import JanusCallback, JanusMerger

    parser = common.build_parser(__doc__.splitlines()[1], lr=2e-4, tiny_lr=5e-3)
    parser.add_argument("--lora-rank", type=int, default=16, help="LoRA rank r")
    parser.add_argument("--lora-alpha", type=float, default=32, help="LoRA alpha")
    parser.add_argument("--target-modules", nargs="+", default=["all-linear"], help="LoRA target modules")
    parser.add_argument("--adapter-rank", type=rank_spec, default="same",
                        help="rank of the rectified adapter: same, auto, an int, or a float energy threshold")
    parser.add_argument("--peft-output", choices=["adapter", "merged"], default="adapter",
                        help="what JanusCallback leaves: a rectified adapter or the merged full model")
    parser.add_argument("--skip-merger", action="store_true", help="do not also rectify with JanusMerger")
    parser.add_argument("--load-in-4bit", action="store_true",
                        help="QLoRA: train the adapter on the base quantized to 4 bits with bitsandbytes")
    run = common.start(parser, argv)
    args, started, model, tokenizer, data, rows = run.args, run.started, run.model, run.tokenizer, run.data, run.rows
    pad_id = run.pad_id
    quantization = None
    if args.load_in_4bit:
        import torch
        from transformers import BitsAndBytesConfig

        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=torch.float32)
        device_map = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(args.model, quantization_config=quantization,
                                                     device_map=device_map)
    targets = common.lora_targets(args)
    lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=targets, lora_dropout=0.0,
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.print_trainable_parameters()

    raw_dir = os.path.join(args.output_dir, "adapter")

    class SaveRawAdapter(TrainerCallback):
        """Keep a copy of the adapter as trained (before JANUS) for the JanusMerger part."""

        def on_train_end(self, targs, state, control, model=None, **kwargs):
            if not args.skip_merger:
                model.save_pretrained(raw_dir)

    janus = JanusCallback(data.replay, common.janus_config(args), peft_output=args.peft_output,
                          adapter_rank=args.adapter_rank)
    kind = "QLoRA" if quantization is not None else "LoRA"
    probe = common.measure_at_train_end(data, pad_id, rows, f"{kind} r={args.lora_rank} fine-tuned")
    trainer = Trainer(model=model, args=common.training_args(args), train_dataset=data.train,
                      data_collator=common.Collator(pad_id), callbacks=[probe, SaveRawAdapter(), janus])
    janus.trainer = trainer  # needed for peft_output="merged" (it replaces trainer.model)
    trainer.train()
    print(janus.report.summary())

    out_dir = os.path.join(args.output_dir, "adapter-rectified" if args.peft_output == "adapter" else "merged")
    trainer.save_model(out_dir)
    tokenizer.save_pretrained(out_dir)
    if quantization is None:
        base = lambda: AutoModelForCausalLM.from_pretrained(args.model).to(trainer.model.device)  # noqa: E731
    else:  # the rectified adapter goes on a freshly quantized base, as a QLoRA adapter is used
        base = lambda: AutoModelForCausalLM.from_pretrained(  # noqa: E731
            args.model, quantization_config=quantization, device_map=str(trainer.model.device))
    if args.peft_output == "adapter":
        rows["+ JanusCallback (adapter)"] = common.measure(PeftModel.from_pretrained(base(), out_dir), data, pad_id)
    else:
        merged = AutoModelForCausalLM.from_pretrained(out_dir).to(trainer.model.device)
        rows["+ JanusCallback (merged)"] = common.measure(merged, data, pad_id)

    extra = {}
    if not args.skip_merger:
        merger = JanusMerger(args.model, raw_dir, data.replay, common.janus_config(args),
                             device=str(trainer.model.device), progress=not args.tiny,
                             quantization_config=quantization)
        delta = merger.run()
        merger_dir = os.path.join(args.output_dir, "adapter-merger-rectified")
        delta.save_adapter(merger_dir, adapter_rank=args.adapter_rank, overwrite=True, progress=not args.tiny)
        rows["+ JanusMerger (adapter)"] = common.measure(PeftModel.from_pretrained(base(), merger_dir), data, pad_id)
        extra["merger_replay_loss"] = dict(delta.report.rectification.replay_loss)

    print()
    common.print_table(rows)
    results = common.save_results(args, rows, janus.report, started, **extra)
    print(f"\nadapters and {results} written to {args.output_dir}")
    if args.push_to_hub:
        print("pushed:", common.push_folder(out_dir, args.push_to_hub))
    return rows


if __name__ == "__main__":
    main()
