import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernel path runs on CPU
from torch.utils.flop_counter import FlopCounterMode

from kernels.moda_attn import moda_attn_naive
from mixdepth.config import load_config, model_config
from mixdepth.models import MODELS
from mixdepth.models import moda as M
from mixdepth.models.dense import DenseConfig, ModelConfigError
from mixdepth.models.moda import DEPTH_KV, DepthStore, MoDAConfig, MoDALM

CONF = Path(__file__).resolve().parents[1] / "conf"


def make(**kw) -> MoDALM:
    base = dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=16, vocab_size=64)
    torch.manual_seed(0)
    return MoDALM(MoDAConfig(**{**base, **kw}))


def record_attention(monkeypatch) -> list[dict]:
    """Wrap the model's attention entry point; each call appends its inputs and output."""
    calls, inner = [], M.joint_attention

    def spy(q, k, v, kd, vd, impl, depth_grad=None):
        out = inner(q, k, v, kd, vd, impl, depth_grad)
        calls.append(dict(q=q, k=k, v=v, kd=kd, vd=vd, depth_grad=depth_grad, out=out))
        return out

    monkeypatch.setattr(M, "joint_attention", spy)
    return calls


@pytest.mark.parametrize(
    "kw",
    [
        dict(depth_kv="attn", n_kv_heads=4),
        dict(depth_kv="attn+ffn", qk_norm=True),
        dict(depth_kv="attn+ffn+extra", norm="post", n_kv_heads=1),
        dict(depth_kv="attn+ffn+extra", depth_window=2),
    ],
)
def test_depth_flops_counted_exactly(kw):
    """Analytic forward FLOPs vs FlopCounterMode on the naive path, EXACTLY: the depth term is far below the
    contract's 2% (test_models_contract.py) at this size.

    The counter sees the reference's full T x T sequence scores and values where the convention counts
    the mean causal context (T+1)/2: swap one for the other. Its T x S depth scores/values are exact.
    """
    model = make(attn_impl="naive", seq_len=32, **kw)
    cfg, (B, T) = model.cfg, (2, 32)
    with FlopCounterMode(display=False) as fc:
        model(torch.randint(0, cfg.vocab_size, (B, T)))
    per_layer = 4 * cfg.n_heads * cfg.head_dim * B * T
    expected = cfg.flops_per_token() * B * T + cfg.n_layers * per_layer * (T - (T + 1) / 2)
    # Exception: a layer reading ONE slot, where torch lowers the [T, 1] einsum to mul+sum that the counter
    # does not see (2·B·Hq·T·hd).
    one_slot = sum(hi - lo == 1 for lo, hi in map(cfg.depth_range, range(cfg.n_layers)))
    assert fc.get_total_flops() == expected - one_slot * 2 * cfg.n_heads * cfg.head_dim * B * T


def test_depth_flops_formula():
    cfg = MoDAConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, depth_kv="attn+ffn")
    dense = DenseConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2)
    reads = 0 + 2 + 4 + 6  # layer l reads 2l slots
    proj = 3 * 2 * 64 * 2 * 2 * 16  # FFN K/V projections of blocks 0..2 (block 3's slot is never read)
    assert cfg.flops_per_token() - dense.flops_per_token() == 4 * 4 * 16 * reads + proj


@pytest.mark.parametrize("kw", [dict(depth_kv=v) for v in DEPTH_KV] + [dict(qk_norm=True, depth_window=1)])
def test_every_parameter_is_active(kw):
    """Depth attention touches every weight for every token (total and nonembed: test_models_contract.py)."""
    n = make(**kw).cfg.n_params()
    assert n["active"] == n["total"]


def test_paper_table3_parameter_deltas():
    """700M rows of Table 3 (D=1024, G=2, 36 layers): FFN KV +36.7M, extra attention KV another +36.7M."""
    shape = dict(d_model=1024, n_layers=36, n_heads=16, n_kv_heads=8)
    n = {v: MoDAConfig(depth_kv=v, **shape).n_params()["total"] for v in DEPTH_KV}
    assert (n["attn+ffn"] - n["attn"]) / 1e6 == pytest.approx(36.7, abs=0.05)
    assert (n["attn+ffn+extra"] - n["attn+ffn"]) / 1e6 == pytest.approx(36.7, abs=0.05)
    assert n["attn"] == DenseConfig(**shape).n_params()["total"]  # reusing attention K/V adds nothing


