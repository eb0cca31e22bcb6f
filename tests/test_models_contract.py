"""What every registered family (``MODELS``) must do, from one parametrised test each: analytic FLOPs against
FlopCounterMode, parameter counts against the module, training steps, prefix invariance in causal mode, and
decoding equal to the forward where the family decodes.

Cases are (arch, overrides of BASE): every family of MODELS at its defaults (so a new family is picked up with no
edit here), the variants that take other code paths, and the shapes the per-family tests used to check. The
per-family files keep what is specific to a family.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from kernels.grouped_mlp import grouped_swiglu_naive
from kernels.linear_ce import linear_cross_entropy_naive
from kernels.testing import assert_close
from mixdepth.models import MODELS
from mixdepth.models import dense as dense_module
from mixdepth.models import moe as moe_module
from mixdepth.models.decoding import Decoder

BASE = dict(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=16, vocab_size=64, attn_impl="naive")

_MODE = dict(n_layers=2)
CASES = (
    [(arch, {}) for arch in MODELS]
    + [
        ("dense", dict(norm="post")),
        ("mod", dict(routing="random")),
        ("mod", dict(causal="aux", gate="sigmoid")),
        ("mod", dict(causal="aux", gate="sigmoid", norm="post")),
        ("mod", dict(gate="sigmoid", qk_norm=True, attn_impl="sdpa")),
        ("moda", dict(depth_kv="attn")),
        ("moda", dict(depth_kv="attn+ffn+extra", depth_window=2)),
        ("moda", dict(norm="post")),
        ("moda", dict(depth_kv="attn+ffn+extra", norm="post", qk_norm=True, depth_window=2)),
    ]
    + [
        ("mode", dict(_MODE, variant=v, expert_routing=r, capacity=0.5, top_k=2))
        for v in ("staged", "integrated")
        for r in ("token_choice", "expert_choice")
    ]
)

_T64 = dict(seq_len=64, vocab_size=256)
_MOD = dict(seq_len=32, vocab_size=256)
_MODA = dict(d_model=64, n_heads=4, n_kv_heads=2, seq_len=32)
FLOP_CASES = CASES + [
    ("dense", dict(_T64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4)),
    ("dense", dict(_T64, d_model=96, n_layers=3, n_heads=6, n_kv_heads=2, qk_norm=True)),
    ("dense", dict(_T64, d_model=64, n_layers=2, n_kv_heads=1, norm="post", tie_embeddings=True, d_ff=200)),
    ("mod", dict(_T64, d_model=64, n_layers=4, n_heads=4, n_kv_heads=4)),
    ("mod", dict(_T64, d_model=96, n_layers=3, n_heads=6, qk_norm=True, capacity=0.25, route_offset=0)),
    ("mod", dict(_T64, d_model=64, n_layers=2, n_kv_heads=1, norm="post", route_every=1, predictor_hidden=24)),
    ("moda", dict(_MODA, depth_kv="attn", n_kv_heads=4)),
    ("moda", dict(_MODA, depth_kv="attn+ffn", qk_norm=True)),
    ("moda", dict(_MODA, depth_kv="attn+ffn+extra", norm="post", n_kv_heads=1)),
    ("moda", dict(_MODA, depth_kv="attn+ffn+extra", depth_window=2)),
    ("mode", dict(_MODE, variant="staged", capacity=0.5)),
    ("mode", dict(_MODE, capacity=0.25, expert_routing="expert_choice", top_k=2, n_kv_heads=4)),
    ("mode", dict(_MODE, variant="integrated", top_k=2, n_noop=2, route_every=1)),
    ("mode", dict(_MODE, variant="integrated", expert_routing="expert_choice", expert_capacity=0.75, qk_norm=True)),
]
PARAM_CASES = (
    CASES
    + [("dense", dict(d_model=64, n_layers=3, qk_norm=True, vocab_size=256, tie_embeddings=t)) for t in (False, True)]
    + [
        ("mod", dict(_MOD, n_layers=3)),
        ("mod", dict(_MOD, n_layers=3, tie_embeddings=True, qk_norm=True, route_every=3, predictor_hidden=5)),
    ]
    + [("moda", dict(d_model=64, depth_kv=v)) for v in ("attn", "attn+ffn", "attn+ffn+extra")]
    + [
        ("moda", dict(d_model=64, qk_norm=True, depth_window=1)),
        ("mode", _MODE),
        ("mode", dict(_MODE, variant="integrated", n_noop=2, top_k=2, tie_embeddings=True, qk_norm=True)),
        ("mode", dict(n_layers=3, route_every=1, expert_routing="expert_choice", expert_d_ff=24)),
    ]
)
TRAIN_CASES = (
    CASES
    + [("mod", dict(_MOD, n_layers=2, routing=r)) for r in ("learned", "random")]
    + [
        ("moda", dict(d_model=64, n_layers=3, depth_kv=v, norm=n))
        for v in ("attn", "attn+ffn", "attn+ffn+extra")
        for n in ("pre", "post")
    ]
)


def is_causal(kw: dict) -> bool:
    """Expert choice picks each expert's tokens over the whole sequence, later tokens included (models/mode.py)."""
    return kw.get("expert_routing") != "expert_choice"


