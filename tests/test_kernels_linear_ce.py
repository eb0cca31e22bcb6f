"""Fused linear + cross-entropy: the op against naive.py (loss, dx, dW), in a model, and under torch.compile."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from kernels.linear_ce import kernel as lk
from kernels.linear_ce import linear_cross_entropy, linear_cross_entropy_naive
from kernels.linear_ce import op as lop
from kernels.testing import assert_close
from mixdepth.models.dense import DenseConfig, DenseLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = pytest.mark.skipif(DEVICE != "cuda", reason="bf16 needs a GPU (the interpreter's bf16 is wrong)")
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}

pytestmark = pytest.mark.usefixtures("poison_empty")  # kernel outputs start as NaN
FUSE_MIN_VOCAB = lop.FUSE_MIN_VOCAB


@pytest.fixture(autouse=True)
def _fuse_small_vocab(monkeypatch):
    """The tests' vocabularies are small (CPU time): fuse them as the op fuses V >= FUSE_MIN_VOCAB."""
    monkeypatch.setattr(lop, "FUSE_MIN_VOCAB", 0)


def test_small_vocabularies_take_the_reference(monkeypatch):
    """Below FUSE_MIN_VOCAB the op is the reference itself (compiled code fuses it with the head); from it, the
    fused op runs."""
    monkeypatch.setattr(lop, "FUSE_MIN_VOCAB", FUSE_MIN_VOCAB)
    calls = []
    monkeypatch.setattr(lop, "_fused", lambda *a: calls.append(a) or (torch.zeros(()), None, None))
    x, w, t = _inputs(4, 8, FUSE_MIN_VOCAB - 1, torch.float32)
    assert torch.equal(linear_cross_entropy(x, w, t), linear_cross_entropy_naive(x, w, t)) and not calls
    if lop.use_triton("linear_cross_entropy", x):
        x, w, t = _inputs(4, 8, FUSE_MIN_VOCAB, torch.float32)
        linear_cross_entropy(x, w, t)
        assert len(calls) == 1


def _cfg(chunk_rows: int, block_v: int, block_r: int, v: int, itemsize: int) -> lk.CeConfig:
    """Tiles small enough that N spans several chunks and V several column blocks, ragged ends included."""
    return replace(lk.CONFIG, chunk_bytes=chunk_rows * v * itemsize, block_v=block_v, block_r=block_r)


def _inputs(n, d, v, dtype, seed=0, ignored=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(DEVICE, dtype)
    w = (torch.randn(v, d, generator=g) * d**-0.5 * 3).to(DEVICE, dtype)  # logits of std ~3: a peaked softmax
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignored] = -100
    return x, w, t.to(DEVICE)


def _run(fn, x, w, t, g_out=1.0, **kw):
    """Loss and the gradients of ``g_out * loss``; an input that gets no gradient reads as zeros."""
    xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(xl, wl, t, **kw)
    (loss * g_out).backward()
    return loss, xl.grad, wl.grad


def _check(n, d, v, dtype=torch.float32, seed=0, ignored=0.0, g_out=1.0, **kw):
    x, w, t = _inputs(n, d, v, dtype, seed, ignored)
    ref = _run(linear_cross_entropy_naive, x, w, t, g_out, **kw)
    out = _run(linear_cross_entropy, x, w, t, g_out, **kw)
    assert out[0].dtype == torch.float32
    for name, a, b in zip(
        ("loss", "dx", "dw"), [r.to(o.dtype) for r, o in zip(ref, out, strict=True)], out, strict=True
    ):
        assert_close(name, a, b, TOL[dtype])
    return out


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_naive_gradcheck(reduction):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 6, -100, 3, 3])
    assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy_naive(a, b, t, reduction=reduction), (x, w))


def test_naive_is_the_models_old_loss():
    """fp32: bit for bit the unfused ``F.cross_entropy(F.linear(x, W).float(), t)`` (the plain-CPU path)."""
    x, w, t = _inputs(33, 16, 50, torch.float32, ignored=0.2)
    old = F.cross_entropy(F.linear(x, w).float(), t)
    assert torch.equal(linear_cross_entropy_naive(x, w, t), old)


