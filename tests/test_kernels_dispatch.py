"""The one rule by which every op runs its Triton kernels or its reference (kernels.common.dispatch)."""

import pytest
import torch

from kernels.common import dispatch
from kernels.grouped_mlp import grouped_swiglu, grouped_swiglu_naive
from kernels.linear_ce import linear_cross_entropy, linear_cross_entropy_naive
from kernels.moda_attn import moda_attn, moda_attn_naive
from kernels.route_gather_scatter import route_gather, route_gather_naive, route_scatter_add, route_scatter_add_naive

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_empty")  # kernel outputs start as NaN


@pytest.fixture(autouse=True)
def _fuse_small_vocab(monkeypatch):
    """The cases' vocabularies are tiny: let linear_cross_entropy fuse them (it leaves V < 8192 to compiled code)."""
    from kernels.linear_ce import op

    monkeypatch.setattr(op, "FUSE_MIN_VOCAB", 0)


OPS = {  # name -> (op, reference)
    "route_gather": (route_gather, route_gather_naive),
    "route_scatter_add": (route_scatter_add, route_scatter_add_naive),
    "grouped_swiglu": (grouped_swiglu, grouped_swiglu_naive),
    "moda_attn": (moda_attn, moda_attn_naive),
    "linear_cross_entropy": (linear_cross_entropy, linear_cross_entropy_naive),
}


def _call(name: str, dtype: torch.dtype, device: str):
    """(a function of the op or its reference, the differentiable inputs) of one small case of op ``name``."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()

    idx = torch.tensor([[1, 4, 6, 8], [0, 2, 3, 7]], device=device)
    tok, exp = torch.tensor([0, 2, 2, 1], device=device), torch.tensor([1, 0, 1, -1], device=device)
    targets = torch.tensor([0, 10, -100, 3, 3], device=device)
    cases = {
        "route_gather": (lambda fn, x: fn(x, idx), (r(2, 9, 8),)),
        "route_scatter_add": (lambda fn, x, f, w: fn(x, idx, f, w), (r(2, 9, 8), r(2, 4, 8), r(2, 4))),
        "grouped_swiglu": (
            lambda fn, x, w1, w3, w2, wt: fn(x, w1, w3, w2, tok, exp, wt),
            (r(3, 16), r(2, 16, 16), r(2, 16, 16), r(2, 16, 16), r(4)),
        ),
        "moda_attn": (
            lambda fn, *qkv: fn(*qkv),
            (r(1, 2, 5, 16), r(1, 1, 5, 16), r(1, 1, 5, 16), r(1, 1, 5, 2, 16), r(1, 1, 5, 2, 16)),
        ),
        "linear_cross_entropy": (lambda fn, x, w: fn(x, w, targets), (r(5, 8), r(11, 8))),
    }
    return cases[name]


def test_triton_path_is_used():
    assert dispatch.use_triton("op", torch.empty(1, device=DEVICE)), "kernels would silently fall back to naive"


@pytest.mark.parametrize("name", OPS)
def test_bf16_refused_under_interpreter(monkeypatch, name):
    """The interpreter's bf16 dots are wrong (rel-L2 ~1e9): every op refuses bf16 there in one line."""
    monkeypatch.setattr(dispatch, "INTERPRET", True)
    call, inputs = _call(name, torch.bfloat16, DEVICE)
    with pytest.raises(TypeError, match=rf"^{name}: torch\.bfloat16 .*use float32 or float16, or a GPU$") as e:
        call(OPS[name][0], *inputs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("without", ["interpreter", "triton"])
@pytest.mark.parametrize("name", OPS)
def test_plain_cpu_runs_the_reference(monkeypatch, name, without, dtype):
    """CPU tensors without the interpreter (or without Triton at all): every op returns its reference's output
    and gradients, bit for bit (bf16 too: the reference computes in fp32)."""
    monkeypatch.setattr(dispatch, "INTERPRET" if without == "interpreter" else "HAS_TRITON", False)
    call, inputs = _call(name, dtype, "cpu")
    results = []
    for fn in OPS[name]:
        out = call(fn, *inputs)
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
        results.append((out, *torch.autograd.grad(out, inputs, dy)))
    for got, ref in zip(*results, strict=True):
        assert torch.equal(got, ref)
