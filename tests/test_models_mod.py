"""MoD (paper 003): routing semantics, causal rules, KV-cached generation, FLOPs and parameters.

Each semantic test targets a known way MoD implementations go wrong: the residual counted twice or scaled by
the router, gathered tokens renumbered 0..k-1 for RoPE, targets built without batch offsets, every decoded
token routed through every block.
"""

from pathlib import Path

import pytest
import torch
from torch import nn

from mixdepth.models import MODELS
from mixdepth.models.blocks import reference_attention
from mixdepth.models.dense import ModelConfigError
from mixdepth.models.mod import MoDConfig, MoDLM, RoutedBlock
from mixdepth.models.routing import capacity_k, membership, topk_indices

CONF = Path(__file__).resolve().parents[1] / "conf"
SMALL = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32, attn_impl="naive")


def spread(model: nn.Module) -> nn.Module:
    """Unit-scale embeddings, routers and predictors so that causal decisions split tokens ~50/50 (at the
    default init every logit is ~0 and a test of routing would route everything or nothing)."""
    torch.manual_seed(1)
    with torch.no_grad():
        if hasattr(model, "embed"):
            nn.init.normal_(model.embed.weight)
        for m in model.modules():
            if isinstance(m, RoutedBlock):
                d = m.router.proj.weight.shape[1]
                nn.init.normal_(m.router.proj.weight, std=d**-0.5)
                nn.init.normal_(m.predictor.fc1.weight, std=d**-0.5)
                nn.init.normal_(m.predictor.fc2.weight, std=m.predictor.fc1.out_features**-0.5)
                m.predictor.fc2.bias.zero_()
    return model


def routed_block(**kw) -> RoutedBlock:
    torch.manual_seed(0)
    blk = RoutedBlock(MoDConfig(**{**SMALL, **kw}))
    return spread(blk)


def rope_for(cfg: MoDConfig):
    from mixdepth.models.blocks import Rotary

    return Rotary(cfg.head_dim, cfg.seq_len)


# ---- selection --------------------------------------------------------------------------------------------
def test_topk_exactly_k_per_sequence_with_ties():
    B, T, k = 4, 16, 5
    scores = torch.randint(0, 3, (B, T)).float()  # many ties
    scores[0] = 0.0  # all tied: the lowest positions win
    idx = topk_indices(scores, k)
    assert idx.shape == (B, k) and (idx.diff(dim=1) > 0).all()  # sorted, distinct
    assert idx[0].tolist() == list(range(k))
    for b in range(B):  # reference: order by (-score, position)
        ref = sorted(range(T), key=lambda t: (-scores[b, t].item(), t))[:k]
        assert idx[b].tolist() == sorted(ref)
    assert capacity_k(2048, 0.125) == 256 and capacity_k(4, 0.01) == 1 and capacity_k(8, 1.0) == 8


@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_zero_update_is_identity(mode):
    """f = 0 (both residual branches output 0) leaves the stream bit-identical: the residual is not re-added."""
    blk = routed_block(gate="sigmoid")
    with torch.no_grad():
        blk.block.attn.wo.weight.zero_()
        blk.block.mlp.w2.weight.zero_()
    x = torch.randn(3, 32, 32)
    y, info = blk(x, rope_for(MoDConfig(**SMALL)), mode)
    assert info.taken.any() and torch.equal(y, x)


@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_exactly_k_routed_and_unrouted_bit_identical(mode):
    blk = routed_block(capacity=0.25)
    x = torch.randn(3, 32, 32)
    x[1] = x[0]  # identical sequences must route identically (no cross-sequence leakage)
    y, info = blk(x, rope_for(MoDConfig(**SMALL)), mode)
    if mode == "topk":
        assert (info.taken.sum(1) == 8).all()
    assert torch.equal(info.taken[0], info.taken[1]) and torch.equal(y[0], y[1])
    assert torch.equal(y[~info.taken], x[~info.taken])  # unrouted rows: bit-identical
    assert (y[info.taken] != x[info.taken]).any(-1).all()  # every routed row updated


def test_ties_at_block_level_route_first_k():
    blk = routed_block(gate="sigmoid", capacity=0.25)
    with torch.no_grad():
        blk.router.proj.weight.zero_()  # all scores tie at 0
    _, info = blk(torch.randn(3, 32, 32), rope_for(MoDConfig(**SMALL)), "topk")
    assert (info.taken.sum(1) == 8).all() and info.taken[:, :8].all()