def decodes(arch: str, kw: dict) -> bool:
    """Families with the generate loop; random routing draws afresh per call, which one-token steps cannot replay."""
    return issubclass(MODELS[arch][1], Decoder) and is_causal(kw) and kw.get("routing") != "random"


CAUSAL_CASES = [c for c in CASES if is_causal(c[1])] + [
    ("mod", dict(_MOD, causal="predictor", gate="sigmoid")),
    ("mod", dict(_MOD, causal="aux", gate="sigmoid")),
    ("moda", dict(d_model=64, norm="post")),
]
DECODE_CASES = [c for c in CASES if decodes(*c)] + [
    ("mod", dict(_MOD, causal="aux", gate="sigmoid")),
    ("mod", dict(_MOD, causal="predictor", gate="sigmoid", qk_norm=True, attn_impl="sdpa")),
    ("mod", dict(_MOD, causal="aux", gate="sigmoid", norm="post")),
    ("moda", dict(d_model=64)),
    ("moda", dict(d_model=64, depth_kv="attn+ffn+extra", norm="post", qk_norm=True, depth_window=2)),
]


def ids(cases):
    return [arch + "".join(f"-{k}={v}" for k, v in kw.items()) for arch, kw in cases]


def build(arch: str, kw: dict) -> nn.Module:
    """The family at BASE + kw, seed 0, then unit-scale linear layers and embeddings: routing decisions then
    split tokens (at the default init every router logit is ~0 and a routed family routes all or nothing)."""
    cfg_cls, lm_cls = MODELS[arch]
    torch.manual_seed(0)
    model = lm_cls(cfg_cls(**{**BASE, **kw}))
    torch.manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=m.in_features**-0.5)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight)
    return model


def causal(model: nn.Module) -> nn.Module:
    """The model in its causal mode: routed families (``route_mode``) route by their causal rule."""
    if hasattr(model, "route_mode"):
        model.route_mode = "causal"
    return model


