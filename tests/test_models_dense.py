import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mixdepth.models import MODELS
from mixdepth.models.dense import DenseConfig, DenseLM, ModelConfigError


def counted_forward_flops(model, x) -> int:
    with FlopCounterMode(display=False) as fc:
        model(x)
    return fc.get_total_flops()


@pytest.mark.parametrize(
    "kw",
    [
        dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4),
        dict(d_model=96, n_layers=3, n_heads=6, n_kv_heads=2, qk_norm=True),
        dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=1, norm="post", tie_embeddings=True, d_ff=200),
    ],
)
def test_analytic_flops_match_counter(kw):
    """Analytic forward FLOPs vs FlopCounterMode on the naive path, within 2%.

    The counter sees the full T x T score and value matmuls; the convention counts the mean causal context
    (T+1)/2, so the expected counter value swaps one for the other.
    """
    cfg = DenseConfig(seq_len=64, vocab_size=256, attn_impl="naive", **kw)
    model = DenseLM(cfg)
    B, T = 2, cfg.seq_len
    counted = counted_forward_flops(model, torch.randint(0, 256, (B, T)))
    attn_causal = cfg.n_layers * 4 * cfg.n_heads * cfg.head_dim * (T + 1) / 2 * B * T
    attn_full = cfg.n_layers * 4 * cfg.n_heads * cfg.head_dim * T * T * B
    expected = cfg.flops_per_token() * B * T - attn_causal + attn_full
    assert counted == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("tie", [False, True])
def test_param_count_matches_module(tie):
    cfg = DenseConfig(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, qk_norm=True, tie_embeddings=tie)
    model = DenseLM(cfg)
    n = cfg.n_params()
    assert n["total"] == sum(p.numel() for p in model.parameters())
    assert n["nonembed"] == n["total"] - cfg.vocab_size * cfg.d_model
    assert n["active"] == n["total"]


def test_sdpa_matches_naive_and_is_causal():
    torch.manual_seed(0)
    cfg = DenseConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32)
    a = DenseLM(cfg)
    b = DenseLM(DenseConfig(**{**cfg.__dict__, "attn_impl": "naive"}))
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(a(x), b(x), rtol=1e-4, atol=1e-5)
    y = x.clone()
    y[:, 20:] = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(a(x)[:, :20], a(y)[:, :20])  # positions < 20 never see later tokens


def test_loss_decreases_on_repeated_batch():
    torch.manual_seed(0)
    model = DenseLM(DenseConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 256, (4, 17))
    first = model.loss(x[:, :-1], x[:, 1:]).item()
    for _ in range(30):
        opt.zero_grad()
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
    assert model.loss(x[:, :-1], x[:, 1:]).item() < 0.5 * first


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(d_model=60, n_heads=8), "divisible"),
        (dict(n_heads=4, n_kv_heads=3), "divisible"),
        (dict(norm="sandwich"), "norm"),
        (dict(n_layers=0), "positive"),
        (dict(attn_impl="flash9"), "attn_impl"),
    ],
)
def test_bad_shapes_raise_one_line(kw, msg):
    with pytest.raises(ModelConfigError, match=msg) as e:
        DenseConfig(**kw)
    assert "\n" not in str(e.value)


def test_registry():
    assert MODELS["dense"] == (DenseConfig, DenseLM)
