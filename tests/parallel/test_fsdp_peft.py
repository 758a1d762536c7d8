"""A LoRA model sharded with FSDP2 (``fully_shard`` on each decoder layer and on the PeftModel, as accelerate shards
it): 2 CPU processes (gloo) run ``JanusCallback`` around a training loop and end with identical adapters, equal to
one process rectifying the unsharded model; a failure leaves θ̂ bit for bit and the model trains on; outputs that
would give the layers new parameters are refused at train begin."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from merge_fixtures import save_base
from sharded_checks import fsdp_full_state, rank_process, spawn_two
from testing_utils import VOCAB, build_tiny, random_replay, train_steps

from hf_janus import JanusConfig

pytestmark = pytest.mark.distributed  # several processes; see pyproject.toml's markers

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

CONFIG = dict(compression_rank=4, replay_batch_size=2, tau=0.95)
REPLAY = 6


def _lora(**lora):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    return get_peft_model(build_tiny("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], **lora))


def _qlora(base_dir: str):
    """A LoRA on a 4-bit base stored as float32, as FSDP-QLoRA needs (bnb_4bit_quant_storage)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                               bnb_4bit_quant_storage=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=quant, device_map="cpu")
    torch.manual_seed(5)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def _shard(model, layers: bool = True):
    """``fully_shard`` on each decoder layer (unless not ``layers``), then on the PeftModel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.base_model.model.model.layers if layers else ():
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model, rank: int, world: int, steps: int = 6) -> float:
    """A few AdamW steps on this rank's share of random sequences (the adapter trains); the last loss."""
    data = torch.randint(0, VOCAB, (8, 10), generator=torch.Generator().manual_seed(2))[rank::world]
    return train_steps(model, data, steps, lr=5e-2)


def _arguments(rank: int, out_dir: str):
    from transformers import TrainerState

    args = SimpleNamespace(output_dir=out_dir, process_index=rank, fsdp="full_shard", deepspeed=None,
                           disable_tqdm=True, learning_rate=1e-3)
    return args, TrainerState(is_world_process_zero=rank == 0, is_local_process_zero=rank == 0)


def _refusals(rank: int, out_dir: str) -> dict:
    """What train begin says of the outputs FSDP2 cannot take."""
    from transformers import TrainerControl

    from hf_janus.errors import JanusError
    from hf_janus.integrations.trainer import JanusCallback

    cases = {"adapter_rank": dict(adapter_rank=1),
             "merged": dict(peft_output="merged", trainer=SimpleNamespace(train=lambda: None)),
             "new_adapter": dict(new_adapter_name="rectified"),
             "repair": dict(config=JanusConfig(distill_steps=2))}
    cases["root_only"] = cases["dora"] = {}
    messages = {}
    for name, kwargs in cases.items():
        args, state = _arguments(rank, out_dir)
        model = _shard(_lora(use_dora=name == "dora"), layers=name != "root_only")
        try:
            JanusCallback(random_replay(2), **kwargs).on_train_begin(args, state, TrainerControl(), model=model)
            messages[name] = None
        except JanusError as err:
            messages[name] = str(err)
    return messages


def _worker(rank: int, world: int, init_file: str, out_dir: str, base_dir: str) -> None:
    import hf_janus.engine.capture as capture
    from transformers import TrainerControl

    from hf_janus.errors import RectificationError
    from hf_janus.integrations.trainer import JanusCallback

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with rank_process():
        out = {}
        for case in ("rectify", "fail", "qlora"):
            model = _shard(_qlora(base_dir) if case == "qlora" else _lora())
            args, state = _arguments(rank, out_dir)
            janus = JanusCallback(random_replay(REPLAY), JanusConfig(**CONFIG), on_error="raise")
            janus.on_train_begin(args, state, TrainerControl(), model=model)
            theta0 = janus.theta0()
            _train(model, rank, world)
            finetuned = fsdp_full_state(model)
            error = None
            original = capture.begin_compression
            if case == "fail":  # the first capture's backward raises: FSDP2 is left mid-backward
                def begin_compression(*a, **k):
                    raise RuntimeError("injected failure in a backward")
                capture.begin_compression = begin_compression
            try:
                janus.on_train_end(args, state, TrainerControl(), model=model)
            except RectificationError as err:
                error = str(err)
            finally:
                capture.begin_compression = original
            out[case] = {"theta0": theta0, "finetuned": finetuned, "state": fsdp_full_state(model), "error": error,
                         "report": janus.report.to_dict() if janus.report is not None else None,
                         "loss_after": _train(model, rank, world, steps=1)}  # the sharded model still trains
        out["refused"] = _refusals(rank, out_dir)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def _effective(state: dict, layer: str) -> torch.Tensor:
    """The LoRA layer's effective weight from a full state dict (r=2, alpha 8: scaling 4)."""
    base = state[f"{layer}.base_layer.weight"]
    a, b = state[f"{layer}.lora_A.default.weight"], state[f"{layer}.lora_B.default.weight"]
    return base.double() + 4.0 * (b.double() @ a.double())


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _lora_layers(state: dict) -> list[str]:
    return sorted({k.rsplit(".lora_A", 1)[0] for k in state if ".lora_A." in k})


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    # hidden 64: bitsandbytes quantizes in blocks of 64 values
    return save_base(tmp_path_factory.mktemp("fsdp_qlora") / "base", hidden_size=64, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, base_dir):
    return spawn_two(_worker, tmp_path_factory.mktemp("fsdp_peft"), base_dir)


