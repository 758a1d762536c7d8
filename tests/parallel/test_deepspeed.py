"""DeepSpeed ZeRO-3 (partitioned parameters): 2 CPU processes (gloo) rectify the module of a ZeRO-3 engine as one
process rectifies the unpartitioned model, restore θ̂ exactly on failure, and JanusCallback snapshots θ0 whole."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from testing_utils import build_tiny, random_replay
from sharded_checks import (
    check_matches_single_process,
    fail_between_passes,
    fail_during_backward,
    assert_restored,
    injected,
    setup_model,
    rank_process,
    spawn_two,
)

from hf_janus import JanusConfig, rectify
from hf_janus.engine.rectifier import Rectifier

pytestmark = pytest.mark.distributed  # several processes; see pyproject.toml's markers

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")

# 10-13 captures: a pass costs more under ZeRO-3's hooks
CONFIG = dict(compression_rank=4, replay_batch_size=2, tau=0.8)
SAMPLE_COUNTS = (5, 2)  # 3 batches: rank 1 repeats one to match rank 0's passes; 1 batch: rank 1's share is empty


def _ds_config(bf16: bool = False) -> dict:
    # persistence_threshold 0: every weight stays partitioned between passes (the default keeps small ones whole).
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "torch_adam": True}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _engine(model: torch.nn.Module, bf16: bool = False):
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_ds_config(bf16))
    return engine


def _train(engine, steps: int, rank: int, world: int) -> None:
    """A few optimizer steps of the engine on this rank's share of a toy task."""
    data = torch.randint(0, 48, (8, 10), generator=torch.Generator().manual_seed(2))[rank::world]
    engine.train()
    for step in range(steps):
        ids = data[step % len(data)][None]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.eval()


def _full_state(model: torch.nn.Module) -> dict:
    """Every parameter whole, in registration order (each gather is a collective)."""
    from hf_janus.parallel.sharding import full_weight

    return {name: full_weight(p).clone() for name, p in model.named_parameters()}


def _master_state(model: torch.nn.Module, names) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    params = dict(model.named_parameters())
    return {name: safe_get_full_fp32_param(params[name]).clone() for name in names}


def _target_is_partitioned(model: torch.nn.Module) -> bool:
    weight = model.model.layers[0].self_attn.q_proj.weight
    return weight.numel() == 0 and weight.ds_tensor.numel() == weight.ds_numel // 2


