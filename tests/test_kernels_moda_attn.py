"""MoDA attention kernel vs the naive reference: output and every gradient, ragged shapes, NaN poison.

Without CUDA the Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET=1 before any import).
"""

import os

import pytest
import torch

from kernels.moda_attn import kernel as K
from kernels.moda_attn import moda_attn, moda_attn_naive

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_empty")  # kernel outputs and scratch start as NaN


def rel_err(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error, max abs error) of a against reference b; NaN anywhere fails."""
    a, b = a.double(), b.double()
    if a.numel() == 0:
        return 0.0, 0.0
    assert torch.isfinite(a).all(), "non-finite values (unwritten output?)"
    diff = a - b
    return (diff.norm() / b.norm().clamp_min(1e-30)).item(), diff.abs().max().item()


def make(B, Hk, G, T, S, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(DEV, dtype).requires_grad_()

    return r(B, Hk * G, T, D), r(B, Hk, T, D), r(B, Hk, T, D), r(B, Hk, T, S, D), r(B, Hk, T, S, D)


def run_both(inputs, scale=None, seed=1):
    o = moda_attn(*inputs, scale=scale)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed)).to(o)
    grads = torch.autograd.grad(o, inputs, do)
    o_ref = moda_attn_naive(*inputs, scale=scale)
    grads_ref = torch.autograd.grad(o_ref, inputs, do, allow_unused=True, materialize_grads=True)
    return (o, *grads), (o_ref, *grads_ref)


NAMES = ("o", "dq", "dk", "dv", "dkd", "dvd")


def check(got, ref, tol_rel=1e-5, tol_abs=1e-4):
    for name, a, b in zip(NAMES, got, ref, strict=True):
        assert a.shape == b.shape, name
        rel, mx = rel_err(a, b)
        ref_max = b.abs().max().item() if b.numel() else 0.0
        # a reference that is ~0 (dq at T=1: one key, zero gradient) has no meaningful relative error
        assert mx <= tol_abs * max(1.0, ref_max) and (rel <= tol_rel or ref_max < 1e-4), (name, rel, mx)


# (B, Hk, G, T, S, D): covers T in {1, 7, 33, 70}, S in {0, 1, 3}, G in {1, 2, 3, 6}, D in {16, 32, 64, 128}
CASES = [
    (1, 1, 1, 1, 0, 16),
    (1, 1, 2, 1, 3, 32),
    (1, 2, 1, 7, 1, 32),
    (1, 1, 3, 7, 3, 16),
    (2, 1, 3, 33, 0, 16),
    (1, 2, 2, 33, 1, 64),
    (1, 1, 3, 33, 3, 32),
    (1, 1, 1, 70, 3, 16),
    (1, 1, 2, 70, 0, 32),
    (2, 1, 3, 70, 1, 16),
    (1, 1, 6, 9, 2, 16),
    (1, 1, 2, 7, 1, 128),
]


@pytest.mark.parametrize("B,Hk,G,T,S,D", CASES)
def test_matches_reference_fp32(B, Hk, G, T, S, D):
    got, ref = run_both(make(B, Hk, G, T, S, D))
    check(got, ref)


def test_depth_tiles():
    """Slot loop: many positions per program (ragged last tile) and one position per program (rows < G)."""
    inputs = make(1, 1, 6, 70, 3, 16, seed=3)
    try:
        for cfg in (K.Config(rows=64, warps=1, tile_min_g=99), K.Config(rows=4, warps=1, tile_min_g=99)):
            K.set_config(cfg)
            check(*run_both(inputs))
    finally:
        K.set_config(None)


def test_custom_scale_and_large_logits():
    inputs = make(1, 1, 2, 33, 3, 16, seed=4)
    check(*run_both(inputs, scale=0.9))  # logits ~ +-15: exercises the running-max rescaling


def test_strided_slot_buffer_prefix():
    """A prefix view of a preallocated slot buffer is read in place and matches a contiguous copy."""
    B, Hk, G, T, S_max, n, D = 1, 1, 2, 33, 5, 3, 16
    q, k, v, _, _ = make(B, Hk, G, T, 0, D, seed=5)
    g = torch.Generator().manual_seed(6)
    kbuf = torch.randn(B, Hk, T, S_max, D, generator=g).to(DEV).requires_grad_()
    vbuf = torch.randn(B, Hk, T, S_max, D, generator=g).to(DEV).requires_grad_()
    kd, vd = kbuf[:, :, :, :n], vbuf[:, :, :, :n]
    assert not kd.is_contiguous()
    o = moda_attn(q, k, v, kd, vd)
    do = torch.randn_like(o)
    got = (o, *torch.autograd.grad(o, (q, k, v, kbuf, vbuf), do))
    o_ref = moda_attn_naive(q, k, v, kd, vd)
    ref = (o_ref, *torch.autograd.grad(o_ref, (q, k, v, kbuf, vbuf), do))
    check(got, ref)
    assert got[4][:, :, :, n:].abs().max() == 0  # unused slots get no gradient


@pytest.mark.parametrize("tiles", [False, True])
def test_heads_transposed_layout(tiles):
    """q, k, v as [B, H, T, D] views of [B, T, H, D] tensors (what the projections yield) are read in place, o
    comes back in q's layout, and dO in that layout or contiguous: outputs and every gradient match the
    reference, in the slot loop and in the tensor-core tiles."""
    B, Hk, G, T, S, D = 2, 2, 2, 21, 3, 16
    g = torch.Generator().manual_seed(11)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(DEV).requires_grad_()

    q_, k_, v_ = r(B, T, Hk * G, D), r(B, T, Hk, D), r(B, T, Hk, D)
    kd, vd = r(B, Hk, T, S, D), r(B, Hk, T, S, D)
    q, k, v = (t.transpose(1, 2) for t in (q_, k_, v_))
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    try:
        K.set_config(K.Config(tile_min_g=1, tile_warps=1) if tiles else None)
        for do_layout in ("q", "contiguous"):
            o = moda_attn(q, k, v, kd, vd)
            assert o.stride() == q.stride()
            do = torch.randn(o.shape, generator=g).to(o)
            if do_layout == "q":
                do = do.transpose(1, 2).contiguous().transpose(1, 2)
            got = (o, *torch.autograd.grad(o, (q_, k_, v_, kd, vd), do))
            o_ref = moda_attn_naive(q, k, v, kd, vd)
            ref = (o_ref, *torch.autograd.grad(o_ref, (q_, k_, v_, kd, vd), do))
            check(got, ref)
    finally:
        K.set_config(None)


def test_none_depth_is_plain_causal():
    q, k, v, kd, vd = make(1, 1, 2, 33, 0, 16, seed=7)
    o = moda_attn(q, k, v)
    o_sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.detach(), k.detach().repeat_interleave(2, 1), v.detach().repeat_interleave(2, 1), is_causal=True
    )
    assert rel_err(o, o_sdpa)[0] < 1e-5
    assert rel_err(o, moda_attn(q, k, v, kd, vd))[0] < 1e-6


def test_fp16_interpreter_or_gpu():
    # (bf16 is checked on the GPU by kernels.bench: the Triton 3.9 interpreter's bf16 tl.dot is wrong)
    inputs = make(1, 2, 2, 33, 3, 32, dtype=torch.float16, seed=8)
    got, ref = run_both(inputs)
    for name, a, b in zip(NAMES, got, ref, strict=True):
        assert rel_err(a, b)[0] < 1e-2, name


def test_joint_softmax_not_two_softmaxes():
    """Guards the semantics: one shared denominator, not softmax(seq) @ V + softmax(depth) @ Vd."""
    q, k, v, kd, vd = (t.detach() for t in make(1, 1, 2, 7, 3, 16, seed=9))
    G, D = 2, 16
    s_seq = (q @ k.repeat_interleave(G, 1).transpose(-1, -2)) / D**0.5
    s_seq = s_seq.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril().to(DEV), float("-inf"))
    s_dep = torch.einsum("bhtd,bhtsd->bhts", q, kd.repeat_interleave(G, 1)) / D**0.5
    separate = s_seq.softmax(-1) @ v.repeat_interleave(G, 1) + torch.einsum(
        "bhts,bhtsd->bhtd", s_dep.softmax(-1), vd.repeat_interleave(G, 1)
    )
    ours = moda_attn(q, k, v, kd, vd)
    assert rel_err(ours, moda_attn_naive(q, k, v, kd, vd))[0] < 1e-5
    assert rel_err(ours, separate)[0] > 0.1


def test_reference_gradcheck_fp64():
    g = torch.Generator().manual_seed(10)
    for S in (0, 2):
        ins = tuple(
            torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
            for s in ((1, 2, 3, 4), (1, 1, 3, 4), (1, 1, 3, 4), (1, 1, 3, S, 4), (1, 1, 3, S, 4))
        )
        assert torch.autograd.gradcheck(lambda *a: moda_attn_naive(*a), ins[: 5 if S else 3])


@pytest.mark.parametrize(
    "shapes,err",
    [  # Hq % Hk, D mismatch, S mismatch, T (depth), T (k/v), rank
        (((1, 3, 5, 16), (1, 2, 5, 16), (1, 2, 5, 16), (1, 2, 5, 1, 16), (1, 2, 5, 1, 16)), ValueError),
        (((1, 2, 5, 16), (1, 1, 5, 32), (1, 1, 5, 32), (1, 1, 5, 1, 32), (1, 1, 5, 1, 32)), ValueError),
        (((1, 2, 5, 16), (1, 1, 5, 16), (1, 1, 5, 16), (1, 1, 5, 2, 16), (1, 1, 5, 3, 16)), ValueError),
        (((1, 2, 5, 16), (1, 1, 5, 16), (1, 1, 5, 16), (1, 1, 4, 2, 16), (1, 1, 4, 2, 16)), ValueError),
        (((1, 2, 5, 16), (1, 1, 6, 16), (1, 1, 6, 16), (1, 1, 5, 2, 16), (1, 1, 5, 2, 16)), ValueError),
        (((2, 5, 16), (1, 1, 5, 16), (1, 1, 5, 16), (1, 1, 5, 2, 16), (1, 1, 5, 2, 16)), ValueError),
    ],
)
def test_bad_shapes(shapes, err):
    ins = [torch.randn(*s, device=DEV) for s in shapes]
    with pytest.raises(err):
        moda_attn(*ins)


@pytest.mark.parametrize("D", [8, 24, 512])
def test_head_dims_the_kernels_do_not_take_run_the_reference(D):
    """D not a power of two in [16, 256]: the op returns the reference's output and gradients (bit for bit),
    and a given depth_grad_acc stays untouched (kd, vd get their gradients through autograd)."""
    inputs = make(1, 1, 2, 5, 2, D, seed=18)
    got, ref = run_both(inputs)
    acc = (torch.zeros_like(inputs[3]), torch.zeros_like(inputs[4]))
    o = moda_attn(*inputs, depth_grad_acc=acc)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(o)  # run_both's dO
    with_acc = (o, *torch.autograd.grad(o, inputs, do))
    for name, a, b, c in zip(NAMES, got, ref, with_acc, strict=True):
        assert torch.equal(a, b) and torch.equal(c, b), name
    assert not acc[0].any() and not acc[1].any()


def test_bad_dtype_and_half_depth():
    q, k, v, kd, vd = (t.detach() for t in make(1, 1, 2, 5, 1, 16))
    with pytest.raises(TypeError):
        moda_attn(q, k.double(), v, kd, vd)
    with pytest.raises(TypeError):
        moda_attn(q, k, v, kd.half(), vd.half())
    with pytest.raises(ValueError):
        moda_attn(q, k, v, kd, None)
    with pytest.raises(ValueError):
        moda_attn(q, k, v, kd, vd, scale=-1.0)


@pytest.mark.parametrize(
    "dtype,acc_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.float16, torch.float32),
        # the model's bf16 slot-gradient buffers (the interpreter's bf16 tl.dot is wrong: GPU only)
        pytest.param(torch.bfloat16, torch.bfloat16, marks=pytest.mark.skipif(DEV != "cuda", reason="bf16 on GPU")),
    ],
)
def test_depth_grads_added_into_buffer_views(dtype, acc_dtype):
    """depth_grad_acc: dkd, dvd are ADDED into strided window views of larger gradient buffers that already
    hold sums (kd, vd then get no gradient); the rest of each buffer is untouched; q, k, v grads as usual."""
    B, Hk, G, T, S_max, lo, hi, D = 1, 2, 2, 33, 6, 1, 4, 16
    q, k, v, _, _ = make(B, Hk, G, T, 0, D, dtype=dtype, seed=11)
    g = torch.Generator().manual_seed(12)
    kbuf, vbuf = (torch.randn(B, Hk, T, S_max, D, generator=g).to(DEV, dtype).requires_grad_() for _ in range(2))
    init = [torch.randn(B, Hk, T, S_max, D, generator=g).to(DEV, acc_dtype) for _ in range(2)]
    gk, gv = (t.clone() for t in init)
    kd, vd = kbuf[:, :, :, lo:hi], vbuf[:, :, :, lo:hi]
    o = moda_attn(q, k, v, kd, vd, depth_grad_acc=(gk[:, :, :, lo:hi], gv[:, :, :, lo:hi]))
    do = torch.randn(o.shape, generator=g).to(o)
    grads = torch.autograd.grad(o, (q, k, v, kbuf, vbuf), do, allow_unused=True)
    assert grads[3] is None and grads[4] is None
    o_ref = moda_attn_naive(q, k, v, kd, vd)
    ref = torch.autograd.grad(o_ref, (q, k, v, kd, vd), do)
    got = (o, *grads[:3], gk[:, :, :, lo:hi], gv[:, :, :, lo:hi])
    want = (o_ref, *ref[:3], *(i[:, :, :, lo:hi] + r.to(acc_dtype) for i, r in zip(init, ref[3:], strict=True)))
    if dtype == torch.float32:
        check(got, want)
    else:
        for name, a, b in zip(NAMES, got, want, strict=True):
            assert rel_err(a, b)[0] < (2e-2 if dtype == torch.bfloat16 else 1e-2), name
    for buf, i in zip((gk, gv), init, strict=True):
        assert torch.equal(buf[:, :, :, :lo], i[:, :, :, :lo]) and torch.equal(buf[:, :, :, hi:], i[:, :, :, hi:])


def test_depth_grad_acc_bad_args():
    q, k, v, kd, vd = (t.detach() for t in make(1, 1, 2, 5, 2, 16))
    ok = torch.zeros_like(kd)
    strided = torch.zeros(1, 1, 5, 16, 2, device=DEV).transpose(3, 4)  # kd's shape, last stride 2
    for acc in ((ok[:, :, :, :1], ok), (ok, ok.half()), (ok, strided)):
        with pytest.raises(ValueError, match="depth_grad_acc"):
            moda_attn(q, k, v, kd, vd, depth_grad_acc=acc)
    with pytest.raises(ValueError, match="depth_grad_acc"):
        moda_attn(q, k, v, depth_grad_acc=(ok, ok))


@pytest.mark.skipif(DEV != "cuda", reason="the CUDA sequence backends")
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("B,Hk,G,T,S,D", [(2, 2, 3, 333, 5, 64), (1, 1, 4, 130, 2, 128), (1, 3, 1, 64, 1, 64)])
def test_bf16_sequence_backends_gpu(backend, B, Hk, G, T, S, D):
    """bf16 on the GPU with each half-precision sequence backend: rel-L2 <= 1e-2 vs the fp32 reference."""
    from kernels.moda_attn import seq

    ins = make(B, Hk, G, T, S, D, dtype=torch.bfloat16, seed=13)
    seq.set_backend(backend)
    try:
        o = moda_attn(*ins)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(14)).to(o)
        got = (o, *torch.autograd.grad(o, ins, do))
    finally:
        seq.set_backend(None)
    ref_in = [t.detach().float().requires_grad_() for t in ins]
    o_ref = moda_attn_naive(*ref_in)
    ref = (o_ref, *torch.autograd.grad(o_ref, ref_in, do.float()))
    for name, a, b in zip(NAMES, got, ref, strict=True):
        assert rel_err(a, b)[0] <= 1e-2, (name, rel_err(a, b))


def test_cudnn_never_gets_a_single_position():
    """cuDNN refuses s_q = s_kv = 1 (and the next cuDNN call of that process segfaulted): T = 1 goes to flash,
    on Hopper as on Ampere; from T = 2 Hopper keeps cuDNN, head dims over 128 and fp32 keep their backends."""
    from kernels.moda_attn.seq import choose

    bf16, fp16 = torch.bfloat16, torch.float16
    assert choose(9, bf16, 1, 64, True) == choose(9, fp16, 1, 128, True) == "flash"
    assert choose(9, bf16, 2, 64, True) == choose(10, fp16, 4096, 128, True) == "cudnn"
    assert choose(9, bf16, 2, 256, True) == choose(9, bf16, 2, 64, False) == choose(8, bf16, 1, 64, True) == "flash"
    assert choose(9, torch.float32, 1, 64, True) == choose(7, fp16, 8, 64, True) == "efficient"


@pytest.mark.skipif(DEV != "cuda", reason="the CUDA sequence backends")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S", [0, 2])
def test_single_position_half_precision_gpu(dtype, S):
    """T = 1 in bf16/fp16, forward and backward, twice in one process (the second call is where a refused cuDNN
    call segfaulted): output and every gradient against the fp32 reference."""
    for seed in (21, 22):
        ins = make(2, 2, 2, 1, S, 64, dtype=dtype, seed=seed)
        o = moda_attn(*ins)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed)).to(o)
        got = (o, *torch.autograd.grad(o, ins, do))
        ref_in = [t.detach().float().requires_grad_() for t in ins]
        o_ref = moda_attn_naive(*ref_in)
        ref = (o_ref, *torch.autograd.grad(o_ref, ref_in, do.float(), allow_unused=True, materialize_grads=True))
        check([g.float() for g in got], ref, tol_rel=1e-2, tol_abs=1e-2)


def test_unknown_sequence_backend():
    from kernels.moda_attn import seq

    with pytest.raises(ValueError, match="sequence backend"):
        seq.set_backend("magic")


@pytest.mark.parametrize(
    "B,Hk,G,T,S,D", [(1, 2, 1, 33, 3, 32), (1, 1, 3, 70, 3, 16), (2, 1, 6, 9, 2, 16), (1, 1, 2, 7, 5, 128)]
)
def test_tensor_core_tiles_match_reference(B, Hk, G, T, S, D):
    """The tensor-core depth variant (forced for every G), incl. tiles narrower than one position's slots."""
    inputs = make(B, Hk, G, T, S, D, seed=15)
    try:
        for cols in (128, 16):
            K.set_config(K.Config(tile_min_g=1, tile_cols=cols, tile_warps=1))
            check(*run_both(inputs))
    finally:
        K.set_config(None)