@pytest.mark.parametrize(
    "kw,counts",
    [
        (dict(depth_kv="attn"), [0, 1, 2, 3]),
        (dict(depth_kv="attn+ffn"), [0, 2, 4, 6]),
        (dict(depth_kv="attn+ffn+extra"), [0, 3, 6, 9]),
        (dict(depth_kv="attn+ffn", depth_window=3), [0, 2, 3, 3]),
        (dict(depth_kv="attn+ffn+extra", depth_window=1, norm="post"), [0, 1, 1, 1]),
    ],
)
def test_joint_softmax_and_slot_counts(monkeypatch, kw, counts):
    """Each layer's output is moda_attn_naive over its q/k/v and exactly the expected earlier slots."""
    model = make(**kw)
    calls = record_attention(monkeypatch)
    _, store = model.trunk(torch.randint(0, 64, (2, 16)))
    cfg = model.cfg
    assert [0 if c["kd"] is None else c["kd"].shape[3] for c in calls] == counts
    for layer, c in enumerate(calls):
        lo, hi = cfg.depth_range(layer)
        if hi > lo:  # the slots read are the tensors written, in write order (built here independently)
            torch.testing.assert_close(c["kd"], torch.stack(store.src_k[lo:hi], 3), rtol=0, atol=0)
            torch.testing.assert_close(c["vd"], torch.stack(store.src_v[lo:hi], 3), rtol=0, atol=0)
        if cfg.slot_is_read(layer, "attn"):  # the attention slot reuses this layer's own K/V
            assert store.src_k[cfg.slot_index(layer, "attn")] is c["k"]
        expected = moda_attn_naive(c["q"], c["k"], c["v"], c["kd"], c["vd"])
        torch.testing.assert_close(c["out"], expected)
    # ONE softmax: separate softmaxes added together would give a different output
    c = calls[-1]
    seq = moda_attn_naive(c["q"], c["k"], c["v"])
    dep = torch.einsum(
        "bhts,bhtsd->bhtd",
        torch.einsum("bhtd,bhtsd->bhts", c["q"], c["kd"].repeat_interleave(2, 1)).mul(16**-0.5).softmax(-1),
        c["vd"].repeat_interleave(2, 1),
    )
    assert not torch.allclose(c["out"], seq + dep, atol=1e-3)


def test_attention_inputs_in_their_layouts(monkeypatch):
    """q reaches the attention as a view of contiguous [B, T, Hq, hd] memory (the projections' layout; its
    output comes back in it), k and v contiguous [B, Hk, T, hd] (the slot layout: slot writes are plain copies),
    and the slots as views of the slot-major buffers."""
    model = make(depth_kv="attn+ffn")
    calls = record_attention(monkeypatch)
    _, store = model.trunk(torch.randint(0, 64, (2, 16)))
    for c in calls:
        assert c["q"].transpose(1, 2).is_contiguous() and not c["q"].is_contiguous()
        assert c["k"].is_contiguous() and c["v"].is_contiguous()
    assert all(t.is_contiguous() for t in store.src_k + store.src_v if t is not None)