def _init(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # reuses the process group above


_setup = setup_model


# ---- rectify() on a partitioned model ---------------------------------------------------------------------

def _rectify_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    _init(rank, world, init_file)
    with rank_process():
        results = {}
        for n_samples in SAMPLE_COUNTS:
            model, reference = _setup()
            module = _engine(model).module
            rectifier = Rectifier(module, reference, random_replay(n_samples), JanusConfig(**CONFIG), progress=False)
            report = rectifier.run().report
            targets = [f"{layer.name}.weight" for layer in rectifier.layers]
            results[n_samples] = {
                "state": _full_state(module), "master": _master_state(module, targets), "report": report.to_dict(),
                "still_partitioned": _target_is_partitioned(module),
                "passes": (len(rectifier.local_batches), len(rectifier.idle_batches)),
            }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_zero3_rectify_matches_unpartitioned(tmp_path):
    ranks = spawn_two(_rectify_worker, tmp_path)
    torch.set_num_threads(1)
    for n_samples in SAMPLE_COUNTS:
        partitioned = [r[n_samples] for r in ranks]
        targets = check_matches_single_process(partitioned, n_samples, CONFIG, "still_partitioned")
        for result in partitioned:  # the optimizer's fp32 master copy follows: a later step starts from θ_rect
            assert set(result["master"]) == targets
            for key, value in result["master"].items():
                assert torch.equal(value, result["state"][key]), key


# ---- failures leave θ̂ exactly ----------------------------------------------------------------------------

def _fail_during_forward(patch, hooks):
    """The second-to-last target layer's forward hook raises in the first trial: the pass stops half-way, some
    weights gathered and DeepSpeed's module trace half-recorded."""
    import hf_janus.engine.capture as capture

    original_hook = capture._LayerRecorder.forward_hook

    def forward_hook(self, module, inputs, output):
        if hooks.now.startswith("s") and self.name == "model.layers.1.mlp.up_proj":
            raise RuntimeError("injected failure in the trial's forward")
        return original_hook(self, module, inputs, output)

    patch(capture._LayerRecorder, "forward_hook", forward_hook)


# name -> (injection, bf16): under bf16 the optimizer's fp32 master copy differs from the weights after training.
FAILURES = {"forward": (_fail_during_forward, False), "backward": (fail_during_backward, False),
            "between_passes": (fail_between_passes, False), "between_passes_bf16": (fail_between_passes, True)}


def _failure_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from hf_janus.engine.capture import replay_losses
    from hf_janus.errors import JanusError, RectificationError
    from hf_janus.replay.prepare import prepare_replay

    _init(rank, world, init_file)
    with rank_process():
        results = {}
        for name, (inject, bf16) in FAILURES.items():
            model, reference = _setup()
            engine = _engine(model, bf16=bf16)
            if bf16:
                _train(engine, 2, rank, world)
            module = engine.module
            targets = [n for n, _ in module.named_parameters() if "layers." in n and "proj" in n]
            batches = prepare_replay(random_replay(5), 2)
            before, master_before = _full_state(module), _master_state(module, targets)
            loss_before = replay_losses(module, batches).loss
            with injected(inject) as hooks:
                try:
                    Rectifier(module, reference, random_replay(5), JanusConfig(**CONFIG), progress=False,
                              observer=hooks).run()
                    error = None
                except RectificationError as err:
                    error = str(err)
            results[name] = {
                "error": error, "before": before, "after": _full_state(module),
                "master": (master_before, _master_state(module, targets)),
                "master_differs": any(not torch.equal(m, before[n].float()) for n, m in master_before.items()),
                "still_partitioned": _target_is_partitioned(module),
                "requires_grad": all(p.requires_grad for p in module.parameters()),
                # The model runs again, on the restored weights.
                "losses": (loss_before, replay_losses(module, batches).loss),
            }
        # Parameters partitioned without the engine's hooks: the forward could not gather them, refused up front.
        import deepspeed

        with deepspeed.zero.Init(config_dict_or_path=_ds_config()):
            bare = build_tiny("llama")
        try:
            Rectifier(bare, reference, random_replay(5), JanusConfig(**CONFIG), progress=False)
            results["no_engine"] = None
        except JanusError as err:
            results["no_engine"] = str(err)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_failure_restores_partitioned_weights_exactly(tmp_path):
    ranks = spawn_two(_failure_worker, tmp_path)
    for result in ranks:
        for name in FAILURES:
            outcome = result[name]
            assert_restored(outcome, name)
            master_before, master_after = outcome["master"]
            for key, value in master_before.items():  # the optimizer's master copy is restored as well
                assert torch.equal(master_after[key], value), f"{name}: the master copy of {key} changed"
            assert outcome["still_partitioned"] and outcome["requires_grad"]
            assert outcome["losses"][1] == outcome["losses"][0]
        assert result["between_passes_bf16"]["master_differs"]
        assert "engine.module" in result["no_engine"]


# ---- JanusCallback in a Trainer run with DeepSpeed ZeRO-3 ---------------------------------------------------

def _trainer_worker(rank: int, world: int, init_file: str, out_dir: str, port: int) -> None:
    """transformers' Trainer with ``deepspeed=`` (ZeRO-3 on the CPU accelerator) and JanusCallback, end to end."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_janus.integrations.trainer import JanusCallback

    torch.set_num_threads(1)
    # What a launcher (deepspeed, torchrun, accelerate) sets; Trainer initializes the process group itself.
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with rank_process():
        class Probe(TrainerCallback):
            """Placed before JanusCallback: sees the fine-tuned weights just before the rectification."""

            def on_train_end(self, args, state, control, model=None, **kwargs):
                self.finetuned = _full_state(model)

        ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                     "train_batch_size": "auto", "zero_optimization": {
                         # k_proj, v_proj (128 elements) and the norms stay whole between passes, as small
                         # weights do by default; the other weights (256 elements and more) stay partitioned.
                         "stage": 3, "stage3_param_persistence_threshold": 200,
                         "stage3_gather_16bit_weights_on_model_save": True}}
        args = TrainingArguments(output_dir=out_dir, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
                                 report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
                                 remove_unused_columns=False, seed=0, deepspeed=ds_config, use_cpu=True)
        gen = torch.Generator().manual_seed(2)
        train = [{"input_ids": torch.randint(0, 48, (10,), generator=gen).tolist()} for _ in range(12)]

        def collate(samples):
            ids = torch.tensor([s["input_ids"] for s in samples])
            return {"input_ids": ids, "labels": ids}

        probe, janus = Probe(), JanusCallback(random_replay(6), JanusConfig(**CONFIG))
        model = build_tiny("llama")
        trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collate, callbacks=[probe, janus])
        trainer.train()
        targets = [f"{layer.name}.weight" for layer in janus.report.layers]
        result = {"theta0": janus.theta0(), "finetuned": probe.finetuned, "state": _full_state(trainer.model),
                  "master": _master_state(trainer.model, targets), "report": janus.report.to_dict(),
                  "engine": type(trainer.model_wrapped).__name__,
                  "still_partitioned": _target_is_partitioned(trainer.model)}
        trainer.save_model(os.path.join(out_dir, "final"))  # gathers the 16-bit weights: a collective
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_callback_in_deepspeed_trainer(tmp_path):
    from safetensors.torch import load_file

    from hf_janus.publish.record_file import REPORT_NAME

    ranks = spawn_two(_trainer_worker, tmp_path, _free_port())
    initial = build_tiny("llama").state_dict()
    for result in ranks:
        assert result["engine"] == "DeepSpeedEngine" and result["still_partitioned"]
        theta0 = result["theta0"]
        assert len(theta0) == 14
        for key, value in theta0.items():  # whole weights on the host, taken before training
            assert type(value) is torch.Tensor and value.device.type == "cpu"
            assert torch.equal(value, initial[key]), key
        for key, value in result["master"].items():  # the fp32 master copy a DeepSpeed checkpoint would save
            assert torch.equal(value, result["state"][key]), key
    for key, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][key]), f"{key} differs between ranks"
    assert os.path.isfile(tmp_path / REPORT_NAME)
    saved = load_file(tmp_path / "final" / "model.safetensors")
    for key, value in ranks[0]["state"].items():  # what Trainer.save_model wrote is the rectified model
        assert torch.equal(saved[key], value), key

    torch.set_num_threads(1)
    twin = build_tiny("llama")
    twin.load_state_dict(ranks[0]["finetuned"])
    single = rectify(twin, ranks[0]["theta0"], random_replay(6), JanusConfig(**CONFIG), progress=False)
    assert [s["alpha"] for s in ranks[0]["report"]["steps"]] == single.alphas
    for key, value in twin.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=0, atol=1e-6)
        # Non-target weights keep their fine-tuned values exactly; targets moved.
        assert torch.equal(ranks[0]["state"][key], ranks[0]["finetuned"][key]) == (key not in ranks[0]["theta0"]), key
