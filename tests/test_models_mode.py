"""MoDE (paper 003, Sec. 4.3): staged and integrated variants, no-op experts, routing options, FLOPs, params.

Shapes stay tiny: conftest switches the Triton interpreter on, so grouped_swiglu runs interpreted on CPU.
"""

from pathlib import Path

import pytest
import torch
from torch import nn

from mixdepth.models import MODELS
from mixdepth.models.blocks import Rotary
from mixdepth.models.dense import ModelConfigError
from mixdepth.models.mod import MoDLM
from mixdepth.models.mode import MoDEConfig, MoDELM, StagedBlock
from mixdepth.models.moe import MoE, expert_tokens

CONF = Path(__file__).resolve().parents[1] / "conf"
SMALL = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16, vocab_size=64, attn_impl="naive")


def spread(model: nn.Module) -> nn.Module:
    """Unit-scale embeddings and routers so that routing decisions actually differ between tokens."""
    torch.manual_seed(1)
    with torch.no_grad():
        if hasattr(model, "embed"):
            nn.init.normal_(model.embed.weight)
        for m in model.modules():
            if isinstance(m, MoE):
                nn.init.normal_(m.router.weight, std=m.router.weight.shape[1] ** -0.5)
            if isinstance(m, StagedBlock):
                nn.init.normal_(m.router.proj.weight, std=m.router.proj.weight.shape[1] ** -0.5)
    return model


def moe(**kw) -> MoE:
    torch.manual_seed(0)
    args = dict(
        d_model=8,
        d_expert=8,
        n_experts=2,
        n_noop=1,
        top_k=1,
        routing="token_choice",
        capacity=1.0,
        init_std=0.5,
        out_std=0.5,
    )
    return MoE(**{**args, **kw})


def capture_logits(m: MoE) -> dict:
    """Keeps the router logits of the next call (with their .grad after backward)."""
    store, orig = {}, m.logits

    def logits(x):
        out = orig(x)
        out.retain_grad()
        store["l"] = out
        return out

    m.logits = logits
    return store


# ---- FLOPs and parameters ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        dict(variant="staged", capacity=0.5),
        dict(variant="staged", capacity=0.25, expert_routing="expert_choice", top_k=2, n_kv_heads=4),
        dict(variant="integrated", expert_routing="expert_choice", expert_capacity=0.75, qk_norm=True),
    ],
)
def test_realised_flops_equal_planned_where_routing_is_exact(kw):
    """Expert choice (capacity by construction) and staged token choice (exactly top_k real picks per token) use
    the planned number of expert assignments: the realised FLOPs equal the planned ones. (The counter check of
    the realised FLOPs, for every case here: test_models_contract.py.)"""
    cfg = MoDEConfig(**{**SMALL, **kw})
    m = spread(MoDELM(cfg))
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        stats = m.trunk(x, "topk")[2]
    real = float(sum(s.load.sum() for s in stats))
    realised = cfg.realised_flops_per_token(real / x.numel())
    assert realised == pytest.approx(cfg.flops_per_token(), rel=1e-12)


def test_noop_experts_are_free_and_router_counted():
    base = MoDEConfig(**SMALL, variant="integrated", n_noop=0)
    noop = MoDEConfig(**SMALL, variant="integrated", n_noop=4)  # half the picks planned to no-ops
    router = 2 * base.d_model * 4 * base.n_routed
    expert = 2 * base.expert_params() * base.n_routed
    assert noop.flops_per_token() - base.flops_per_token() == pytest.approx(router - expert / 2)
    # realised: all picks real -> top_k·n_routed assignments per token
    assert noop.realised_flops_per_token(1.0 * noop.n_routed) == pytest.approx(base.flops_per_token() + router)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(variant="integrated", n_noop=2, top_k=2, tie_embeddings=True, qk_norm=True),
        dict(variant="staged", n_layers=3, route_every=1, expert_routing="expert_choice", expert_d_ff=24),
    ],
)
def test_active_params_below_total(kw):
    """Experts and (staged) unrouted tokens leave weights untouched: 0 < active < total (total and nonembed
    against the module: test_models_contract.py)."""
    n = MoDEConfig(**{**SMALL, **kw}).n_params()
    assert 0 < n["active"] < n["total"]