def test_depth_buffer_is_written_once_and_read_in_place(monkeypatch):
    """No per-layer re-concatenation: one K and one V buffer per pass, every read a view of them.

    With autograd on, the two slot-gradient buffers are not allocated in the forward pass (they would add to
    its peak) but on the first request in the backward pass; each read's attention gets a function returning
    the matching views of them, and whether to add into them: not when none of its slots holds a sum yet.
    Without autograd: only the 2 slot buffers, and no gradient buffers at all.
    """
    model = make(depth_kv="attn+ffn+extra", depth_window=4)
    calls = record_attention(monkeypatch)
    x = torch.randint(0, 64, (2, 16))
    _, store = model.trunk(x)
    assert store.allocations == 2 and store.k.shape == (model.cfg.n_slots, 2, 2, 16, 16)  # slot-major
    assert store.grad is not None and store.grad.k is None  # nothing allocated yet
    elem = store.k.element_size()
    summed = set()
    for layer, c in reversed(list(enumerate(calls[1:], 1))):  # requested in backward order
        lo, hi = model.cfg.depth_range(layer)
        *grads, add = c["depth_grad"]()
        assert add == bool(summed & set(range(lo, hi)))  # write when none of its slots holds a sum yet
        summed |= set(range(lo, hi))
        reads = ((c["kd"], store.k), (c["vd"], store.v), *zip(grads, (store.grad.k, store.grad.v), strict=True))
        for read, buf in reads:
            assert read.data_ptr() == buf.data_ptr() + lo * buf.stride(0) * elem
            assert read.stride() == buf.permute(1, 2, 3, 0, 4).stride() and read.shape == c["kd"].shape
    assert store.grad.k.shape == store.k.shape
    with torch.no_grad():
        s2 = model.trunk(x)[1]
        assert s2.allocations == 2 and s2.grad is None


def test_gradients_match_stacked_reference(monkeypatch):
    """The zero-copy reads (own version counter + gradient routing) give the same gradients as torch.stack."""
    x = torch.randint(0, 64, (2, 17))

    def grads():
        model = make(depth_kv="attn+ffn+extra", qk_norm=True)
        model.loss(x[:, :-1], x[:, 1:]).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    fast = grads()

    def stacked(self, lo, hi):
        if hi <= lo:
            return None, None, None
        return torch.stack(self.src_k[lo:hi], 3), torch.stack(self.src_v[lo:hi], 3), None

    monkeypatch.setattr(DepthStore, "read", stacked)
    ref = grads()
    assert all(g is not None for g in fast.values())
    for n, g in ref.items():
        torch.testing.assert_close(fast[n], g, msg=n)


class ConcatStore:
    """Reference depth store without buffers: every read concatenates the written tensors afresh, and autograd
    routes each slot's gradient back by itself (one accumulation per reader)."""

    def __init__(self, n_slots: int, live: int | None = None):
        self.k, self.v = [None] * n_slots, [None] * n_slots

    def release(self, lo):
        pass  # keeps every slot

    def write(self, i, k, v):
        self.k[i], self.v[i] = k, v

    def read(self, lo, hi):
        if hi <= lo:
            return None, None, None
        return (
            torch.cat([t[:, :, :, None] for t in self.k[lo:hi]], 3),
            torch.cat([t[:, :, :, None] for t in self.v[lo:hi]], 3),
            None,
        )