@pytest.mark.parametrize("gate", ["identity", "sigmoid"])
def test_update_matches_masked_reference_with_original_positions(gate):
    """Routed rows equal x + g(r)·f with f from attention over the selected keys at ORIGINAL positions, computed
    on the full sequence with a mask (an independent path). Renumbering 0..k-1 gives a different answer."""
    cfg = MoDConfig(**SMALL)
    blk, rope = routed_block(gate=gate, capacity=0.25), rope_for(cfg)
    x = torch.randn(2, 32, 32)
    seen = []
    orig = type(rope).forward
    rope.forward = lambda t, pos: (seen.append(pos), orig(rope, t, pos))[1]
    y, info = blk(x, rope, "topk")
    idx = topk_indices(blk.router(x), 8)
    assert all(torch.equal(p, idx) for p in seen) and len(seen) == 2  # q and k rotated at original positions

    def reference(pos):
        b, n1 = blk.block, blk.block.norm1
        q, k, v = b.attn.qkv(n1(x), rope, pos)  # [B, H, T, hd] at positions pos
        causal = torch.ones(32, 32, dtype=torch.bool).tril()
        mask = causal[None] & info.taken[:, None, :]  # keys: selected and not in the future
        a = b.attn.wo(reference_attention(q, k, v, mask).transpose(1, 2).reshape(2, 32, 32))
        f = a + b.mlp(b.norm2(x + a))  # pre-norm update without the residual
        w = blk.weight(blk.router(x))[..., None]
        return torch.where(info.taken[..., None], x + w * f, x)

    with torch.no_grad():
        torch.testing.assert_close(y, reference(None), rtol=1e-5, atol=1e-5)
        # positions renumbered 0..k-1 among the selected (the classic bug) differ
        renum = (info.taken.long().cumsum(1) - 1).clamp(min=0)  # [B, T]
        wrong = reference(renum)
        assert not torch.allclose(y[info.taken], wrong[info.taken], atol=1e-4)


def test_aux_targets_per_sequence_with_batch():
    """Targets and outputs of a batch equal those of each sequence routed alone (no batch offset errors)."""
    blk, rope = routed_block(capacity=0.25), rope_for(MoDConfig(**SMALL))
    x = torch.randn(4, 32, 32)
    y, info = blk(x, rope, "topk")
    r = blk.router(x)
    for b in range(4):
        yb, ib = blk(x[b : b + 1], rope, "topk")
        assert torch.equal(info.target[b], ib.target[0])
        torch.testing.assert_close(y[b], yb[0], rtol=1e-5, atol=1e-6)
        top = set(sorted(range(32), key=lambda t: (-r[b, t].item(), t))[:8])
        assert info.target[b].nonzero().squeeze(1).tolist() == sorted(top)
    idx = torch.tensor([[0, 3], [1, 2], [3, 0]])
    assert membership(idx, 4).tolist() == [[1, 0, 0, 1], [0, 1, 1, 0], [1, 0, 0, 1]]


# ---- causal routing, training, metrics -------------------------------------------------------------------
def model(**kw) -> MoDLM:
    torch.manual_seed(0)
    return spread(MoDLM(MoDConfig(**{**SMALL, "n_layers": 4, **kw})))


@pytest.mark.parametrize(
    "kw",
    [dict(causal="aux"), dict(causal="predictor", qk_norm=True, attn_impl="sdpa"), dict(causal="aux", norm="post")],
)
def test_routed_caches_hold_only_routed_tokens(kw):
    """Prefill + decoding leaves in each routed layer's cache exactly the tokens causal routing sends through it
    (not every token), in full layers every token (decoding equals the forward: test_models_contract.py)."""
    m = model(gate="sigmoid", **kw).eval()
    B, T, T0 = 3, 24, 5
    x = torch.randint(0, 256, (B, T))
    with torch.no_grad():
        _, infos, _ = m.trunk(x, "causal")
        cache = m.new_cache(B, T)
        m.prefill(x[:, :T0], cache)
        for t in range(T0, T):
            m.decode_step(x[:, t : t + 1], t, cache)
    routed = iter(infos)
    for layer, c in enumerate(cache):
        if m.cfg.is_routed(layer):
            taken = next(routed).taken  # [B, T]
            assert torch.equal(c.len, taken.sum(1)) and (c.len < T).all()  # not every token
        else:
            assert (c.len == T).all()


def test_predictor_does_not_touch_the_lm():
    m = model(n_layers=2)
    x = torch.randint(0, 256, (2, 32))
    _, infos, _ = m.trunk(x, "topk")
    from mixdepth.models.routing import bce

    bce(infos[0].pred, infos[0].target).backward()
    assert m.embed.weight.grad is None and m.blocks[0].mlp.w13.weight.grad is None
    assert m.blocks[1].predictor.fc1.weight.grad.abs().sum() > 0