def test_lora_under_fsdp2_matches_one_process(ranks):
    from hf_janus.adapters.live.rectify import PeftOutput, rectify_live_peft

    torch.set_num_threads(1)
    run = ranks[0]["rectify"]
    for key, value in run["state"].items():
        assert torch.equal(value, ranks[1]["rectify"]["state"][key]), f"{key} differs between ranks"
    layers = _lora_layers(run["state"])
    assert len(layers) == 4
    for key, value in run["state"].items():
        if ".lora_" not in key:  # the base and every other weight keep their values exactly
            assert torch.equal(value, run["finetuned"][key]), key

    single = _lora()
    single.load_state_dict(run["finetuned"])
    report = rectify_live_peft(single, run["theta0"], random_replay(REPLAY), JanusConfig(**CONFIG), PeftOutput(),
                               progress=False).report
    assert [s["alpha"] for s in run["report"]["steps"]] == report.alphas
    assert report.alphas and report.alphas[-1] > 0
    for sharded_layer, one_layer in zip(run["report"]["layers"], report.to_dict()["layers"]):
        assert sharded_layer["name"] == one_layer["name"]
        # the rectified update before it is cut to the adapter's rank: float32 sums in another order
        assert sharded_layer["rect_delta_norm"] == pytest.approx(one_layer["rect_delta_norm"], rel=1e-5)
    expected = single.state_dict()
    for layer in layers:
        sharded, one = _effective(run["state"], layer), _effective(expected, layer)
        assert not torch.equal(sharded, _effective(run["finetuned"], layer)), layer  # the adapter was rectified
        # cutting the update to rank 2 amplifies those last-digit differences
        torch.testing.assert_close(sharded, one, rtol=0, atol=5e-5)


def test_failure_under_fsdp2_leaves_the_trained_adapter_and_the_model_trains_on(ranks):
    for result in ranks:
        failed = result["fail"]
        assert failed["error"] is not None and "injected failure" in failed["error"]
        assert "restored" in failed["error"]
        for key, value in failed["finetuned"].items():
            assert torch.equal(failed["state"][key], value), f"{key} is not θ̂"
        assert torch.isfinite(torch.tensor(failed["loss_after"]))
        refused = result["refused"]
        assert "adapter_rank=1" in refused["adapter_rank"]
        assert "peft_output='merged'" in refused["merged"]
        assert "new_adapter_name='rectified'" in refused["new_adapter"]
        assert "distill_steps" in refused["repair"]
        assert "Apply fully_shard to each decoder layer" in refused["root_only"]
        assert "has a dora adapter: under FSDP2 hf-janus rectifies plain LoRA adapters" in refused["dora"]


def test_qlora_under_fsdp2_matches_one_process(ranks, base_dir):
    """The 4-bit base is never written (its shards pass through untouched); the factors are those one process
    writes on the unsharded QLoRA model."""
    from hf_janus.adapters.live.rectify import PeftOutput, rectify_live_peft

    torch.set_num_threads(1)
    run = ranks[0]["qlora"]
    assert run["error"] is None
    for key, value in run["state"].items():  # bit for bit: the packed 4-bit words read as float32 hold NaNs
        assert _bits(value).equal(_bits(ranks[1]["qlora"]["state"][key])), f"{key} differs between ranks"
        if ".lora_" not in key:
            assert _bits(value).equal(_bits(run["finetuned"][key])), key
    single = _qlora(base_dir)
    single.load_state_dict({k: v for k, v in run["finetuned"].items() if ".lora_" in k}, strict=False)
    report = rectify_live_peft(single, run["theta0"], random_replay(REPLAY), JanusConfig(**CONFIG), PeftOutput(),
                               progress=False).report
    assert [s["alpha"] for s in run["report"]["steps"]] == report.alphas
    expected = single.state_dict()
    factors = [key for key in run["state"] if ".lora_" in key]
    assert len(factors) == 8
    for key in factors:
        assert not torch.equal(run["state"][key], run["finetuned"][key]), key
        torch.testing.assert_close(run["state"][key], expected[key], rtol=0, atol=1e-6)