def grads_of(model, x) -> dict[str, torch.Tensor]:
    """Gradients wrt every parameter and the embedding output [B, T, D] (every depth gradient ends there) of
    the logits against a fixed random cotangent: O(1) gradients, so that the tolerance resolves the depth part
    (the cross-entropy's are ~1e-3, and its slot share below 1e-5 at init)."""
    emb = []

    def keep(module, args, out):
        out.retain_grad()
        emb.append(out)

    hook = model.embed.register_forward_hook(keep)
    logits = model(x)
    logits.backward(torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)))
    hook.remove()
    return {"embed_out": emb[0].grad, **{n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize(
    "kw",
    [dict(depth_kv=v) for v in DEPTH_KV]
    + [
        dict(depth_kv="attn", depth_window=2, n_kv_heads=4),
        dict(depth_kv="attn+ffn", depth_window=3, qk_norm=True),
        dict(depth_kv="attn+ffn+extra", depth_window=4, norm="post"),
    ],
)
def test_gradient_buffer_matches_concatenating_reference(monkeypatch, poison_empty, kw):
    """The gradient buffers (one add or write per read, one hand-off per slot) give the reference's gradients
    (fp32, the reference attention: kd, vd gradients through autograd); they are allocated NaN-filled here, so
    a slot summed into before being written or zeroed shows."""
    x = torch.randint(0, 64, (2, 16))
    fast = grads_of(make(n_layers=5, attn_impl="naive", **kw), x)
    monkeypatch.setattr(M, "DepthStore", ConcatStore)
    ref = grads_of(make(n_layers=5, attn_impl="naive", **kw), x)
    assert fast.keys() == ref.keys() and all(g is not None for g in fast.values())
    for n, g in ref.items():
        torch.testing.assert_close(fast[n], g, rtol=1e-5, atol=1e-5, msg=n)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
@pytest.mark.parametrize("window", [0, 3])
def test_kernel_adds_into_gradient_buffer_matches_reference(monkeypatch, poison_empty, window):
    """The Triton kernel writing (first read of its slots in backward order) or adding dkd/dvd into the
    gradient buffers' views vs the concatenating naive reference; buffers allocated NaN-filled."""
    x = torch.randint(0, 64, (2, 16))
    fast = grads_of(make(depth_kv="attn+ffn", depth_window=window), x)
    monkeypatch.setattr(M, "DepthStore", ConcatStore)
    ref = grads_of(make(depth_kv="attn+ffn", depth_window=window, attn_impl="naive"), x)
    for n, g in ref.items():  # gradients up to ~50: fp32 rounding of the two orders of summation ~1e-5
        torch.testing.assert_close(fast[n], g, rtol=1e-4, atol=1e-4, msg=n)


@pytest.mark.parametrize("kw", [dict(depth_kv="attn+ffn"), dict(depth_kv="attn+ffn+extra", depth_window=2)])
def test_depth_gradients_cost_o_of_L_ops(monkeypatch, kw):
    """One read backward per reading layer, one write backward per slot, and backward ops affine in L.

    Routing each slot's gradient through autograd per reader costs one accumulation per (slot, read): O(L^2)
    without a window (that path, replaced, grew by 536, 568, 600 ops per two layers from L = 3 to 9).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    calls = {"read": 0, "write": 0}
    for name, fn in (("read", M._SlotRead), ("write", M._SlotWrite)):
        inner = fn.backward

        def counted(ctx, *g, inner=inner, name=name):
            calls[name] += 1
            return inner(ctx, *g)

        monkeypatch.setattr(fn, "backward", staticmethod(counted))
    ops = []
    for L in (3, 5, 7):
        model = make(n_layers=L, **kw)
        x = torch.randint(0, 64, (2, 17))
        loss = model.loss(x[:, :-1], x[:, 1:])
        calls.update(read=0, write=0)
        with CountOps() as c:
            loss.backward()
        cfg = model.cfg
        assert calls["read"] == sum(hi > lo for lo, hi in map(cfg.depth_range, range(L)))
        assert calls["write"] == sum(cfg.slot_is_read(l, k) for l in range(L) for k in cfg.slot_kinds)
        ops.append(c.n)
    assert ops[2] - ops[1] == ops[1] - ops[0]


def test_second_backward_through_one_pass_raises():
    model = make()
    x = torch.randint(0, 64, (2, 17))
    loss = model.loss(x[:, :-1], x[:, 1:])
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass"):
        loss.backward()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
def test_kernel_path_matches_reference(monkeypatch):
    """The Triton op (interpreted) on the buffer's strided slot views: same loss and gradients as the reference."""
    x = torch.randint(0, 64, (2, 17))

    def run(kernel: bool):
        model = make(depth_kv="attn+ffn+extra", n_layers=3, depth_window=4, attn_impl="sdpa" if kernel else "naive")
        loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}

    (la, ga), (lb, gb) = run(True), run(False)
    torch.testing.assert_close(la, lb)
    for n in gb:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize(
    "kw",
    [
        dict(depth_kv="attn", depth_window=2),
        dict(depth_kv="attn+ffn", depth_window=2),
        dict(depth_kv="attn+ffn", depth_window=1),
        dict(depth_kv="attn+ffn+extra", depth_window=2),
        dict(depth_kv="attn+ffn+extra", depth_window=4, norm="post"),
    ],
)
def test_bounded_depth_store_without_autograd(monkeypatch, kw):
    """Paper Sec. 6.2: with a depth window S, evaluation, prefill and generation (no autograd) hold at most
    S + slots-per-block depth slots (8 layers: not the (L-1)·slots-per-block every slot would take), and give
    the logits and tokens of the store that keeps every slot, bit for bit."""
    model = make(n_layers=8, **kw).eval()
    cfg = model.cfg
    live = cfg.depth_window + len(cfg.slot_kinds)
    x = torch.randint(0, 64, (2, 16))
    slot_bytes = 2 * 2 * 16 * 16 * 4  # one slot of k or v: [B, Hk, T, hd] fp32
    with torch.no_grad():
        (h, store), (_, prefill) = model.trunk(x), model.trunk(x[:, :5], model.new_cache(2, 16), 0)
        for s in (store, prefill):
            assert s.k.shape[0] <= live < cfg.n_slots and s.allocations == 2
            assert s.k.numel() * s.k.element_size() + s.v.numel() * s.v.element_size() <= 2 * live * slot_bytes
        out = model.generate(x[:, :4], 8, temperature=0)
    monkeypatch.setattr(M, "DepthStore", lambda n_slots, live: DepthStore(n_slots))  # every slot kept
    with torch.no_grad():
        ref_h, ref_store = model.trunk(x)
        assert ref_store.k.shape[0] == cfg.n_slots
        assert torch.equal(h, ref_h)
        assert torch.equal(model.generate(x[:, :4], 8, temperature=0), out)


def test_sweep_plan_includes_moda():
    from sweeps.plan import plan

    over = ["sweep.archs=[dense,moda]", "model.depth_kv=attn", "sweep.ladder=[{d_model: 32, n_layers: 2, n_heads: 2}]"]
    lab = load_config(CONF, "isoflop", over)
    cfg = model_config(lab, "moda", lab.sweep.ladder[0])
    assert isinstance(cfg, MoDAConfig) and cfg.depth_kv == "attn" and cfg.depth_window == 0
    dense = model_config(lab, "dense", lab.sweep.ladder[0])
    assert cfg.flops_per_token() > dense.flops_per_token()
    trials, _ = plan(lab, "t")
    moda = [t for t in trials if t.arch == "moda"]
    assert moda and all(t.flops_per_token == cfg.flops_per_token() for t in moda)
    lab = load_config(CONF, "isoflop", ["sweep.archs=[dense,moda]", "model.depth_kv=attn"])  # the CPU preset
    assert model_config(lab, "moda", lab.sweep.ladder[0]).arch == "moda"


@pytest.mark.parametrize(
    "kw,msg", [(dict(depth_kv="ffn"), "depth_kv"), (dict(depth_window=-1), "depth_window"), (dict(norm="x"), "norm")]
)
def test_bad_config_raises_one_line(kw, msg):
    with pytest.raises(ModelConfigError, match=msg) as e:
        MoDAConfig(**kw)
    assert "\n" not in str(e.value)


def test_registry():
    assert MODELS["moda"] == (MoDAConfig, MoDALM)


@pytest.mark.parametrize("depth_kv", ["attn", "attn+ffn+extra"])
def test_compiled_graphs_do_not_grow_with_depth(depth_kv):
    """Under ``model.compile()`` (what training calls) the attentions run eagerly and the compiled code between
    them (``_between``) is shared by all blocks: the number of distinct graphs does not grow with the number
    of layers (per-block recompiles would hit dynamo's recompile limit and
    leave deep blocks eager), and dynamo compiles every frame it tries (a graph break inside the loop over
    blocks would make it run the whole forward eagerly). Dynamo only (backend="eager"), so the check is cheap;
    the compiled loss and gradients equal eager's."""
    from torch._dynamo.utils import counters

    x = torch.randint(0, 64, (2, 17))
    graphs = []
    for n_layers in (5, 10):
        torch._dynamo.reset()
        counters.clear()
        model = make(n_layers=n_layers, depth_kv=depth_kv)
        model.compile(backend="eager")
        loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        graphs.append(counters["stats"]["unique_graphs"])
        assert counters["frames"]["ok"] == counters["frames"]["total"] > 0, dict(counters["frames"])
        ref = make(n_layers=n_layers, depth_kv=depth_kv)
        ref_loss = ref(x[:, :-1], x[:, 1:])
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        for (n, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, r.grad, msg=n)
    torch._dynamo.reset()
    assert graphs[0] == graphs[1] and graphs[0] <= 8, graphs
