"""Cached-block attention (dlm_ops/ops/cached.py): block decoding over a KV cache, the LSE merge,
FlashBlock reuse/refresh and its step policy, against the eager references of dlm_ops.reference.

CPU runs the torch backend in every dtype and the Triton kernels under TRITON_INTERPRET=1 in
fp32/fp16 at tiny shapes; ``-m gpu`` runs the GPU checks (bf16/fp16 accuracy rule, triton vs
torch, bitwise reuse) at decode shapes.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dlm_ops
from dlm_ops.backends.base import lse_dtype
from dlm_ops.backends.cached import TritonCachedBackend, num_splits
from dlm_ops.backends.triton_backend import INTERPRET
from dlm_ops.ops import cached as ops
from dlm_ops.reference import (
    block_decode_attn_ref,
    flashblock_attn_ref,
    flashblock_refresh_ref,
    merge_attn_states_ref,
)
from dlm_ops.sparsity import FlashBlockCache

from .accuracy import assert_rule, gold_dtype
from .strategies import HEADS

CUDA = torch.cuda.is_available()
TRITON = CUDA or INTERPRET
needs_triton = pytest.mark.skipif(not TRITON, reason="needs a GPU or TRITON_INTERPRET=1")
CPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INTERP_DTYPES = [torch.float32, torch.float16]  # the interpreter computes bf16 dots wrongly
FEW = settings(max_examples=8)  # the interpreter runs numpy per program: keep CI in budget


def _randn(shape, dtype, gen, device="cpu"):
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def _decode_inputs(b, bs, h, hkv, d, smax, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = _randn((b, bs, h, d), dtype, gen, device)
    kc, vc = (_randn((b, smax, hkv, d), dtype, gen, device) for _ in range(2))
    kn, vn = (_randn((b, bs, hkv, d), dtype, gen, device) for _ in range(2))
    return q, kc, vc, kn, vn


def _assert_lse_rule(name, ours, gold, plain, dtype):
    """The accuracy rule on the finite entries; -inf (a row that saw no key) exactly where gold."""
    gold_inf = gold == -math.inf
    assert torch.equal(ours == -math.inf, gold_inf), f"{name}: -inf pattern differs"
    fin = lambda t: t.double().masked_fill(gold_inf, 0.0)
    assert_rule(name, fin(ours), fin(gold), fin(plain.masked_fill(plain == -math.inf, 0)), dtype)


def _check(ours, gold_fn, plain_fn, dtype, names):
    gold, plain = gold_fn(), plain_fn()
    for name, o, g, p in zip(names, ours, gold, plain):
        if "lse" in name:
            assert o.dtype == torch.float32, f"{name}: dtype {o.dtype}"
            _assert_lse_rule(name, o, g, p, dtype)
        else:
            assert_rule(name, o, g, p, dtype)


@st.composite
def decode_problem(draw, max_smax=40, head_dims=(8, 16, 32)):
    b = draw(st.integers(1, 2))
    smax = draw(st.integers(0, max_smax))
    lens = draw(st.one_of(st.none(), st.lists(
        st.one_of(st.just(0), st.just(smax), st.integers(0, smax)), min_size=b, max_size=b)))
    h, hkv = draw(st.sampled_from(HEADS))
    return dict(b=b, bs=draw(st.integers(1, 5)), h=h, hkv=hkv, d=draw(st.sampled_from(head_dims)),
                smax=smax, lens=lens, new=draw(st.booleans()),
                scale=draw(st.sampled_from([None, 0.3])))


def _run_decode(p, dtype, seed, call, device="cpu"):
    q, kc, vc, kn, vn = _decode_inputs(p["b"], p["bs"], p["h"], p["hkv"], p["d"], p["smax"],
                                       dtype, seed, device)
    lens = None if p["lens"] is None else torch.tensor(p["lens"], dtype=torch.int32, device=device)
    kn, vn = (kn, vn) if p["new"] else (None, None)
    ours = call(q, kc, vc, lens, kn, vn, p["scale"])
    ref = lambda cd: block_decode_attn_ref(q, kc, vc, lens, kn, vn, softmax_scale=p["scale"],
                                           compute_dtype=cd)
    _check(ours, lambda: ref(gold_dtype(dtype)), lambda: ref(dtype), dtype, ["out", "lse"])
    assert ours[0].dtype == dtype


# -- block_decode_attn ---------------------------------------------------------------------------


@settings(max_examples=30)
@given(decode_problem(), st.sampled_from(CPU_DTYPES), st.integers(0, 99))
def test_decode_torch(p, dtype, seed):
    _run_decode(p, dtype, seed, lambda q, kc, vc, lens, kn, vn, scale: dlm_ops.block_decode_attn(
        q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, softmax_scale=scale, return_lse=True,
        backend="torch"))


@needs_triton
@FEW
@given(decode_problem(max_smax=70), st.sampled_from(INTERP_DTYPES), st.sampled_from([None, 1, 3]),
       st.integers(0, 99))
def test_decode_triton(p, dtype, splits, seed):
    """splits None: the op as dispatched (on CPU a pretend 4-SM GPU, so small caches split too);
    1 and 3: the backend with forced splits, empty splits included."""
    device = "cuda" if CUDA else "cpu"

    def call(q, kc, vc, lens, kn, vn, scale):
        if splits is None:
            return dlm_ops.block_decode_attn(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn,
                                             softmax_scale=scale, return_lse=True,
                                             backend="triton")
        scale = scale or 1 / math.sqrt(q.shape[-1])
        return TritonCachedBackend(splits=splits).decode(q, kc, vc, lens, kn, vn, scale, False)[:2]

    _run_decode(p, dtype, seed, call, device)


@needs_triton
@pytest.mark.parametrize("splits", [1, 3])  # 1: decode_fused_kernel; 3: partials + combine
@pytest.mark.parametrize("new", [True, False])
def test_decode_triton_paths(splits, new):
    device = "cuda" if CUDA else "cpu"
    p = dict(b=2, bs=5, h=4, hkv=2, d=16, smax=37, lens=[0, 37], new=new, scale=None)

    def call(q, kc, vc, lens, kn, vn, scale):
        return TritonCachedBackend(splits=splits).decode(q, kc, vc, lens, kn, vn,
                                                         1 / math.sqrt(q.shape[-1]), False)[:2]

    _run_decode(p, torch.float32, 5, call, device)


def test_smaller_configs_shrink_to_a_floor():
    """Each step needs less shared memory (fewer stages, then fewer keys, then fewer rows) and the
    walk ends."""
    from dlm_ops.backends.cached import smaller

    cfg, seen = (128, 64, 8, 3), []
    while cfg is not None:
        seen.append(cfg)
        cfg = smaller(cfg)
    assert seen[:4] == [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 1), (128, 32, 8, 2)]
    assert seen[-1] == (16, 16, 4, 1) and len(seen) == len(set(seen))
    smem = [m * n * s + m * n for m, n, _, s in seen]  # rows x keys x stages, plus the scores
    assert all(a >= b for a, b in zip(smem, smem[1:]))


@needs_triton
def test_launch_fitting_takes_the_first_config_that_fits(monkeypatch):
    from dlm_ops.backends import cached
    from dlm_ops.backends.triton_backend import OutOfResources

    monkeypatch.setattr(cached, "_FITTING", {})
    tried = []

    def launch(cfg):  # a GPU that holds block_n * stages <= 32
        tried.append(cfg)
        if cfg[1] * cfg[3] > 32:
            raise OutOfResources(cfg[1] * cfg[3], 32, "shared memory")

    q = torch.zeros(1, 4, 2, 64)
    cached.launch_fitting("toy", q, (64, 64, 4, 3), launch)
    assert tried == [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 1), (64, 32, 4, 2), (64, 32, 4, 1)]
    tried.clear()
    cached.launch_fitting("toy", q, (64, 64, 4, 3), launch)  # remembered: no failing launch
    assert tried == [(64, 32, 4, 1)]
    with pytest.raises(dlm_ops.UnsupportedConfig, match="toy kernel fits"):
        cached.launch_fitting("toy", q, (16, 16, 4, 1), lambda cfg: launch((16, 64, 4, 1)))


@needs_triton
def test_decode_runs_a_smaller_config_where_the_first_does_not_fit(monkeypatch):
    """The real decode path on a pretend GPU without room for pipelining: the fused kernel raises
    OutOfResources at more than one stage, the retry with one stage computes the right answer."""
    from dlm_ops.backends import cached
    from dlm_ops.backends.triton_backend import OutOfResources

    monkeypatch.setattr(cached, "_FITTING", {})
    real = cached.kernels.decode_fused_kernel
    stages = []

    class Small:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                stages.append(kw["num_stages"])
                if kw["num_stages"] > 1:
                    raise OutOfResources(2, 1, "shared memory")
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(cached.kernels, "decode_fused_kernel", Small())
    device = "cuda" if CUDA else "cpu"
    p = dict(b=2, bs=5, h=4, hkv=2, d=16, smax=37, lens=[0, 37], new=True, scale=None)

    def call(q, kc, vc, lens, kn, vn, scale):
        return TritonCachedBackend(splits=1).decode(q, kc, vc, lens, kn, vn,
                                                    1 / math.sqrt(q.shape[-1]), False)[:2]

    _run_decode(p, torch.float32, 5, call, device)
    assert stages[0] > 1 and stages[-1] == 1


def test_num_splits_policy():
    assert num_splits(programs=128 * 8, smax=65536, sm_count=132) == 1  # B*Hkv fills the GPU
    assert num_splits(programs=8, smax=65536, sm_count=132) == 33  # ~2 waves of programs
    assert num_splits(programs=8, smax=1024, sm_count=132) == 2  # >= 512 keys per split
    assert num_splits(programs=8, smax=100, sm_count=132) == 1


def test_empty_cache_and_no_new_gives_zero_and_minus_inf():
    q, kc, vc, _, _ = _decode_inputs(2, 3, 4, 2, 16, 5, torch.float32, 0)
    lens = torch.tensor([0, 5], dtype=torch.int32)
    for backend in ["torch"] + (["triton"] if TRITON and not CUDA else []):
        out, lse = dlm_ops.block_decode_attn(q, kc, vc, cache_seqlens=lens, return_lse=True,
                                             backend=backend)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert (lse[0] == -math.inf).all() and torch.isfinite(lse[1]).all()


def test_decode_is_inference_only():
    q, kc, vc, kn, vn = _decode_inputs(1, 2, 2, 2, 8, 4, torch.float32, 0)
    q.requires_grad_()
    out = dlm_ops.block_decode_attn(q, kc, vc, k_new=kn, v_new=vn)
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()


# -- merge_attn_states ---------------------------------------------------------------------------


def _states(b, s, h, d, dtype, seed, inf_a, inf_b):
    """Two partial states; rows listed in inf_a / inf_b get lse -inf and a NaN output (a side with
    lse -inf must be ignored, whatever its output holds)."""
    gen = torch.Generator().manual_seed(seed)
    oa, ob = (_randn((b, s, h, d), dtype, gen) for _ in range(2))
    la, lb = (torch.randn((b, h, s), generator=gen).to(lse_dtype(dtype)) * 3 for _ in range(2))
    for o, l, rows in ((oa, la, inf_a), (ob, lb, inf_b)):
        for r in rows:
            l[:, :, r] = -math.inf
            o[:, r] = float("nan")
    return oa, la, ob, lb


@settings(max_examples=20)
@given(st.integers(1, 6), st.sampled_from([(1, 8), (3, 16), (2, 100)]), st.sampled_from(CPU_DTYPES),
       st.data())
def test_merge_matches_reference(s, hd, dtype, data):
    h, d = hd
    inf_a = data.draw(st.sets(st.integers(0, s - 1)))
    inf_b = data.draw(st.sets(st.integers(0, s - 1)))
    backends = ["torch"] + (["triton"] if TRITON and d % 8 == 0 and dtype in INTERP_DTYPES else [])
    backend = data.draw(st.sampled_from(backends))
    device = "cuda" if backend == "triton" and CUDA else "cpu"
    oa, la, ob, lb = (t.to(device) for t in _states(2, s, h, d, dtype, s, inf_a, inf_b))
    out, lse = dlm_ops.merge_attn_states(oa, la, ob, lb, backend=backend)
    assert not out.isnan().any() and not lse.isnan().any()
    both = sorted(inf_a & inf_b)
    assert (out[:, both] == 0).all() and (lse[:, :, both] == -math.inf).all()
    clean = lambda o, l: o.masked_fill((l == -math.inf).transpose(1, 2)[..., None], 0.0)
    ref = lambda cd: merge_attn_states_ref(clean(oa, la), la, clean(ob, lb), lb, compute_dtype=cd)
    _check((out, lse), lambda: ref(gold_dtype(dtype)), lambda: ref(dtype), dtype, ["out", "lse"])


def test_merge_is_associative_and_merges_key_splits():
    """merge(merge(a, b), c) == merge(a, merge(b, c)); and attention over a split of the keys,
    merged, equals attention over their union (cache split at 0, inside, and at the end)."""
    s = [_states(1, 5, 2, 8, torch.float64, seed, inf, ()) for seed, inf in
         ((0, {1, 2}), (1, {2}), (2, {2, 3}))]
    (oa, la, _, _), (ob, lb, _, _), (oc, lc, _, _) = s
    m = dlm_ops.merge_attn_states
    left = m(*m(oa, la, ob, lb), oc, lc)
    right = m(oa, la, *m(ob, lb, oc, lc))
    for x, y in zip(left, right):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    assert (left[1][:, :, 2] == -math.inf).all() and (left[0][:, 2] == 0).all()

    q, kc, vc, kn, vn = _decode_inputs(2, 3, 4, 2, 16, 12, torch.float64, 3)
    union = block_decode_attn_ref(q, kc, vc, None, kn, vn, compute_dtype=torch.float64)
    for cut in (0, 5, 12):
        a = dlm_ops.block_decode_attn(q, kc[:, :cut], vc[:, :cut], return_lse=True)
        b = dlm_ops.block_decode_attn(q, kc[:, cut:], vc[:, cut:], k_new=kn, v_new=vn,
                                      return_lse=True)
        for x, y in zip(m(*a, *b), union):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_merge_gradcheck():
    oa, la, ob, lb = _states(1, 4, 2, 8, torch.float64, 0, {1, 3}, {2, 3})
    oa, ob = oa.nan_to_num(0.0), ob.nan_to_num(0.0)  # finite differences need finite inputs
    inputs = [t.requires_grad_() for t in (oa, la, ob, lb)]

    def fn(*t):  # a row with lse -inf in both stays -inf: finite differences of it are NaN
        out, lse = dlm_ops.merge_attn_states(*t, backend="torch")
        return out, lse.masked_fill(lse == -math.inf, 0.0)

    assert torch.autograd.gradcheck(fn, inputs)
    out, lse = dlm_ops.merge_attn_states(*inputs)
    grads = torch.autograd.grad((out.sum() + lse[lse > -math.inf].sum()), inputs)
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][:, 1] == 0).all() and (grads[3][:, :, 2] == 0).all()


# -- FlashBlock ----------------------------------------------------------------------------------


@settings(max_examples=20)
@given(decode_problem(max_smax=24), st.sampled_from(CPU_DTYPES), st.booleans(), st.data())
def test_flashblock_matches_reference(p, dtype, fp32_cache, data):
    """Refresh (full and block-external results) and reuse (cached part + block, dirty rows)."""
    backends = ["torch"] + (["triton"] if TRITON and dtype in INTERP_DTYPES else [])
    backend = data.draw(st.sampled_from(backends)) if data.draw(st.integers(0, 3)) == 0 else "torch"
    device = "cuda" if backend == "triton" and CUDA else "cpu"
    q, kc, vc, kb, vb = _decode_inputs(p["b"], p["bs"], p["h"], p["hkv"], p["d"], p["smax"], dtype,
                                       p["smax"], device)
    lens = None if p["lens"] is None else torch.tensor(p["lens"], dtype=torch.int32, device=device)
    scale = p["scale"]
    ours = dlm_ops.flashblock_refresh(q, kc, vc, kb, vb, cache_seqlens=lens, softmax_scale=scale,
                                      backend=backend)
    ref = lambda cd: flashblock_refresh_ref(q, kc, vc, kb, vb, lens, softmax_scale=scale,
                                            compute_dtype=cd)
    _check(ours, lambda: ref(gold_dtype(dtype)), lambda: ref(dtype), dtype,
           ["out", "lse", "ext_out", "ext_lse"])
    # reuse on a changed block, with a cached part that is a little off (as after some steps)
    q2 = (q.float() + 0.1 * torch.randn(q.shape, device=device)).to(dtype)
    c_out = ours[2] if fp32_cache else ours[2].to(dtype)
    dirty = data.draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=p["b"] * p["bs"],
                                                    max_size=p["b"] * p["bs"])))
    if dirty is not None:
        dirty = torch.tensor(dirty, device=device).reshape(p["b"], p["bs"])
    out, lse = dlm_ops.flashblock_attn(q2, kb, vb, c_out, ours[3], dirty=dirty, softmax_scale=scale,
                                       return_lse=True, backend=backend)
    ref = lambda cd: flashblock_attn_ref(q2, kb, vb, c_out, ours[3], dirty, softmax_scale=scale,
                                         compute_dtype=cd)
    _check((out, lse), lambda: ref(gold_dtype(dtype)), lambda: ref(dtype), dtype, ["out", "lse"])


@pytest.mark.parametrize("backend,dtype", [("torch", torch.bfloat16), ("torch", torch.float32)]
                         + ([("triton", torch.float16), ("triton", torch.float32)] if TRITON else []))
def test_flashblock_reuse_with_infinite_tau_equals_refresh_bitwise(backend, dtype):
    """tau = inf on an unchanged block: every step after the first reuses, and reproduces the
    refresh step bit for bit, on both backends: a refresh computes the block-external part, stores
    it in fp32, and then runs the reuse path itself on it (Triton: the same flashblock_kernel
    launch; torch: the same TorchCachedBackend.block)."""
    device = "cuda" if backend == "triton" and CUDA else "cpu"
    q, kc, vc, kb, vb = _decode_inputs(2, 4, 4, 1, 16, 33, dtype, 7, device)
    lens = torch.tensor([33, 0], dtype=torch.int32, device=device)
    fb = FlashBlockCache(tau=math.inf, backend=backend)
    fb.begin_block()
    steps = []
    for _ in range(3):
        steps.append([fb.attend(layer, q, kc, vc, kb, vb, cache_seqlens=lens, return_lse=True)
                      for layer in range(2)])
        fb.step(1)
    assert fb.refreshes == 2 and fb.reuses == 4
    for later in steps[1:]:
        for (o, l), (o0, l0) in zip(later, steps[0]):
            assert torch.equal(o, o0) and torch.equal(l, l0)
    full = dlm_ops.block_decode_attn(q, kc, vc, cache_seqlens=lens, k_new=kb, v_new=vb,
                                     return_lse=True, backend=backend)
    ref = lambda cd: block_decode_attn_ref(q, kc, vc, lens, kb, vb, compute_dtype=cd)
    _check(full, lambda: ref(gold_dtype(dtype)), lambda: ref(dtype), dtype, ["out", "lse"])
    _check(steps[0][0], lambda: ref(gold_dtype(dtype)), lambda: ref(dtype), dtype, ["out", "lse"])


def test_flashblock_cache_policy():
    q, kc, vc, kb, vb = _decode_inputs(2, 4, 4, 2, 8, 6, torch.float32, 0)
    fb = FlashBlockCache(tau=3)
    fb.begin_block()
    assert fb.refreshing and fb.memory_bytes() == 0
    decisions = []
    for unmasked in ([1, 0], [1, 2], [0, 0], [1, 0], 2):
        for layer in ("l0", "l1"):
            fb.attend(layer, q, kc, vc, kb, vb)
        decisions.append(fb.refreshing)
        fb.step(unmasked)
    # refresh (first step); counts [1,0] -> reuse; [2,2] -> reuse; [2,2] -> reuse; [3,2]: sample 0
    # reached tau, the whole batch refreshes and the counters restart; then +2 each -> [2, 2].
    assert decisions == [True, False, False, False, True]
    assert fb.counts == [2, 2] and not fb.refreshing
    assert fb.refreshes == 4 and fb.reuses == 6
    per_layer = 2 * 4 * 4 * 8 * 4 + 2 * 4 * 4 * 4  # fp32 out (B, bs, H, D) + fp32 lse (B, H, bs)
    assert fb.memory_bytes() == 2 * per_layer and "MiB" in repr(fb)
    fb.step(torch.tensor([3, 0]))
    assert fb.refreshing
    fb.begin_block()
    assert fb.memory_bytes() == 0 and fb.refreshing and fb.counts == []
    with pytest.raises(ValueError, match="tau"):
        FlashBlockCache(tau=0)
    with pytest.raises(ValueError, match="unmasked"):
        fb.step([-1, 2])
    fb.step([1, 1])
    with pytest.raises(ValueError, match="one count per sample"):
        fb.step([1, 1, 1])


# -- validation, opcheck, compile ----------------------------------------------------------------


def _bad_cases():
    q, kc, vc, kn, vn = _decode_inputs(2, 3, 4, 2, 16, 5, torch.float32, 0)
    lens = torch.tensor([1, 5], dtype=torch.int32)
    lse = torch.zeros(2, 4, 3)
    dec = lambda **kw: lambda: dlm_ops.block_decode_attn(**dict(
        dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=lens, k_new=kn, v_new=vn), **kw))
    fba = lambda **kw: lambda: dlm_ops.flashblock_attn(**dict(
        dict(q=q, k_block=kn, v_block=vn, cached_out=q, cached_lse=lse), **kw))
    mrg = lambda **kw: lambda: dlm_ops.merge_attn_states(**dict(
        dict(out_a=q, lse_a=lse, out_b=q, lse_b=lse), **kw))
    return [
        (dec(q=q[0]), "q must be 4-D"),
        (dec(k_cache=kc.half()), "k_cache.dtype"),
        (dec(v_cache=vc[:, :4]), "v_cache must have k_cache's shape"),
        (dec(k_cache=kc[:1], v_cache=vc[:1]), "k_cache must have shape"),
        (dec(k_cache=kc[:, :, :1].expand(2, 5, 3, 16), v_cache=vc[:, :, :1].expand(2, 5, 3, 16)),
         "multiple of k_cache's"),
        (dec(cache_seqlens=lens.long()), "cache_seqlens must be an int32"),
        (dec(cache_seqlens=lens[:1]), "cache_seqlens must have shape"),
        (dec(cache_seqlens=torch.tensor([0, 6], dtype=torch.int32)), r"cache_seqlens must lie in"),
        (dec(cache_seqlens=torch.tensor([-1, 0], dtype=torch.int32)), r"cache_seqlens must lie in"),
        (dec(v_new=None), "k_new and v_new"),
        (dec(k_new=kn[:, :2], v_new=vn[:, :2]), "k_new must have shape"),
        (dec(k_new=kn[:, :, :1], v_new=vn[:, :, :1]), "kv head count"),
        (dec(softmax_scale=-1.0), "softmax_scale"),
        (dec(q=q[..., :12], k_cache=kc[..., :12], v_cache=vc[..., :12], k_new=kn[..., :12],
             v_new=vn[..., :12]), "head_dim"),
        (fba(cached_out=q[:, :2]), "cached_out must have q's shape"),
        (fba(cached_out=q.double()), "cached_out.dtype"),
        (fba(cached_lse=lse.half()), "cached_lse.dtype"),
        (fba(cached_lse=lse[:, :2]), "cached_lse must have shape"),
        (fba(dirty=torch.ones(2, 3)), "dirty.dtype"),
        (fba(dirty=torch.ones(2, 2, dtype=torch.bool)), "dirty must have shape"),
        (fba(k_block=kn[:, :2], v_block=vn[:, :2]), "k_block must have shape"),
        (mrg(out_b=q.half()), "out_b.dtype"),
        (mrg(out_b=q[:1]), "out_b must have out_a's shape"),
        (mrg(lse_b=lse.double()), "lse_b.dtype"),
        (mrg(lse_a=lse[:, :, :2]), "lse_a must have shape"),
    ]


@pytest.mark.parametrize("i", range(len(_bad_cases())))
def test_validation_errors(i):
    fn, match = _bad_cases()[i]
    with pytest.raises(ValueError, match=match):
        fn()


def test_opcheck():
    q, kc, vc, kn, vn = _decode_inputs(2, 3, 4, 2, 16, 5, torch.float32, 0)
    lens = torch.tensor([0, 4], dtype=torch.int32)
    torch.library.opcheck(ops.block_decode_attn_op, (q, kc, vc, lens, kn, vn, None, None))
    torch.library.opcheck(ops.block_decode_attn_op, (q, kc, vc, None, None, None, 0.5, "torch"))
    out, lse, eo, el = ops.flashblock_refresh_op(q, kc, vc, kn, vn, lens, None, None)
    torch.library.opcheck(ops.flashblock_refresh_op, (q, kc, vc, kn, vn, lens, None, None))
    dirty = torch.tensor([[True, False, False], [False, False, True]])
    torch.library.opcheck(ops.flashblock_attn_op, (q, kn, vn, eo, el, dirty, None, None))
    torch.library.opcheck(ops.flashblock_attn_op, (q, kn, vn, out, el, None, 0.3, "torch"))
    oa, la, ob, lb = _states(2, 3, 4, 16, torch.float32, 0, {1}, {1, 2})
    oa, ob = oa.nan_to_num(0.0), ob.nan_to_num(0.0)
    torch.library.opcheck(ops.merge_attn_states_op,
                          tuple(t.requires_grad_() for t in (oa, la, ob, lb)) + (None,))


def test_compile_fullgraph():
    """All four ops in one compiled graph (fullgraph), and the merge's backward through it."""
    torch._dynamo.reset()
    q, kc, vc, kn, vn = _decode_inputs(2, 3, 4, 2, 16, 5, torch.float32, 0)
    lens = torch.tensor([0, 4], dtype=torch.int32)
    oa, la, ob, lb = _states(2, 3, 4, 16, torch.float32, 0, {0}, {0, 1})
    states = [t.nan_to_num(0.0) for t in (oa, la, ob, lb)]

    def step(q, kc, vc, kn, vn, lens, oa, la, ob, lb):
        full, lse = dlm_ops.block_decode_attn(q * 1.5, kc, vc, cache_seqlens=lens, k_new=kn,
                                              v_new=vn, return_lse=True)
        out, lse2, eo, el = dlm_ops.flashblock_refresh(q, kc, vc, kn, vn, cache_seqlens=lens)
        reuse = dlm_ops.flashblock_attn(q, kn, vn, eo, el, dirty=lens[:, None].expand(2, 3) > 0)
        merged, _ = dlm_ops.merge_attn_states(full, lse, out, lse2)
        m_out, m_lse = dlm_ops.merge_attn_states(oa, la, ob, lb)
        loss = (m_out * m_out).sum() + m_lse.clamp(min=-10).sum()
        return merged + reuse, loss

    def run(fn):
        inputs = [t.clone().requires_grad_() for t in states]
        res, loss = fn(q, kc, vc, kn, vn, lens, *inputs)
        return (res, loss, *torch.autograd.grad(loss, inputs))

    for x, y in zip(run(torch.compile(step, fullgraph=True)), run(step)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


# -- GPU ------------------------------------------------------------------------------------------


def _gpu_case(b, bs, h, hkv, d, smax, dtype, seed=0):
    q, kc, vc, kn, vn = _decode_inputs(b, bs, h, hkv, d, smax, dtype, seed, "cuda")
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, smax + 1, (b,), generator=gen, dtype=torch.int32)
    lens[0], lens[-1] = 0, smax
    return q, kc, vc, kn, vn, lens.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,bs,smax", [(1, 4, 8192), (3, 32, 3000), (16, 4, 1024), (2, 32, 0)])