# ---- staged ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("routing", ["token_choice", "expert_choice"])
def test_staged_routes_k_tokens_and_aux_on_routed_only(routing):
    torch.manual_seed(0)
    cfg = MoDEConfig(**SMALL, capacity=0.25, expert_routing=routing)
    blk = spread(StagedBlock(cfg))
    seen = {}
    blk.block.mlp.register_forward_hook(lambda mod, inp, out: seen.update(x=inp[0].detach()))  # None: output kept
    x = torch.randn(3, cfg.seq_len, cfg.d_model)
    y, info = blk(x, Rotary(cfg.head_dim, cfg.seq_len), "topk")
    assert (info.taken.sum(1) == cfg.k).all()
    assert torch.equal(y[~info.taken], x[~info.taken]) and not torch.equal(y[info.taken], x[info.taken])
    st = info.mlp  # the MoE's statistics, returned through the RouteInfo
    assert seen["x"].shape == (3, cfg.k, cfg.d_model) and st.tokens == 3 * cfg.k  # MoE saw routed tokens only
    logits = seen["x"].reshape(-1, cfg.d_model).float() @ blk.block.mlp.router.weight.detach().float().T
    assert float(st.z.detach()) == pytest.approx(float(torch.logsumexp(logits, -1).pow(2).mean()), rel=1e-5)
    if routing == "token_choice":
        p = logits.softmax(-1)
        f = torch.bincount(p.argmax(-1), minlength=cfg.n_experts).float() / p.shape[0]
        assert float(st.lb.detach()) == pytest.approx(float(cfg.n_experts * (f * p.mean(0)).sum()), rel=1e-5)


# ---- integrated: no-op experts -----------------------------------------------------------------------------
def test_noop_token_gets_no_update_and_router_gradient():
    m = moe(top_k=1)
    with torch.no_grad():  # no-op wins when x[0] > 0, a real expert otherwise
        m.router.weight.zero_()
        m.router.weight[2, 0] = 10.0
        m.router.weight[0, 1] = 1.0
    x = torch.randn(1, 12, 8)
    x[0, :6, 0] = x[0, :6, 0].abs() + 0.5
    x[0, 6:, 0] = -x[0, 6:, 0].abs() - 0.5
    store = capture_logits(m)
    out, st = m(x)
    noop = torch.zeros(12, dtype=torch.bool)
    noop[:6] = True
    assert (out[0, noop] == 0).all() and (out[0, ~noop].abs().sum(-1) > 0).all()
    assert int(st.skipped) == 6 and float(st.load.sum()) == 6
    (out.pow(2).sum() + st.lb + st.z).backward()
    g = store["l"].grad  # [N, E_tot]
    assert (g[noop].abs().sum(-1) > 0).all()  # via lb / z: the token had no MLP output to differentiate
    assert (g[~noop, 2].abs() > 0).all()  # the no-op logit learns from the real tokens' shared normaliser


def test_noop_logit_gets_lm_gradient_with_a_real_pick():
    """top_k = 2 with one no-op and one real pick: the LM loss alone reaches the no-op logit."""
    m = moe(top_k=2)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[2, 0] = 10.0  # no-op first, then a real expert
        m.router.weight[0, 1] = 1.0
    x = torch.randn(1, 6, 8)
    x[0, :, 0] = x[0, :, 0].abs() + 0.5
    tok, e, _, _, _ = m.route(x)
    assert (e.view(6, 2) == -1).sum(1).eq(1).all()  # each token: one no-op, one real pick
    store = capture_logits(m)
    out, _ = m(x)
    out.pow(2).sum().backward()
    assert (store["l"].grad[:, 2].abs() > 0).all()


def test_moe_aux_losses_reach_the_objective():
    """The MoE returns its statistics (nothing stays on the module): in top-k mode the objective is MoD's plus
    lb_weight·mean(lb) + z_weight·mean(z) of the returned statistics; causal mode adds none."""
    for variant in ("staged", "integrated"):
        cfg = MoDEConfig(**{**SMALL, "n_layers": 4}, variant=variant, lb_weight=0.5, z_weight=0.25)
        m = spread(MoDELM(cfg))
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
        h, infos, stats = m.trunk(x, "topk")
        assert len(stats) == cfg.n_routed == 2
        assert not any(hasattr(mm, "stats") for mm in m.modules() if isinstance(mm, MoE))
        mod = MoDLM.with_aux_losses(m, m.head_loss(h, x), infos, stats, "topk")
        lb, z = sum(s.lb for s in stats) / 2, sum(s.z for s in stats) / 2
        assert m.loss(x, x).item() == pytest.approx((mod + 0.5 * lb + 0.25 * z).item(), rel=1e-6)
        assert m.loss(x, x).item() > mod.item() > 0
        with torch.no_grad():
            assert torch.equal(m(x, x, mode="causal"), m.head_loss(m.trunk(x, "causal")[0], x))