_SM90_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.moda_attn import kernel as K

PTRS = {"Q", "KD", "VD", "O", "DO", "DQ", "DKD", "DVD"}
META = {"G", "GP", "D", "BT", "M", "N", "S", "ACC", "DOT_PREC"}
SCALARS = {"LSE": "*fp32", "qk_scale": "fp32", "scale": "fp32", "T": "i32", "Hk": "i32", "S": "i32"}


def signature(fn):
    sig = {}
    for n in fn.arg_names:
        if n in META and not (n == "S" and "tile" not in fn.__name__):
            sig[n] = "constexpr"
        elif n in PTRS:
            sig[n] = "*bf16"
        else:
            sig[n] = SCALARS.get(n, "i64")
    return sig


n = 0
for G, D, S in ((1, 64, 22), (2, 64, 22), (3, 128, 5), (8, 64, 64)):
    cfg = K._GPU_CONFIGS.get((D, G)) or K._GPU_CONFIGS[(D, 1)]  # the shipped launch configs
    BT, M, N = cfg.tile(G, S)
    variants = [
        (K._depth_fwd, dict(G=G, GP=triton.next_power_of_2(G), D=D, BT=cfg.positions(G))),
        (K._depth_fwd_tile, dict(G=G, S=S, D=D, BT=BT, M=M, N=N, DOT_PREC="tf32")),
    ]
    for acc in (False, True):
        variants.append((K._depth_bwd, dict(G=G, GP=triton.next_power_of_2(G), D=D, BT=cfg.positions(G), ACC=acc)))
        variants.append((K._depth_bwd_tile, dict(G=G, S=S, D=D, BT=BT, M=M, N=N, ACC=acc, DOT_PREC="tf32")))
    for fn, meta in variants:
        triton.compile(ASTSource(fn=fn, signature=signature(fn), constexprs=meta), target=GPUTarget("cuda", 90, 32))
        n += 1
