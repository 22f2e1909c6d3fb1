"""Device placement, checked without a GPU: the harness of ``fake_cuda.py`` fails where CUDA would, and the
three stages run one step each with every model and tensor they place on the (fake) GPU.

A placement bug (a tensor left on the CPU that meets one on the GPU, a CPU generator sampling a GPU tensor, a
GPU tensor handed to numpy) raises here exactly as on a real GPU, so CI catches it on a CPU-only machine.
"""

from __future__ import annotations

import pytest
import torch

from fake_cuda import OnFakeCuda, fake_cuda
from precompute_helpers import make_recipe, sgd_rows, write_jsonl


def test_the_harness_fails_where_cuda_would(monkeypatch):
    with fake_cuda(monkeypatch):
        assert torch.cuda.is_available()
        gpu, cpu = torch.ones(3, device="cuda"), torch.ones(3)
        assert gpu.device.type == "cuda" and isinstance(gpu, OnFakeCuda)
        with pytest.raises(RuntimeError, match="same device"):
            gpu + cpu
        with pytest.raises(RuntimeError, match="same device"):
            torch.nn.functional.embedding(torch.tensor([0]), gpu[:, None])
        with pytest.raises(RuntimeError, match="generator"):
            torch.multinomial(gpu, 1, generator=torch.Generator())
        with pytest.raises(TypeError, match="numpy"):
            gpu.numpy()
        # What CUDA allows: CPU scalars and CPU indices, copies across devices, reading values back.
        assert (gpu * torch.tensor(2.0)).device.type == "cuda"
        assert gpu[torch.tensor([0, 2])].device.type == "cuda"
        assert (gpu + cpu.to("cuda")).cpu().tolist() == [2.0, 2.0, 2.0]
        layer = torch.nn.Linear(3, 2).to("cuda")
        layer(gpu).sum().backward()
        assert layer.weight.device.type == "cuda" and layer.weight.grad.device.type == "cuda"


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A small recipe, with its features precomputed and an mtp head trained on the CPU (outside the fake device)."""
    from mtp_train.recipe import load_recipe
    from mtp_train.train.trainer import run_train
    from mtp_train.precompute.run import run_precompute

    tmp = tmp_path_factory.mktemp("fake_cuda")
    data = write_jsonl(tmp / "sgd.jsonl", sgd_rows(12, split="train"))
    path = make_recipe(
        tmp, data, data={"heldout_rows": 4}, precompute={"layers": [-1], "topk": 8},
        train={"batch_tokens": 1024, "max_steps": 2, "val_every": 2, "save_every": 2, "unroll": 2,
               "wandb_mode": "disabled"},
        eval={"k": [2], "temperatures": [0.0, 1.0], "prompt_sets": ["heldout"], "max_prompts": 2,
              "max_new_tokens": 6, "batch_size": 2},
    )
    recipe = load_recipe(path)
    run_precompute(recipe)
    run_train(recipe)
    return path


def _copy(path, name: str):
    """The recipe with its own output directory ``name`` beside the original (features and head copied in)."""
    import shutil

    from mtp_train.recipe import load_recipe

    recipe = load_recipe(path)
    out = recipe.output_dir.parent / name
    shutil.rmtree(out, ignore_errors=True)
    return load_recipe(path, [f"output_dir={out}"]), recipe.output_dir, out


@pytest.mark.slow
def test_precompute_places_everything_on_the_gpu(small_run, monkeypatch):
    from mtp_train.precompute.run import run_precompute

    recipe, _, out = _copy(small_run, "precompute_on_gpu")
    with fake_cuda(monkeypatch):
        manifest = run_precompute(recipe)
    assert manifest.total_tokens > 0 and (out / "features" / "manifest.json").is_file()


@pytest.mark.slow
def test_training_places_everything_on_the_gpu(small_run, monkeypatch):
    """Two optimizer steps and a validation: head, frozen target parts, batches, index tensors, loss reduction."""
    import shutil

    from mtp_train.train.trainer import run_train

    from accelerate.state import AcceleratorState

    recipe, original, out = _copy(small_run, "train_on_gpu")
    shutil.copytree(original / "features", out / "features")
    AcceleratorState._reset_state(reset_partial_state=True)  # this process trained in fp32 on the CPU before
    try:
        with fake_cuda(monkeypatch):  # train.mixed_precision: auto is bf16 on CUDA
            head = run_train(recipe)
    finally:  # and later tests of this process train in fp32 again
        AcceleratorState._reset_state(reset_partial_state=True)
    assert (head / "model.safetensors").is_file()


@pytest.mark.slow
def test_speculative_eval_places_everything_on_the_gpu(small_run, monkeypatch):
    """Plain and speculative decoding at T = 0 and T = 1 (sampled drafts), and the runtime validation."""
    import json
    import shutil

    from mtp_train.eval.run import run_eval

    recipe, original, out = _copy(small_run, "eval_on_gpu")
    shutil.copytree(original / "features", out / "features")
    shutil.copytree(original / "heads", out / "heads")
    with fake_cuda(monkeypatch):
        run_eval(recipe)
    report = json.loads((out / "eval" / "report.json").read_text())
    assert report["lossless"] is True


def test_a_tensor_parallel_rank_binds_its_own_gpu(monkeypatch):
    """Under torchrun, rank r's tensors and NCCL must go to GPU LOCAL_RANK, not all to GPU 0."""
    import torch.distributed as dist

    from mtp_train.models.tp import init_tensor_parallel
    from mtp_train.runtime.device import default_device

    bound = []
    with fake_cuda(monkeypatch):
        monkeypatch.setattr(torch.cuda, "set_device", bound.append)
        monkeypatch.setenv("LOCAL_RANK", "1")
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda: 1)
        monkeypatch.setattr(dist, "get_world_size", lambda: 2)
        device = default_device()
        tp = init_tensor_parallel(2, device)
    assert device == torch.device("cuda", 1) and bound == [device] and (tp.rank, tp.size) == (1, 2)


@pytest.mark.parametrize("rank", [0, 1])
def test_only_the_leader_holds_the_draft_on_the_gpu(monkeypatch, rank):
    """A head drafter and a draft model: K/V pool and weights on the GPU on rank 0 only."""
    from conftest import TINY_TARGET
    from mtp_train.heads import build_head, head_spec
    from mtp_train.models.checkpoint import load_transformer
    from mtp_train.models.tp import TensorParallel
    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.drafters import DraftModelDrafter, HeadDrafter

    with fake_cuda(monkeypatch):
        engine = Engine.from_pretrained(TINY_TARGET, device="cuda", num_pages=64)
        engine.tp = TensorParallel(rank=rank, size=2)
        head = build_head(head_spec("mtp", 1, engine.cfg, "x"))
        drafter = HeadDrafter(engine, head)
        model = load_transformer(TINY_TARGET, device="cuda" if rank == 0 else "meta")
        draft_model = DraftModelDrafter(engine, model)
        on_gpu = {p.device.type for p in drafter.head.parameters()}
    if rank == 0:
        assert drafter.kv is not None and draft_model.kv is not None and on_gpu == {"cuda"}
    else:
        assert drafter.kv is None and draft_model.kv is None and on_gpu == {"cpu"}
        assert {p.device.type for p in model.parameters()} == {"meta"}
