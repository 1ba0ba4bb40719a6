"""The same model on a CUDA device: equal to the CPU in fp32, bf16 "auto" chosen there, compiled blocks.

Every test compares the CUDA run with a reference computed in the same test (the CPU fp32 model, the
eager model, the recomputing decoder). CI has no GPU, so the module skips there with the one reason
tests/conftest.py allows ("needs a CUDA device"); it runs where a GPU is (benchmarks/gpu_check.sh).
"""

import numpy as np
import pytest
import torch

from helpers import V, cfg, perturb, tokens
from workbench import LoopConfig, LoopLM
from workbench.models import precision
from workbench.train import Trainer, TrainConfig, compile_count, compiled_blocks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VARIANTS = [
    {},
    {"inject": "channel", "history": 2, "history_op": "channel"},
    {"hyper": 2, "hyper_dynamic": True, "inject": "dense"},
    {"timestep": "adaln", "inject": "stable"},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "plain")
def test_cuda_fp32_loss_and_gradients_equal_the_cpu(variant):
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    cpu = perturb(LoopLM(cfg(**variant), seed=0))
    gpu = perturb(LoopLM(cfg(**variant), seed=0)).cuda()
    x, y = tokens(0), tokens(1)
    for r, k in ((3, 3), (5, 2)):  # at K, and beyond it with truncated backprop
        out = {}
        for name, m, dev in (("cpu", cpu, "cpu"), ("cuda", gpu, "cuda")):
            m.zero_grad(set_to_none=True)
            loss = m(x.to(dev), loops=r, targets=y.to(dev), backward_loops=k).loss
            loss.backward()
            out[name] = (loss.item(), {n: p.grad.detach().cpu() for n, p in m.named_parameters() if p.grad is not None})
        assert out["cuda"][0] == pytest.approx(out["cpu"][0], abs=1e-5, rel=1e-5)
        assert out["cuda"][1].keys() == out["cpu"][1].keys()
        for n, g in out["cpu"][1].items():
            torch.testing.assert_close(out["cuda"][1][n], g, atol=1e-5, rtol=1e-4, msg=lambda m: f"{n} (r={r}, k={k}): {m}")


def test_auto_precision_is_bf16_on_a_cuda_device_with_bf16_and_the_trainer_records_it(tmp_path):
    assert precision.fast_bf16(torch.device("cuda")) == torch.cuda.is_bf16_supported()
    data = np.random.default_rng(0).integers(0, V, 20000).astype(np.uint16)
    tc = TrainConfig(steps=3, batch_size=4, seq_len=32, progress=False, bf16="auto", compile="off", device="cuda")
    ds = Trainer(cfg(), tc, data, out_dir=tmp_path).run()
    assert ds.attrs["precision"] == ("bf16-autocast" if torch.cuda.is_bf16_supported() else "fp32")


def test_cuda_bf16_training_reaches_the_fp32_validation_loss_within_2_percent():
    from workbench.data.corpus import stdlib_bytes
    from workbench.evals import loop_sweep

    data = np.frombuffer(stdlib_bytes(400_000), dtype=np.uint8).astype(np.uint16)
    train, val = data[:360_000], data[360_000:]
    c = LoopConfig(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, prelude=1, core=1, coda=1, loops=3,
                   max_seq_len=64, inject="channel")
    losses = {}
    for mode in ("off", "on"):
        tc = TrainConfig(steps=300, batch_size=16, seq_len=64, lr=1e-2, warmup=20, progress=False, bf16=mode,
                         compile="off", eval_batches=8, seed=0, device="cuda")
        t = Trainer(c, tc, train, val)
        t.run()
        ds = loop_sweep(t.model, torch.cat(t.val_batches), [3], progress=False, bf16="off")
        losses[mode] = float(ds.loss.sel(loop=3))
        assert t.metrics["loss"][-1] < 0.75 * t.metrics["loss"][0]
    assert abs(losses["on"] - losses["off"]) <= 0.02 * losses["off"], losses


def test_cuda_compiled_blocks_match_eager_and_a_new_loop_count_does_not_recompile():
    c = LoopConfig(vocab_size=128, d_model=64, n_heads=4, prelude=1, core=2, coda=1, loops=3, max_seq_len=64,
                   inject="channel", timestep="adaln", hyper=2)
    model = perturb(LoopLM(c, seed=3)).cuda()
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 128, (4, 32), generator=g).cuda() for _ in range(2))

    def loss(r, k, compiled):
        with precision.autocast("cuda", True):
            if compiled:
                with compiled_blocks(model):
                    return model(x, loops=r, targets=y, backward_loops=k, return_logits=False).loss.float()
            return model(x, loops=r, targets=y, backward_loops=k, return_logits=False).loss.float()

    for r, k in ((3, 3), (3, 1)):  # warm: full and truncated
        loss(r, k, True).backward()
    before = compile_count()
    for r, k in ((2, 2), (5, 5), (4, 1)):
        torch.testing.assert_close(loss(r, k, True), loss(r, k, False), atol=5e-3, rtol=5e-3)
    assert compile_count() == before


def test_cuda_cached_generation_equals_recomputing_every_step():
    model = perturb(LoopLM(cfg(inject="channel"), seed=0), scale=0.2).cuda().eval()
    prompt = tokens(2, B=3, T=8).cuda()
    out = model.generate(prompt, 12, loops=4)
    seq = prompt
    with torch.no_grad():
        for _ in range(12):  # the obvious decoder: the whole sequence again for each new token
            nxt = model(seq, loops=4).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq)
