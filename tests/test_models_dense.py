import pytest
import torch

from mixdepth.models import MODELS
from mixdepth.models.dense import DenseConfig, DenseLM, ModelConfigError


@pytest.mark.parametrize("tie", [False, True])
def test_every_parameter_is_active(tie):
    """A dense model touches every weight for every token (the shared counts: test_models_contract.py)."""
    n = DenseConfig(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, qk_norm=True, tie_embeddings=tie).n_params()
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
        (dict(residual="bf16"), "model.residual must be"),
    ],
)
def test_bad_shapes_raise_one_line(kw, msg):
    with pytest.raises(ModelConfigError, match=msg) as e:
        DenseConfig(**kw)
    assert "\n" not in str(e.value)


def test_registry():
    assert MODELS["dense"] == (DenseConfig, DenseLM)