def test_gpu_decode_accuracy_and_torch_agreement(dtype, b, bs, smax):
    q, kc, vc, kn, vn, lens = _gpu_case(b, bs, 32, 8, 128, smax, dtype)
    assert ops._impl(q, 8, None).name == "triton"  # the default on CUDA
    for new in (True, False):
        kw = dict(cache_seqlens=lens, k_new=kn if new else None, v_new=vn if new else None)
        ours = dlm_ops.block_decode_attn(q, kc, vc, return_lse=True, **kw)
        torch_be = dlm_ops.block_decode_attn(q, kc, vc, return_lse=True, backend="torch", **kw)
        ref = lambda cd: block_decode_attn_ref(q, kc, vc, lens, kw["k_new"], kw["v_new"],
                                               compute_dtype=cd)
        _check(ours, lambda: ref(torch.float32), lambda: ref(dtype), dtype, ["out", "lse"])
        _check(torch_be, lambda: ref(torch.float32), lambda: ref(dtype), dtype, ["out", "lse"])
        # triton vs torch: their difference within the rule's bound around the torch result
        _check(ours, lambda: torch_be, lambda: ref(dtype), dtype, ["out", "lse"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_flashblock_bitwise_reuse_and_dirty(dtype):
    q, kc, vc, kb, vb, lens = _gpu_case(4, 32, 32, 8, 128, 4096, dtype)
    out, lse, eo, el = dlm_ops.flashblock_refresh(q, kc, vc, kb, vb, cache_seqlens=lens)
    o2, l2 = dlm_ops.flashblock_attn(q, kb, vb, eo, el, return_lse=True)
    assert torch.equal(out, o2) and torch.equal(lse, l2)
    dirty = torch.rand(4, 32, device="cuda") < 0.3
    o3, l3 = dlm_ops.flashblock_attn(q, kb, vb, eo.to(dtype), el, dirty=dirty, return_lse=True)
    ref = lambda cd: flashblock_attn_ref(q, kb, vb, eo.to(dtype), el, dirty, compute_dtype=cd)
    _check((o3, l3), lambda: ref(torch.float32), lambda: ref(dtype), dtype, ["out", "lse"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_merge(dtype):
    oa, la, ob, lb = (t.cuda() for t in _states(4, 64, 32, 128, dtype, 0, {3, 5}, {5, 7}))
    out, lse = dlm_ops.merge_attn_states(oa, la, ob, lb)
    tout, tlse = dlm_ops.merge_attn_states(oa, la, ob, lb, backend="torch")
    assert not out.isnan().any() and torch.equal(lse == -math.inf, tlse == -math.inf)
    clean = lambda o, l: o.masked_fill((l == -math.inf).transpose(1, 2)[..., None], 0.0)
    ref = lambda cd: merge_attn_states_ref(clean(oa, la), la, clean(ob, lb), lb, compute_dtype=cd)
    _check((out, lse), lambda: ref(torch.float32), lambda: ref(dtype), dtype, ["out", "lse"])
    _check((out, lse), lambda: (tout, tlse), lambda: ref(dtype), dtype, ["out", "lse"])


# -- the benchmark's CPU-checkable parts -----------------------------------------------------------


def test_cached_decode_benchmark_grid_and_table():
    from benchmarks.cached_decode import DecodeCase, cases, markdown, parse_args

    grid = cases("default")
    assert len(grid) == 22 and {c.block_size for c in grid} == {4, 32}
    assert max(c.batch * c.cache_len for c in grid) == 16 * 65536  # K/V stay within ~4 GB
    assert all((c.heads, c.kv_heads, c.head_dim) == (32, 8, 128) for c in grid)
    case = DecodeCase(2, 100, 4)
    assert case.kv_bytes() == 2 * 2 * 104 * 8 * 128 * 2
    rows = [dict(case=case.label, contender=n, ms=ms, expanded=n == "sdpa cudnn", mode="graph",
                 gb_per_s=case.kv_bytes() / ms / 1e6)
            for n, ms in (("dlm_ops", 0.010), ("sdpa flash", 0.020), ("sdpa cudnn", 0.015),
                          ("flashblock refresh", 0.012), ("flashblock reuse", 0.004))]
    line = markdown(rows).splitlines()[2]
    assert line.startswith("| B=2 L=100 bs=4 | graph | 10.0 | 20.0 | 15.0 (expanded) | - | "
                           "12.0 | 4.0 |")
    assert line.endswith("| 1.50 | 3.0 |")
    assert parse_args(["--out", "x"]).out == "x" and parse_args([]).modes == "eager,graph"