def test_expert_choice_capacity_exact():
    m = moe(routing="expert_choice", capacity=1.0, n_experts=2, n_noop=1)
    x = torch.randn(3, 8, 8)
    C = expert_tokens(8, 1.0, 1, 3)
    assert C == 3
    tok, e, w, lb, _ = m.route(x)
    tok = tok.view(3, 2, C)
    for b in range(3):
        for j in range(2):
            t = tok[b, j]
            assert len(set(t.tolist())) == C and ((t >= b * 8) & (t < (b + 1) * 8)).all()
    _, st = m(x)
    assert st.load.tolist() == [3.0 * C, 3.0 * C] and float(lb) == 0.0
    assert expert_tokens(4, 2.0, 2, 2) == 4  # capped at the sequence


def test_aux_losses_match_hand_computation():
    m = moe(n_experts=2, n_noop=1, top_k=1, d_model=2)
    with torch.no_grad():
        m.router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
    pts = [(2.0, 0.0), (0.0, 2.0), (-1.0, -1.0), (1.0, 0.5)]
    x = torch.tensor([pts])  # [1, 4, 2]
    _, st = m(x)
    import math

    zs, probs_sum, picks = [], [0.0] * 3, [0] * 3
    for a, b in pts:
        lg = [a, b, -a - b]
        lse = math.log(sum(math.exp(v) for v in lg))
        zs.append(lse**2)
        p = [math.exp(v - lse) for v in lg]
        for i in range(3):
            probs_sum[i] += p[i] / 4
        picks[max(range(3), key=lambda i: p[i])] += 1
    lb = 3 * sum(picks[i] / 4 * probs_sum[i] for i in range(3))
    assert picks == [2, 1, 1]
    assert float(st.z.detach()) == pytest.approx(sum(zs) / 4, rel=1e-6)
    assert float(st.lb.detach()) == pytest.approx(lb, rel=1e-6)
    assert st.load.tolist() == [2.0, 1.0] and int(st.skipped) == 1


@pytest.mark.parametrize("kw", [dict(variant="integrated", n_noop=1), dict(variant="staged", capacity=0.5)])
def test_eval_summary_reports_noop_share_and_loads(kw):
    cfg = MoDEConfig(**SMALL, **kw)
    m = spread(MoDELM(cfg)).eval()
    sums = {}
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
        for k, v in m.eval_sums(x, x).items():
            sums[k] = sums.get(k, 0.0) + float(v)
    out = m.eval_summary(sums)
    loads = [out[f"expert_load_{e}"] for e in range(cfg.n_experts)]
    assert sum(loads) == pytest.approx(1.0) and all(0 <= v <= 1 for v in loads)
    assert out["expert_load_min"] == min(loads) and out["expert_load_max"] == max(loads)
    assert 0 <= out["noop_share"] <= 1 and 0 <= out["mlp_skip_share"] <= 1
    if cfg.staged:
        assert out["noop_share"] == 0 and out["realised_flops_per_token"] == pytest.approx(cfg.flops_per_token())
    else:
        assert out["noop_share"] == pytest.approx(out["mlp_skip_share"])  # top_k = 1
        assert 0 < out["noop_share"] < 1
        real = 1 - out["noop_share"]  # real picks per token per layer
        expect = cfg.realised_flops_per_token(real * cfg.n_routed)
        assert out["realised_flops_per_token"] == pytest.approx(expect)


# ---- config and registry -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(variant="both"), "variant"),
        (dict(expert_routing="hash"), "expert_routing"),
        (dict(n_experts=0), "n_experts"),
        (dict(n_noop=-1), "n_noop"),
        (dict(top_k=5), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(expert_capacity=0.0), "expert_capacity"),
        (dict(lb_weight=-1.0), "lb_weight"),
        (dict(capacity=0.0), "capacity"),
    ],
)
def test_bad_values_raise_one_line(kw, msg):
    with pytest.raises(ModelConfigError, match=msg) as e:
        MoDEConfig(**kw)
    assert "\n" not in str(e.value)


def test_defaults():
    c = MoDEConfig(d_model=32, top_k=2)
    assert c.expert_d_ff == c.d_ff // 2 and c.noops == 0 and c.n_total == c.n_experts
    i = MoDEConfig(d_model=32, variant="integrated", n_noop=2, top_k=6)
    assert i.n_total == 6 and i.noops == 2


def test_registry_and_sweep_plan_for_mode():
    from mixdepth.config import Shape, load_config, model_config
    from sweeps.plan import plan

    assert MODELS["mode"] == (MoDEConfig, MoDELM)
    for variant in ("staged", "integrated"):
        lab = load_config(CONF, "isoflop", ["sweep.archs=[dense,mode]", f"model.variant={variant}"])
        m = model_config(lab, "mode", Shape(32, 2, 2))
        assert isinstance(m, MoDEConfig) and m.variant == variant and m.n_experts == 4
        trials, _ = plan(lab, "test")
        assert {t.arch for t in trials} == {"dense", "mode"}
        for t in trials:
            assert t.flops_per_token == t.model.flops_per_token() and t.params == t.model.n_params()