@pytest.mark.parametrize("block_r", [1, 4])
@pytest.mark.parametrize(
    "n,d,v,chunk,block_v",
    [
        (37, 24, 257, 8, 64),  # ragged last chunk (5 rows) and last column block (1 column)
        (64, 16, 128, 16, 32),  # every size a multiple
        (1, 8, 5, 1, 8),  # one row, V below one block
        (50, 12, 500, 64, 128),  # one chunk larger than N
        (37, 24, 257, 8, 512),  # one block spans the row: read once (ONE_PASS)
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_naive(n, d, v, chunk, block_v, block_r, dtype, monkeypatch):
    monkeypatch.setattr(lk, "CONFIG", _cfg(chunk, block_v, block_r, v, dtype.itemsize))
    _check(n, d, v, dtype, ignored=0.15)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduction_and_upstream_gradient(reduction, monkeypatch):
    """Backward scales the gradients computed in the forward by the upstream scalar (here 2.5)."""
    monkeypatch.setattr(lk, "CONFIG", _cfg(8, 64, 4, 97, 4))
    _check(21, 16, 97, ignored=0.3, g_out=2.5, reduction=reduction)


def test_ignore_index_rows_get_no_gradient(monkeypatch):
    monkeypatch.setattr(lk, "CONFIG", _cfg(4, 16, 2, 40, 4))
    _check(13, 8, 40, ignore_index=7)  # a real class as ignore_index: those rows drop out
    x, w, t = _inputs(13, 8, 40, torch.float32)
    t[::3] = -100
    _, dx, _ = _run(linear_cross_entropy, x, w, t)
    assert torch.all(dx[::3] == 0) and torch.all(dx[1::3].abs().sum(1) > 0)


def test_all_rows_ignored_is_nan_with_zero_gradients():
    x, w, t = _inputs(6, 8, 11, torch.float32)
    t[:] = -100
    loss, dx, dw = _run(linear_cross_entropy, x, w, t)
    assert loss.isnan() and torch.all(dx == 0) and torch.all(dw == 0)
    assert _run(linear_cross_entropy_naive, x, w, t)[0].isnan()


@CUDA
@pytest.mark.parametrize("n,d,v", [(300, 64, 1000), (4133, 96, 50304)])
def test_matches_naive_bf16_cuda(n, d, v):
    _check(n, d, v, torch.bfloat16, ignored=0.1)


def test_autocast_computes_in_autocast_dtype(monkeypatch):
    """fp32 x and W under autocast: the matmuls run in autocast's dtype (fp16 on CPU, bf16 on CUDA), gradients
    come back in fp32 (the weight's fp32 accumulator, no 16-bit rounding of dW)."""
    monkeypatch.setattr(lk, "CONFIG", _cfg(16, 64, 4, 203, 2))
    dt = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    x, w, t = _inputs(45, 32, 203, torch.float32, ignored=0.1)
    ref = _run(linear_cross_entropy_naive, x.to(dt), w.to(dt), t)
    with torch.autocast(DEVICE, dtype=dt):
        out = _run(linear_cross_entropy, x, w, t)
    assert [o.dtype for o in out] == [torch.float32] * 3
    for name, a, b in zip(("loss", "dx", "dw"), ref, out, strict=True):
        assert_close(name, a.float(), b, TOL[dt])


def test_only_the_needed_gradients(monkeypatch):
    """No grad mode (evaluation): the loss alone, one matmul; a frozen weight: dx only."""
    monkeypatch.setattr(lk, "CONFIG", _cfg(8, 32, 4, 70, 4))
    x, w, t = _inputs(20, 16, 70, torch.float32, ignored=0.1)
    ref = linear_cross_entropy_naive(x, w, t)
    flops = {}
    for grad in (False, True):
        xl = x.clone().requires_grad_()
        with torch.set_grad_enabled(grad), FlopCounterMode(display=False) as fc:
            loss = linear_cross_entropy(xl, w, t)
        assert_close("loss", ref, loss.detach(), TOL[torch.float32])
        flops[grad] = fc.get_total_flops()
    assert flops == {False: 2 * 20 * 16 * 70, True: 2 * 2 * 20 * 16 * 70}  # + dx = g W, no dW
    loss.backward()
    xr = x.clone().requires_grad_()
    linear_cross_entropy_naive(xr, w, t).backward()
    assert_close("dx", xr.grad, xl.grad, TOL[torch.float32])


def _tiny(tie: bool) -> DenseLM:
    torch.manual_seed(0)
    cfg = DenseConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16, vocab_size=97, tie_embeddings=tie)
    return DenseLM(cfg).to(DEVICE)


def _unfused_loss(model: DenseLM, idx, targets):
    logits = model(idx)  # [B, T, V]: the logits path, unchanged
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("tie", [False, True])
def test_model_loss_and_every_gradient_equal_unfused(tie, monkeypatch):
    """DenseLM's fused loss vs the old unfused head: loss and every parameter gradient (a tied embedding gets
    its lookup's gradient plus the head's)."""
    monkeypatch.setattr(lk, "CONFIG", _cfg(8, 32, 4, 97, 4))  # B*T = 30 rows: 4 chunks, the last of 6
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    idx, y = x[:, :-1], x[:, 1:].clone()
    y[0, -3:] = -100  # ignored targets
    fused, ref = _tiny(tie), _tiny(tie)
    loss, ref_loss = fused.loss(idx, y), _unfused_loss(ref, idx, y)
    loss.backward()
    ref_loss.backward()
    assert_close("loss", ref_loss.detach(), loss.detach(), TOL[torch.float32])
    names = [n for n, _ in fused.named_parameters()]
    assert ("embed.weight" in names) and (("head.weight" in names) != tie)
    for (name, p), r in zip(fused.named_parameters(), ref.parameters(), strict=True):
        assert_close(name, r.grad, p.grad, TOL[torch.float32])


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_model_runs_the_op_without_breaks_or_recompiles(backend):
    """``model.compile()`` (dynamo, and aot_autograd with the op's fake and backward): one graph with no break,
    the same loss and gradients as eager, and no recompile over training steps and evaluations between them."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, ref = _tiny(True), _tiny(True)
    model.compile(backend=backend)
    x = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    graphs = []
    for _ in range(3):
        for m in (model, ref):
            m.zero_grad()
        loss, ref_loss = model.loss(x[:, :-1], x[:, 1:]), ref.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, r.grad, msg=name)
        with torch.no_grad():
            torch.testing.assert_close(model.loss(x[:, :-1], x[:, 1:]), ref_loss.detach())
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [2, 2, 2], graphs  # training and no-grad evaluation, each compiled once
    assert counters["frames"]["ok"] == counters["frames"]["total"] > 0, dict(counters["frames"])
    assert not counters["graph_break"], dict(counters["graph_break"])


@CUDA
def test_capturable_in_a_cuda_graph():
    """Forward and backward captured in one CUDA graph (no host sync anywhere), replayed on new inputs."""
    x, w, t = _inputs(300, 64, 1000, torch.bfloat16, ignored=0.1)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compilation, cuBLAS workspaces) off the capture stream
        for _ in range(2):
            xs.grad = ws.grad = None
            linear_cross_entropy(xs, ws, t).backward()
    torch.cuda.current_stream().wait_stream(side)
    xs.grad = ws.grad = None  # allocated inside the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = linear_cross_entropy(xs, ws, t)
        loss.backward()
    x2, w2, t2 = _inputs(300, 64, 1000, torch.bfloat16, seed=1, ignored=0.3)
    with torch.no_grad():
        for static, new in ((xs, x2), (ws, w2), (t, t2)):
            static.copy_(new)
    graph.replay()
    ref = _run(linear_cross_entropy, x2, w2, t2)  # eager (cuBLAS may pick other kernels outside the capture)
    for name, a, b in zip(("loss", "dx", "dw"), ref, (loss, xs.grad, ws.grad), strict=True):
        assert_close(name, a.detach(), b.detach(), TOL[torch.bfloat16])


@CUDA
def test_compiled_reduce_overhead_under_autocast_cuda():
    """What the trainer runs on a GPU: ``model.compile(mode="reduce-overhead")`` (Inductor + CUDA graphs) under
    bf16 autocast: loss and gradients equal eager's within bf16 rounding, no recompile, no cudagraph skip."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, ref = _tiny(True), _tiny(True)
    model.compile(mode="reduce-overhead")
    x = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    graphs = []
    for _ in range(4):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, ref_loss = model.loss(x[:, :-1], x[:, 1:]), ref.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        ref_loss.backward()
        assert_close("loss", ref_loss.detach(), loss.detach(), TOL[torch.bfloat16])
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert_close(name, r.grad, p.grad, TOL[torch.bfloat16])
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1] * 4, graphs
    assert not counters["graph_break"] and not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


@pytest.mark.parametrize(
    "args,err,msg",
    [
        (dict(t=torch.zeros(4, dtype=torch.int32)), TypeError, "int64"),
        (dict(t=torch.zeros(3, dtype=torch.int64)), ValueError, r"targets must be \[4\]"),
        (dict(w=torch.zeros(9, 5)), ValueError, "expected x"),
        (dict(w=torch.zeros(9, 6, dtype=torch.float16)), TypeError, "outside autocast"),
        (dict(t=torch.tensor([0, 9, 1, 2])), ValueError, "out of range"),
        (dict(reduction="none"), ValueError, "reduction"),
    ],
)
def test_bad_input_raises_one_line(args, err, msg):
    x, w, t = torch.zeros(4, 6), args.get("w", torch.zeros(9, 6)), args.get("t", torch.zeros(4, dtype=torch.int64))
    with pytest.raises(err, match=msg) as e:
        linear_cross_entropy(x, w, t, reduction=args.get("reduction", "mean"))
    assert "\n" not in str(e.value)
