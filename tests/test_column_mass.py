"""PulseCol's column mass as ``dlm::sparse_column_mass``: the Triton kernels (CPU: under
TRITON_INTERPRET=1, fp32/fp16) against the definition, backend choice, the op's contract."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dlm_ops
from dlm_ops.reference import column_mass_ref
from dlm_ops.sparsity import _select_backend, indices_to_column_mask, pulsecol_column_mass, pulsecol_select
from dlm_ops.sparsity.pulsecol import keep_count, sample_rows_index

from .strategies import HEADS
from .test_sparsity_selection import _qk, check_index_invariants


def _rows(spec, sq):
    """sample_rows as the caller passes it, and the rows the definition sums over (None: all)."""
    if spec is None:
        return None, None
    if isinstance(spec, int):
        return spec, sample_rows_index(sq, spec, "cpu")
    gen = torch.Generator().manual_seed(spec[1])
    rows = torch.randint(0, sq, (spec[0],), generator=gen)  # repeats allowed: each one counts
    return rows, rows


def check_against_definition(q, k, sample_rows, picked, **kw):
    """Triton's mass is within 2x the error of the fp32 torch path on the same inputs (both
    against fp64 on those inputs), every entry written, and its top columns are the heaviest."""
    ours = pulsecol_column_mass(q, k, sample_rows=sample_rows, backend="triton", **kw)
    plain = pulsecol_column_mass(q, k, sample_rows=sample_rows, backend="torch", **kw)
    gold = column_mass_ref(q, k, picked, **kw)
    assert ours.shape == gold.shape and ours.dtype == torch.float32
    assert torch.isfinite(ours).all()  # outputs start NaN-poisoned in tests
    err, base = (ours.double() - gold).abs().max(), (plain.double() - gold).abs().max()
    assert err <= 2 * base + 1e-5, (err, base)
    sk = k.shape[1]
    for keep in (0.1, 0.5):
        idx, cnt = pulsecol_select(q, k, keep=keep, sample_rows=sample_rows, backend="triton", **kw)
        check_index_invariants(idx, cnt, sk)
        assert (cnt == keep_count(sk, keep)).all()
        chosen = indices_to_column_mask(idx, cnt, sk)
        lowest_kept = gold.masked_fill(~chosen, math.inf).amin(-1)
        highest_dropped = gold.masked_fill(chosen, -math.inf).amax(-1)
        assert (lowest_kept >= highest_dropped - 2 * err - 1e-6).all()
    return ours


@settings(max_examples=12)
@given(b=st.integers(1, 2), sq=st.integers(1, 70), sk=st.integers(1, 70),
       heads=st.sampled_from(HEADS), d=st.sampled_from([8, 24, 32]),
       dtype=st.sampled_from([torch.float32, torch.float16]),
       rows=st.one_of(st.none(), st.integers(1, 80),
                      st.tuples(st.integers(1, 40), st.integers(0, 99))),
       scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 99))
def test_triton_column_mass_matches_definition(b, sq, sk, heads, d, dtype, rows, scale, seed):
    h, hkv = heads
    q, k = (t.to(dtype) for t in _qk(b, sq, sk, h, hkv, d, seed, scale=2.0))
    sample_rows, picked = _rows(rows, sq)
    check_against_definition(q, k, sample_rows, picked, softmax_scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_column_mass_with_the_gpu_tiles(monkeypatch, dtype):
    """The H200's tiles (128-row LSE tiles, 64 x 128 mass tiles) under the interpreter: partial
    tiles both ways, several query tiles per key tile, GQA."""
    gpu_tiles = _select_backend.column_tiles(128, torch.tensor([], dtype=dtype).element_size(),
                                             interpret=False)
    monkeypatch.setattr(_select_backend, "column_tiles", lambda d, itemsize, interpret: gpu_tiles)
    q, k = (t.to(dtype) for t in _qk(1, 200, 300, 4, 2, 32, 3, scale=2.0))
    check_against_definition(q, k, None, None)
    check_against_definition(q, k, 70, sample_rows_index(200, 70, "cpu"))


def test_triton_ties_and_determinism():
    # q = 0: every row's softmax is uniform, so every column holds the same mass, bit for bit
    # (each column's sum runs the same operations on the same numbers): the lowest columns win.
    q, k = torch.zeros(2, 40, 4, 16), torch.randn(2, 37, 2, 16)
    idx, cnt = pulsecol_select(q, k, keep=0.2, backend="triton")
    assert (cnt == 8).all() and (idx == torch.arange(8, dtype=torch.int32)).all()
    mass = pulsecol_column_mass(q, k, backend="triton")
    assert (mass == mass[..., :1]).all()
    torch.testing.assert_close(mass, torch.full_like(mass, 40 / 37))
    # Random inputs: no atomics, so two runs agree bitwise.
    q, k = _qk(1, 50, 45, 4, 1, 16, 5, scale=2.0)
    assert torch.equal(pulsecol_column_mass(q, k, backend="triton"),
                       pulsecol_column_mass(q, k, backend="triton"))


def test_column_mass_backend_choice_and_validation():
    from dlm_ops.backends import select
    from dlm_ops.backends.base import GQA, Problem

    # CPU picks torch unless Triton is forced; head dims that are not multiples of 8 stay torch.
    assert select(Problem("cpu", torch.float32, 16, frozenset({GQA})), family="sparse_select").name == "torch"
    q, k = _qk(1, 8, 8, 2, 1, 12, 0)
    with pytest.raises(dlm_ops.UnsupportedConfig, match="head"):
        pulsecol_column_mass(q, k, backend="triton")
    q, k = _qk(1, 8, 8, 2, 1, 16, 0)
    with pytest.raises(ValueError, match="sample_rows must lie"):
        pulsecol_column_mass(q, k, sample_rows=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="sample_rows"):
        torch.ops.dlm.sparse_column_mass(q, k, torch.tensor([1.0]), True, None, None, None, None)
    with pytest.raises(ValueError, match="chunk_rows"):
        pulsecol_column_mass(q, k, chunk_rows=0)
    with pytest.raises(ValueError, match="softmax_scale"):
        pulsecol_column_mass(q, k, softmax_scale=-1.0)


@pytest.mark.parametrize("rows", [None, torch.tensor([0, 5, 5, 12])])
def test_opcheck_sparse_column_mass(rows):
    q, k = _qk(2, 13, 9, 4, 2, 16, 0)
    for backend in ("torch", "triton"):
        torch.library.opcheck(torch.ops.dlm.sparse_column_mass.default,
                              (q, k, rows, rows is not None, None, 4, 3, backend))


def test_compiled_pulsecol_select_matches_eager():
    from torch._dynamo.testing import CompileCounterWithBackend

    def select(q, k):
        return pulsecol_select(q * 1.5, k, keep=0.3, sample_rows=7, backend="torch")

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(select, backend=counter, fullgraph=True)
    q, k = _qk(2, 24, 20, 4, 2, 16, 1)
    for got, want in zip(compiled(q, k), select(q, k)):
        assert torch.equal(got, want)
    assert counter.frame_count == 1
    torch._dynamo.reset()


# --- GPU (run with -m gpu on a CUDA machine) -------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s,d,rows", [(2048, 128, None), (3001, 128, 256), (1500, 64, None),
                                      (1024, 256, 100)])
def test_gpu_triton_column_mass(dtype, s, d, rows):
    gen = torch.Generator(device="cuda").manual_seed(s)
    q = torch.randn(2, s, 32, d, device="cuda", generator=gen).to(dtype)
    k = torch.randn(2, s + 7, 8, d, device="cuda", generator=gen).to(dtype)
    ours = pulsecol_column_mass(q, k, sample_rows=rows)  # auto: the Triton kernels on CUDA
    gold = pulsecol_column_mass(q.double(), k.double(), sample_rows=rows, backend="torch")
    plain = pulsecol_column_mass(q, k, sample_rows=rows, backend="torch")
    assert torch.isfinite(ours).all()
    err, base = (ours.double() - gold).abs().max(), (plain.double() - gold).abs().max()
    assert err <= 2 * base + 1e-4, (err, base)
    assert torch.equal(ours, pulsecol_column_mass(q, k, sample_rows=rows))  # deterministic
    idx, cnt = pulsecol_select(q, k, keep=0.2, sample_rows=rows)
    chosen = indices_to_column_mask(idx, cnt, k.shape[1])
    lowest_kept = gold.masked_fill(~chosen, math.inf).amin(-1)
    highest_dropped = gold.masked_fill(chosen, -math.inf).amax(-1)
    assert (lowest_kept >= highest_dropped - 2 * err - 1e-4).all()