def tokens(model: nn.Module, B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def summary(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """eval_summary of one batch's eval_sums (held-out statistics are computed without autograd, as in lit.py)."""
    with torch.no_grad():
        return model.eval_summary({k: float(v) for k, v in model.eval_sums(x, y).items()})


def test_cases_cover_every_registered_family():
    for cases in (CASES, FLOP_CASES, PARAM_CASES, TRAIN_CASES, CAUSAL_CASES):
        assert {arch for arch, _ in cases} == set(MODELS)
    assert {arch for arch, _ in DECODE_CASES} == {a for a, (_, lm) in MODELS.items() if issubclass(lm, Decoder)}
    assert {"mod", "mode", "moda"} <= {arch for arch, _ in DECODE_CASES}


# ---- FLOPs and parameters -----------------------------------------------------------------------------------
def attention_tokens(cfg, layer: int, T: int) -> int:
    """Tokens one layer's attention runs over per sequence: k in a MoD-routed (or staged MoDE) layer, else T."""
    routed = hasattr(cfg, "is_routed") and cfg.is_routed(layer) and getattr(cfg, "staged", True)
    return cfg.k if routed else T


@pytest.mark.parametrize("arch,kw", FLOP_CASES, ids=ids(FLOP_CASES))
def test_analytic_flops_match_counter(arch, kw, monkeypatch):
    """Analytic training-forward FLOPs vs FlopCounterMode on the naive CPU path, within 2%.

    The analytic count is flops_per_token at the realised expert routing where the family reports one (MoDE's
    ``realised_flops_per_token``: token choice is data-dependent). The counter sees the reference's full n x n
    attention scores and values where the convention counts the mean causal context (n+1)/2 (n = T, or k among
    a routed layer's tokens): swapped here. It ignores Triton ops, so the grouped experts run their reference
    (plain matmuls, 6·d·F_e per real assignment); index ops (gather, scatter, sort) count nothing either way.
    The fused LM loss runs its two gradient matmuls in the forward (and its FLOP formula counts them there): its
    reference runs instead, whose forward is the convention's head, 2·d·V per token.
    Left inside the 2%: multiply-sums the counter does not see (MoD's router score and predictor output layer,
    2·d + 2·h per token and routed layer; a MoDA layer reading one slot, 2·Hq·hd per token).
    """
    monkeypatch.setattr(moe_module, "grouped_swiglu", grouped_swiglu_naive)
    monkeypatch.setattr(dense_module, "linear_cross_entropy", linear_cross_entropy_naive)
    model = build(arch, {**kw, "attn_impl": "naive"})  # SDPA on CPU is invisible to the counter
    cfg = model.cfg
    B, T = 2, cfg.seq_len
    x = tokens(model, B, T)
    with FlopCounterMode(display=False) as fc:
        model(x, x)  # training forward: routers, predictors, aux losses, LM loss
    per_token = summary(model, x, x).get("realised_flops_per_token", cfg.flops_per_token())
    per = 4 * cfg.n_heads * cfg.head_dim * B  # QK^T + AV per (query, key) pair
    ns = [attention_tokens(cfg, layer, T) for layer in range(cfg.n_layers)]
    expected = per_token * B * T + sum(per * (n * n - n * (n + 1) / 2) for n in ns)
    assert fc.get_total_flops() == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("arch,kw", PARAM_CASES, ids=ids(PARAM_CASES))
def test_param_count_matches_module(arch, kw):
    """total = the module's parameters (tied embeddings once), nonembed = total - the input embedding, and the
    active parameters per token at most all of them (each family's own rule for them: its test file)."""
    model = build(arch, kw)
    cfg = model.cfg
    n = cfg.n_params()
    assert n["total"] == sum(p.numel() for p in model.parameters())
    assert n["nonembed"] == n["total"] - cfg.vocab_size * cfg.d_model
    assert 0 < n["active"] <= n["total"]


# ---- training ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,kw", TRAIN_CASES, ids=ids(TRAIN_CASES))
def test_training_steps(arch, kw):
    """Three AdamW steps on one batch: every parameter gets a finite, nonzero gradient at every step (routers,
    predictors and experts included: all reach the objective), the loss falls, and the held-out sums give a
    positive val_loss."""
    model = build(arch, kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = tokens(model, 4, model.cfg.seq_len + 1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert torch.isfinite(model.loss(x[:, :-1], x[:, 1:]))
    assert summary(model, x[:, :-1], x[:, 1:])["val_loss"] > 0


@pytest.mark.parametrize("arch,kw", CASES, ids=ids(CASES))
def test_loss_terms_are_the_objective_and_the_plain_lm_loss(arch, kw):
    """``loss_terms``: its objective is ``loss``'s, bit for bit, and its LM loss the mean next-token cross-entropy of
    the same pass, checked against the unfused cross-entropy of the logits and against the held-out statistics
    (eval_sums' loss_sum / tokens). Both routed references run the training routing (top-k, ``route_mode``'s default;
    the pass eval_sums makes first), so they see the tokens the objective's pass routed; random routing draws the same
    scores for each call (same seed); the module's train/eval flag changes nothing (no dropout, no batch statistics), so
    all four calls run in train mode as training does. The aux losses are positive in top-k mode: a routed family's
    objective lies above its LM loss; in causal mode, and in a family without aux losses, the two are one value."""
    model = build(arch, kw)
    x = tokens(model, 2, model.cfg.seq_len + 1)
    x, y = x[:, :-1], x[:, 1:]

    def seeded(f, *args):
        torch.manual_seed(0)
        return f(*args)

    loss, (objective, lm) = seeded(model.loss, x, y), seeded(model.loss_terms, x, y)
    logits, sums = seeded(model, x), seeded(model.eval_sums, x, y)  # [B, T, V], held-out sums
    torch.testing.assert_close(objective, loss, rtol=0, atol=0)
    plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    torch.testing.assert_close(lm, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lm, sums["loss_sum"] / sums["tokens"], rtol=1e-6, atol=0)
    if hasattr(model, "with_aux_losses"):
        assert objective > lm + 1e-4, (objective, lm)
        torch.manual_seed(0)
        objective, lm = causal(model).loss_terms(x, y)
    torch.testing.assert_close(objective, lm, rtol=0, atol=0)


@pytest.mark.parametrize("arch,kw", CASES, ids=ids(CASES))
def test_residual_stream_in_autocast_dtype(arch, kw):
    """``residual='autocast'``: under autocast (bf16 on a GPU, fp16 on the CPU, whose interpreted kernels have no
    bf16) the stream reaches the head in autocast's dtype (post-norm, MoE and gated outputs included), where the
    default keeps it fp32; loss and every gradient equal the fp32 stream's within that dtype's rounding (loss to
    one eps, gradients to 20 eps relative RMS). Without autocast the option changes nothing, bit for bit."""
    dev, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float16)
    eps = torch.finfo(dtype).eps
    x = tokens(build(arch, kw), 2, BASE["seq_len"] + 1).to(dev)
    out = {}
    for residual in ("fp32", "autocast"):
        for autocast in (False, True):
            model = build(arch, {**kw, "residual": residual}).to(dev)
            seen = []
            head_loss = model.head_loss
            model.head_loss = lambda h, t=None, f=head_loss, s=seen: (s.append(h.dtype), f(h, t))[1]
            with torch.autocast(dev, dtype, enabled=autocast):
                loss = model.loss(x[:, :-1], x[:, 1:])
            loss.backward()
            grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}
            out[residual, autocast] = loss.detach(), seen, grads
    assert out["fp32", True][1] == [torch.float32] and out["autocast", True][1] == [dtype]
    assert out["autocast", False][1] == [torch.float32]
    torch.testing.assert_close(out["autocast", False][0], out["fp32", False][0], rtol=0, atol=0)
    for n, g in out["fp32", False][2].items():
        torch.testing.assert_close(out["autocast", False][2][n], g, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
    (ref, _, ref_grads), (loss, _, grads) = out["fp32", True], out["autocast", True]
    torch.testing.assert_close(loss, ref, rtol=eps, atol=0)
    for n, g in ref_grads.items():
        assert_close(n, g, grads[n], 20 * eps)


# ---- causality and decoding --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,kw", CAUSAL_CASES, ids=ids(CAUSAL_CASES))
def test_causal_mode_is_prefix_invariant(arch, kw):
    """In causal mode the logits at positions < t do not change when tokens from t on change. Where a MoD router
    decides, it routes some but not all tokens (the test has teeth). Random routing draws the same scores for
    both passes (same seed): its decisions are causal too."""
    model = causal(build(arch, kw)).eval()
    T, t = model.cfg.seq_len, model.cfg.seq_len // 2 + 1
    x = tokens(model, 2, T)
    y = x.clone()
    y[:, t:] = tokens(model, 2, T - t, seed=1)
    with torch.no_grad():
        torch.manual_seed(0)
        a = model(x)
        torch.manual_seed(0)
        b = model(y)
        if hasattr(model, "route_mode"):
            infos = model.trunk(x, "causal")[1]
            if infos:
                taken = torch.stack([i.taken for i in infos])
                assert taken.any() and not taken.all()
    torch.testing.assert_close(a[:, :t], b[:, :t])


@pytest.mark.parametrize("arch,kw", DECODE_CASES, ids=ids(DECODE_CASES))
def test_decoding_matches_forward(arch, kw):
    """Prefill + one-token decode steps (teacher-forced) give the causal forward's logits; greedy ``generate``
    equals greedy decoding by full forwards; sampling keeps the prompt and stays in the vocabulary; the last
    sampled token is never fed back, so a full-length prompt may take one new token but not two."""
    model = causal(build(arch, kw)).eval()
    cfg = model.cfg
    B, T, T0 = 2, cfg.seq_len, 5
    x = tokens(model, B, T)
    with torch.no_grad():
        full = model(x)  # [B, T, V]
        cache = model.new_cache(B, T)
        steps = [model.prefill(x[:, :T0], cache)]
        steps += [model.decode_step(x[:, t : t + 1], t, cache)[:, None] for t in range(T0, T)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)
    out = model.generate(x[:, :6], 4, temperature=0)
    ref = x[:, :6]
    with torch.no_grad():
        for _ in range(4):
            ref = torch.cat([ref, model(ref)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)
    g = torch.Generator().manual_seed(0)
    out = model.generate(x[:, :T0], 8, temperature=0.8, top_k=5, generator=g)
    assert out.shape == (B, T0 + 8) and torch.equal(out[:, :T0], x[:, :T0])
    assert 0 <= out.min() and out.max() < cfg.vocab_size
    assert model.generate(x, 1, temperature=0).shape == (B, T + 1)
    with pytest.raises(ValueError, match="seq_len") as e:
        model.generate(x, 2)
    assert "\n" not in str(e.value)


# ---- compile scopes ----------------------------------------------------------------------------------------
def compiled_step(arch: str, kw: dict, x: torch.Tensor, device: str = "cpu", **compile_kw):
    """One loss and backward of the family at ``kw``, eager and compiled (``compile_kw``): (losses, grads) of
    each; a parameter outside the loss's graph (an unused causal predictor) counts as a zero gradient."""
    out = []
    for compiled in (False, True):
        model = build(arch, kw).to(device)
        if compiled:
            model.compile(**compile_kw)
        loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}
        out.append((loss.detach(), grads))
    return out


@pytest.mark.parametrize("arch", list(MODELS))
def test_block_scope_compiles_one_graph_per_kind_of_block(arch):
    """``compile(scope="block")`` (train.compile_scope, aot_autograd): the number of graphs does not grow with
    depth (one per kind of block, the head; per-block recompiles would hit dynamo's limit and leave deep blocks
    eager) and the loss and every gradient equal eager's."""
    from torch._dynamo.utils import counters

    graphs = []
    for n_layers in (4, 8):
        kw = dict(n_layers=n_layers, attn_impl="sdpa")
        torch._dynamo.reset()
        counters.clear()
        x = tokens(build(arch, kw), 2, BASE["seq_len"] + 1)
        (loss, grads), (c_loss, c_grads) = compiled_step(arch, kw, x, backend="aot_eager", scope="block")
        graphs.append(counters["stats"]["unique_graphs"])
        torch.testing.assert_close(c_loss, loss)
        for n, g in grads.items():
            torch.testing.assert_close(c_grads[n], g, msg=lambda m, n=n: f"{n}: {m}")
    torch._dynamo.reset()
    assert graphs[0] == graphs[1] > 0, graphs
    with pytest.raises(ValueError, match="compile scope must be 'model' or 'block'"):
        build(arch, {}).compile(scope="layer")


# One compiled loss and backward in a fresh process: AOTAutograd's cache counters and the loss, as JSON.
_CACHED_STEP = """
import json, sys, torch
from torch._dynamo.utils import counters
from mixdepth.models import MODELS
config, model = MODELS[sys.argv[1]]
torch.manual_seed(0)
m = model(config(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=16, vocab_size=64))
m.compile(scope="block")
x = torch.randint(0, 64, (2, 17))
loss = m.loss(x[:, :-1], x[:, 1:])
loss.backward()
print(json.dumps({"loss": loss.item(), **counters["aot_autograd"]}))
"""


@pytest.mark.parametrize("arch", ["mod", "mode"])
def test_routed_graphs_are_served_from_the_compile_cache(arch, tmp_path):
    """The routers' fp32 region (an autocast context in the graph) made AOTAutograd's cache bypass the routed
    families' graphs, so each process traced them again: a second process with the same on-disk caches now takes
    them from the cache (no bypass), with the same loss."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", _CACHED_STEP, arch], env=env, capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first.get("autograd_cache_bypass", 0) == second.get("autograd_cache_bypass", 0) == 0, runs
    assert first.get("autograd_cache_saved", 0) > 0 and second.get("autograd_cache_hit", 0) > 0, runs
    assert second["loss"] == first["loss"], runs


# A graph holding an autograd.Function (as every kernel's op on CUDA), compiled in a fresh process: argv[1] 'salted'
# calls cache_compiled_graphs with the sources under argv[2], 'plain' does not; the cache counters, as JSON.
_FUNCTION_STEP = """
import json, sys, torch
from torch._dynamo.utils import counters
from mixdepth.models.compile_cache import cache_compiled_graphs

class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g

if sys.argv[1] == "salted":
    cache_compiled_graphs([sys.argv[2]])
f = torch.compile(lambda x: Cube.apply(x).sum())
x = torch.arange(4.0, requires_grad=True)
f(x).backward()
assert torch.equal(x.grad, 3 * x.detach() ** 2)
print(json.dumps(counters["aot_autograd"]))
"""


def test_graphs_with_autograd_functions_are_cached_keyed_by_their_sources(tmp_path):
    """AOTAutograd's cache bypasses a graph holding an autograd.Function unless allowed; cache_compiled_graphs
    allows it with the key salted by the digest of the sources that define them: a second process hits, and after
    an edit of those sources the same graph misses instead of replaying the old code."""
    src = tmp_path / "src" / "ops"
    src.mkdir(parents=True)
    (src / "cube.py").write_text("CUBE = 3\n")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}

    def step(mode):
        out = subprocess.run([sys.executable, "-c", _FUNCTION_STEP, mode, str(src)], env=env, capture_output=True,
                             text=True, timeout=600)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    plain = step("plain")
    assert plain.get("autograd_cache_bypass", 0) > 0 and plain.get("autograd_cache_saved", 0) == 0, plain
    first, second = step("salted"), step("salted")
    assert first.get("autograd_cache_bypass", 0) == 0 and first.get("autograd_cache_saved", 0) > 0, first
    assert second.get("autograd_cache_hit", 0) > 0 and second.get("autograd_cache_miss", 0) == 0, second
    (src / "cube.py").write_text("CUBE = 4\n")
    edited = step("salted")
    assert edited.get("autograd_cache_hit", 0) == 0 and edited.get("autograd_cache_miss", 0) > 0, edited


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor with CUDA graphs needs a GPU")
@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("scope", ["model", "block"])
def test_compiled_with_cuda_graphs_matches_eager_gpu(arch, scope):
    """What a GPU sweep trains: Inductor + CUDA graphs (reduce-overhead) at either compile scope, fp32 (bf16
    rounding could flip routing decisions between the two): loss and every gradient equal eager's, and no
    partition of the step fell out of CUDA graphs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    kw = dict(attn_impl="sdpa")
    x = tokens(build(arch, kw), 3, BASE["seq_len"] + 1).cuda()
    torch.compiler.cudagraph_mark_step_begin()
    (loss, grads), (c_loss, c_grads) = compiled_step(arch, kw, x, "cuda", mode="reduce-overhead", scope=scope)
    torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=1e-6)
    for n, g in grads.items():
        torch.testing.assert_close(c_grads[n], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    torch._dynamo.reset()