print("compiled", n)
"""


@pytest.mark.skipif(DEV == "cuda", reason="the GPU runs the kernels themselves")
def test_depth_kernels_compile_for_hopper():
    """The interpreter accepts code that Triton's compiler rejects (a non-constexpr global did once): compile
    every depth kernel variant for sm_90 with Triton's own ptxas, in a process without TRITON_INTERPRET."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists() and shutil.which("ptxas") is None:
        pytest.skip(f"no ptxas to compile for sm_90: none at {ptxas} (Triton's bundled one) nor on PATH")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "src"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "compiled 24" in r.stdout, r.stderr[-3000:]


def test_depth_grad_acc_as_a_function_called_in_backward():
    """A function for depth_grad_acc is called only by the backward (the buffers need not exist before), its
    buffers get the same sums as passing them directly, with add=False they are overwritten, and a wrong
    result is an error there."""
    B, Hk, G, T, S, D = 1, 2, 2, 9, 3, 16
    q, k, v, kd, vd = make(B, Hk, G, T, S, D, seed=16)
    calls, made = [], []

    def buffers():
        calls.append(1)
        made.extend((torch.zeros_like(kd), torch.zeros_like(vd)))
        return made[0], made[1]

    o = moda_attn(q, k, v, kd, vd, depth_grad_acc=buffers)
    assert not calls
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(17)).to(o)
    q.grad = None
    o.backward(do)
    assert len(calls) == 1 and kd.grad is None
    o_ref = moda_attn_naive(q, k, v, kd, vd)
    ref = torch.autograd.grad(o_ref, (q, kd, vd), do)
    for got, want in zip((q.grad, *made), ref, strict=True):
        assert rel_err(got, want)[0] < 1e-5
    garbage = (torch.full_like(kd, float("nan")), torch.full_like(vd, float("nan")))
    o = moda_attn(q, k, v, kd, vd, depth_grad_acc=lambda: (*garbage, False))  # add=False: overwrite
    o.backward(do)
    for got, want in zip(garbage, ref[1:], strict=True):
        assert rel_err(got, want)[0] < 1e-5
    bad = moda_attn(q, k, v, kd, vd, depth_grad_acc=lambda: (torch.zeros_like(kd)[:, :, :, :1], torch.zeros_like(vd)))
    with pytest.raises(ValueError, match="depth_grad_acc"):
        bad.backward(do)