def test_causal_metrics_in_unit_interval():
    m = model().eval()
    x = torch.randint(0, 256, (3, 33))
    sums = {k: float(v) for k, v in m.eval_sums(x[:, :-1], x[:, 1:]).items()}
    out = m.eval_summary(sums)
    assert out["val_loss"] > 0 and out["val_loss_causal"] > 0
    for key in ("predictor_accuracy", "precision", "recall", "realised_capacity", "aux_accuracy", "mlp_accuracy"):
        assert 0 <= out[key] <= 1, key
    assert out["topk_capacity"] == pytest.approx(4 / 32)


# ---- FLOPs and parameters --------------------------------------------------------------------------------
def test_routed_layers_are_cheaper_than_dense():
    from mixdepth.models.dense import DenseConfig

    dense, mod = DenseConfig(**SMALL), MoDConfig(**SMALL)
    assert mod.flops_per_token() < dense.flops_per_token()
    assert MoDConfig(**SMALL, capacity=1.0).flops_per_token() > dense.flops_per_token()  # + router/predictor


@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=True, qk_norm=True, route_every=3, predictor_hidden=5)])
def test_active_params_count_routed_blocks_at_their_share(kw):
    """active = total minus the routed blocks' weights at the unrouted share 1 - k/T (total and nonembed against
    the module: test_models_contract.py)."""
    cfg = MoDConfig(**{**SMALL, "n_layers": 3, **kw})
    n = cfg.n_params()
    skipped = cfg.n_routed * (1 - cfg.k / cfg.seq_len) * cfg.block_params()
    assert cfg.n_routed >= 1 and n["active"] == round(n["total"] - skipped)


# ---- config and registry ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(capacity=0.0), "capacity"),
        (dict(capacity=1.5), "capacity"),
        (dict(route_every=0), "route_every"),
        (dict(route_offset=-1), "route_offset"),
        (dict(gate="relu"), "gate"),
        (dict(routing="hash"), "routing"),
        (dict(causal="oracle"), "causal"),
        (dict(aux_weight=-1.0), "aux_weight"),
    ],
)
def test_bad_values_raise_one_line(kw, msg):
    with pytest.raises(ModelConfigError, match=msg) as e:
        MoDConfig(**kw)
    assert "\n" not in str(e.value)


def test_registry_and_sweep_plan_for_mod():
    from mixdepth.config import Shape, load_config, model_config

    assert MODELS["mod"] == (MoDConfig, MoDLM)
    lab = load_config(CONF, "isoflop", ["sweep.archs=[dense,mod]", "model.capacity=0.25"])
    m = model_config(lab, "mod", Shape(32, 2, 2))
    assert isinstance(m, MoDConfig) and m.capacity == 0.25 and m.route_every == 2 and m.gate == "identity"
    assert not hasattr(model_config(lab, "dense", Shape(32, 2, 2)), "capacity")
    from sweeps.plan import plan

    trials, _ = plan(lab, "test")
    archs = {t.arch for t in trials}
    assert archs == {"dense", "mod"}
    for t in trials:
        assert t.flops_per_token == t.model.flops_per_token() and t.params == t.model.n_params()


def test_router_fp32_predictor_in_autocast_dtype():
    """Under bf16 autocast the router's scores are computed in fp32 (they decide top-k); the predictor's matmuls
    run in bf16 (a stop-grad classifier) and only its logits come back as fp32."""
    from mixdepth.models.routing import CausalPredictor, Router

    torch.manual_seed(0)
    router, pred = Router(32), CausalPredictor(32, 8)
    x = torch.randn(2, 5, 32)
    seen = {}
    pred.fc1.register_forward_hook(lambda m, i, o: seen.update(fc1=o.dtype))
    with torch.autocast("cpu", torch.bfloat16):
        r, p = router(x.bfloat16()), pred(x.bfloat16())
    assert r.dtype == p.dtype == torch.float32 and seen["fc1"] == torch.bfloat16
    torch.testing.assert_close(r, (x.bfloat16().float() @ router.proj.weight.float().T).squeeze(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton route kernels under inductor need a GPU")
@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_compiled_matches_eager_gpu(mode):
    """``model.compile()`` (inductor, the training path) traces the routed scatter-add as plain indexing and the
    gather's backward through the inverse map: loss and every gradient equal eager's (Triton kernels), fp32."""
    m = model(attn_impl="sdpa").cuda()
    m.route_mode = mode
    x = torch.randint(0, m.cfg.vocab_size, (3, 33), device="cuda")

    def run():
        m.zero_grad(set_to_none=True)
        loss = m.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        # a parameter outside the loss's graph (the causal rule's predictor) has no grad eagerly, zeros compiled
        return loss.detach(), {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in m.named_parameters()}

    loss_e, grads_e = run()
    m.compile()
    loss_c, grads_c = run()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert sum(bool(g.any()) for g in grads_e.values()) > 10
    for n, g in grads_e.items():
        torch.testing.assert_close(grads_c[n], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
