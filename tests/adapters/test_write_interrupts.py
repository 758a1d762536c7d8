"""Ctrl-C anywhere in a write: the adapter write-back and the merged write put the PEFT model back exactly as
training left it; an interrupted full-weight save leaves no output and no temporary folder.

The interruption is a ``KeyboardInterrupt`` raised between two lines of hf-janus's own code, as a signal handler
would raise it, at points drawn at random from every line the write executes (first and last included).
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch
from merge_fixtures import fast_config, load_base, save_base, train_adapter, write_jsonl
from peft import LoraConfig, PeftModel, get_peft_model
from testing_utils import build_tiny

import hf_janus
from hf_janus import JanusMerger
from hf_janus.adapters.live.rectify import PeftOutput, rectify_live_peft
from hf_janus.adapters.peft_layers import adapted_linear_layers, initial_state

EXACT = fast_config(replay_batch_size=4)
PACKAGE = os.path.dirname(hf_janus.__file__)
IDS = torch.tensor([[1, 5, 9, 13, 2, 30, 11, 4], [7, 3, 3, 40, 12, 6, 8, 19]])
REPLAY = [{"input_ids": row}
          for row in torch.randint(4, 40, (8, 10), generator=torch.Generator().manual_seed(3)).tolist()]


class InterruptAt:
    """Counts the lines hf-janus executes while a frame named in ``within`` is on the stack, and raises
    ``KeyboardInterrupt`` at line ``at`` (``None``: only count)."""

    def __init__(self, within: set[str], at=None):
        self.within, self.at, self.count, self.depth = within, at, 0, 0

    def __enter__(self):
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        return False

    def _call(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        if frame.f_code.co_name in self.within:
            self.depth += 1
        return self._line if (self.depth or frame.f_code.co_name in self.within) else None

    def _line(self, frame, event, arg):
        if event == "return" and frame.f_code.co_name in self.within:
            self.depth -= 1
        elif event == "line" and self.depth:
            self.count += 1
            if self.count == self.at:
                raise KeyboardInterrupt
        return self._line


def points(total: int, seed: int, n: int = 4) -> list[int]:
    rng = random.Random(seed)
    return sorted({1, total, *rng.sample(range(1, total + 1), min(n, total))})


def lora_model(**kw):
    torch.manual_seed(0)
    model = get_peft_model(build_tiny("gpt2"), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                                                         fan_in_fan_out=True, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.05)
    return model


def snapshot(model):
    """Everything a write may change: every tensor, the ranks, scalings and merge state of every tuner layer, the
    adapter config's patterns, and the outputs."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layers = {n: (dict(m.r), dict(m.scaling), list(m.merged_adapters)) for n, m in model.named_modules()
              if isinstance(m, BaseTunerLayer)}
    config = model.peft_config["default"]
    patterns = (dict(config.rank_pattern or {}), dict(config.alpha_pattern or {}))
    adapters = (sorted(model.peft_config), list(model.active_adapters))
    with torch.no_grad():
        return dict(tensors=tensors, layers=layers, patterns=patterns, adapters=adapters,
                    logits=model(input_ids=IDS).logits)


def same(a, b) -> bool:
    return (a["layers"] == b["layers"] and a["patterns"] == b["patterns"] and a["adapters"] == b["adapters"]
            and a["tensors"].keys() == b["tensors"].keys()
            and all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])
            and torch.equal(a["logits"], b["logits"]))


def run_write(model, initial, output, at=None):
    within = {"_write_adapter"} if output.format == "adapter" else {"_merge"}
    with InterruptAt(within, at) as trace:
        rectify_live_peft(model, initial, REPLAY, EXACT, output, progress=False)
    return trace.count


@pytest.mark.parametrize("output", [PeftOutput("adapter", rank=2), PeftOutput("adapter", rank="same"),
                                    PeftOutput("adapter", rank=2, new_adapter_name="janus"), PeftOutput("merged")],
                         ids=["adapter-rank-2", "adapter-same", "adapter-beside", "merged"])
def test_interrupted_live_write_is_all_or_nothing(tmp_path, output):
    model = lora_model(lora_bias=True)
    initial = initial_state(adapted_linear_layers(model))
    before = snapshot(model)
    total = run_write(model, initial, output)  # an uninterrupted run counts the write's lines
    done = snapshot(model)
    assert total > 20 and not torch.equal(done["logits"], before["logits"])
    restored = 0
    for at in points(total, seed=len(output.format) + (output.rank == 2)):
        model = lora_model(lora_bias=True)
        with pytest.raises(KeyboardInterrupt):
            run_write(model, initial, output, at=at)
        after = snapshot(model)
        # Put back exactly, or (interrupted after its last step) the complete write: never anything between.
        assert same(after, before) or same(after, done), f"interrupted at line {at} of {total}"
        restored += same(after, before)
        if same(after, before):  # the put-back adapter still saves and reloads to the same outputs
            model.save_pretrained(tmp_path / f"adapter-{at}")
            reloaded = PeftModel.from_pretrained(build_tiny("gpt2"), tmp_path / f"adapter-{at}")
            torch.testing.assert_close(reloaded(input_ids=IDS).logits, before["logits"], rtol=0, atol=1e-6)
    assert restored >= 2  # the early points (line 1 included) cannot have completed the write


def test_interrupted_full_save_leaves_no_output(tmp_path):
    base = save_base(tmp_path / "base")
    adapter = train_adapter(base, tmp_path / "adapter", "lora")
    replay = write_jsonl(tmp_path / "replay.jsonl", [{"input_ids": r["input_ids"]} for r in REPLAY])
    result = JanusMerger(base, adapter, replay, EXACT, progress=False).run()
    rectified = {k: v.clone() for k, v in result.model.state_dict().items()}
    with InterruptAt({"save_full", "save_adapter"}) as trace:
        result.save_full(tmp_path / "dry-full")
    full_total = trace.count
    with InterruptAt({"save_full", "save_adapter"}) as trace:
        result.save_adapter(tmp_path / "dry-adapter", adapter_rank=8)
    adapter_total = trace.count
    for kind, total in (("full", full_total), ("adapter", adapter_total)):
        for at in points(total, seed=7):
            out = tmp_path / f"{kind}-{at}"
            with pytest.raises(KeyboardInterrupt):
                with InterruptAt({"save_full", "save_adapter"}, at):
                    result.save_full(out) if kind == "full" else result.save_adapter(out, adapter_rank=8)
            assert not out.exists(), f"{kind}: interrupted at line {at} of {total}"
            assert [p for p in os.listdir(tmp_path) if p.startswith(f".{out.name}")] == []
    # the rectified model in memory is untouched, and a save after the interruptions works
    for key, value in rectified.items():
        assert torch.equal(result.model.state_dict()[key], value)
    result.save_full(tmp_path / "full")
    torch.testing.assert_close(load_base(tmp_path / "full")(input_ids=IDS).logits,
                               result.model(input_ids=IDS).logits, rtol=0, atol=1e-6)
