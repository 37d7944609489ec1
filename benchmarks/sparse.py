"""``python -m benchmarks.sparse --out DIR [--preset quick]``: block- and column-sparse attention
time against dense attention, and what selecting a pattern costs.

Issue #5's yardstick: at S = 16K, 32K, 64K (batch 1, bf16, D=128, GQA 32/8), forward time of
``dlm_ops.block_sparse_attn`` and of ``dlm_ops.column_sparse_attn`` divided by the forward time of
dense non-causal attention (cuDNN SDPA), against the density of the pattern; the goal is time
ratio <= 1.15 x density at every point. ``dlm_ops`` is the default dispatch (on an sm90 machine where
it builds, the ``cutlass`` backend: its forward at these 128-token blocks); ``dlm_ops triton`` is
the same call forced to the Triton kernels, so both show in one run. FlexAttention (compiled) with
the same block table
(``BlockMask.from_kv_blocks``, every listed block marked full, so no mask_mod runs) is the
block-sparse contender; outputs are checked against the torch backend in fp32 on a slice
(``err_ours``, ``err_flex``). Column-sparse: ``dlm_ops column`` is the default dispatch (on sm90
the ``cutlass`` backend: the listed K / V gathered per head, then the block-sparse kernel with a
key length per head), ``dlm_ops column triton`` the same call forced to Triton's kernel, and,
where the cutlass extension is built, ``dlm_ops column gather`` times that backend's gather and
plan alone (``gather ms``: one launch of column_gather) and its kernel alone on inputs prepared once
(``kernel ms``; the last column is what the op adds to both); no other contender (flex would need a
per-token mask_mod over a column table, evaluated inside every visited block).

``cudnn equal work`` is dense cuDNN over the first listed x block_size keys: the same key tiles per
query block as a block-sparse item, none of the list's cost; its time / (dense time x density) is
what the fastest dense kernel reaches with that much work per query block (session 15: 1.12x at
16K / 10 %, where ours read 1.29-1.37x).

Patterns: block-sparse, per (head, query block) a uniformly random set of round(density * nKb) key
blocks, listed in ascending order (what a table-to-indices conversion produces), selection blocks
of 128 on both sides; column-sparse, per head a uniformly random ascending set of
round(density * S) key columns (what ``pulsecol_select`` returns). Timed calls skip the index
check (``check_indices=False``: one host sync, measured once per case and reported separately as
``check_ms``). Dense SDPA gets K/V expanded to 32 heads up front (not timed).

Selection cost, in the same rounds as the dense baseline: ``pulsecol_select`` (the Triton column
mass: a row-LSE pass and a column-mass pass over the sampled rows) with S/8 sampled rows and with
all rows, and ``sparsed_select`` (the fused Triton block mass, blocks of 64) for reference; each as
a multiple of one dense attention and amortised over 64/256/1024 steps: sel_ms / (steps x dense_ms).
The chunked-PyTorch paths are timed by ``benchmarks.sparse_quality`` (too slow to sit in these
rounds at 64K).

Contenders run interleaved in rounds inside one process (DESIGN.md section 5,
benchmarks/__main__.py's ``_time_once``); the report is the median per contender and the ratios
of medians measured in the same process. ``--preset quick`` (densities 10/30/50%, 3 rounds, no
flex: no compiles, well under 3 minutes on an H200) writes ``<tag>_quick``. Prints the markdown
tables last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

from .__main__ import _calls_per_measurement, _time_once, shuffled_rounds, run_meta, write_results

SEQLENS = (16384, 32768, 65536)
DENSITIES = (0.1, 0.2, 0.3, 0.5)
QUICK_DENSITIES = (0.1, 0.3, 0.5)
GOAL = 1.15  # sparse / dense time <= GOAL * density
AMORTISE_STEPS = (64, 256, 1024)
DENSE = "dense cudnn"
TRITON = "dlm_ops triton"  # block-sparse forced to the Triton kernels (dlm_ops: default dispatch)
COLUMN = "dlm_ops column"
COLUMN_TRITON = "dlm_ops column triton"  # column-sparse forced to the Triton kernel
COLUMN_GATHER = "dlm_ops column gather"  # the cutlass column forward's input preparation alone
COLUMN_KERNEL = "dlm_ops column kernel"  # its kernel alone, on inputs prepared once
EQUAL_WORK = "cudnn equal work"  # dense cuDNN over the first listed * block keys: the same tiles per query block


@dataclass(frozen=True)
class SparseCase:
    seqlen: int
    density: float
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 128
    batch: int = 1

    @property
    def num_blocks(self) -> int:
        return -(-self.seqlen // self.block_size)

    @property
    def listed(self) -> int:
        """Key blocks listed per query block (at least one)."""
        return max(1, round(self.density * self.num_blocks))

    @property
    def true_density(self) -> float:
        return self.listed / self.num_blocks

    @property
    def columns(self) -> int:
        """Key columns listed per head (column-sparse; at least one)."""
        return max(1, round(self.density * self.seqlen))

    @property
    def label(self) -> str:
        return f"S={self.seqlen // 1024}K density={self.density:.0%}"


def cases(seqlens=SEQLENS, densities=DENSITIES, block_size=128) -> list[SparseCase]:
    return [SparseCase(s, d, block_size=block_size) for s in seqlens for d in densities]


def block_pattern(case: SparseCase, seed: int = 0, device="cuda"):
    """int32 indices (B, H, nQb, nKb) with each row's first ``listed`` entries a random ascending
    set of distinct key blocks (the rest: the other blocks, never read), and counts (B, H, nQb)."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = case.num_blocks
    shape = (case.batch, case.heads, n, n)
    order = torch.rand(shape, generator=g, device=device).argsort(dim=-1)
    chosen = order[..., : case.listed].sort(dim=-1).values
    idx = torch.cat([chosen, order[..., case.listed:]], dim=-1).to(torch.int32).contiguous()
    counts = torch.full(shape[:3], case.listed, dtype=torch.int32, device=device)
    return idx, counts


def column_pattern(case: SparseCase, seed: int = 0, device="cuda"):
    """int32 indices (B, H, columns): per head a random ascending set of distinct key columns,
    and counts (B, H) (all lists full)."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (case.batch, case.heads, case.seqlen)
    order = torch.rand(shape, generator=g, device=device).argsort(dim=-1)
    idx = order[..., : case.columns].sort(dim=-1).values.to(torch.int32).contiguous()
    return idx, torch.full(shape[:2], case.columns, dtype=torch.int32, device=device)


def _inputs(case: SparseCase, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(case.batch, case.seqlen, h, case.head_dim, device="cuda",
                               generator=g, dtype=torch.bfloat16)
    return mk(case.heads), mk(case.kv_heads), mk(case.kv_heads)


def make_ours(case: SparseCase, q, k, v, idx, counts, backend=None):
    import dlm_ops

    bs = case.block_size
    return lambda: dlm_ops.block_sparse_attn(q, k, v, idx, counts, block_size_q=bs,
                                             block_size_k=bs, check_indices=False, backend=backend)


def make_column(case: SparseCase, q, k, v, idx, counts, backend=None):
    import dlm_ops

    return lambda: dlm_ops.column_sparse_attn(q, k, v, idx, counts, check_indices=False,
                                              backend=backend)


def make_column_gather(case: SparseCase, k, v, idx, counts):
    """What the cutlass column forward does before its kernel (the gathered K / V and the plan:
    one launch of the extension's column_gather, cutlass_sparse.column_inputs), or None where the
    extension is not built here."""
    from dlm_ops.backends import cutlass_sparse as cs

    if cs.CutlassSparseBackend().unavailable_reason() is not None or cs._extension() is None:
        return None
    ext, nqb = cs._extension(), -(-case.seqlen // cs.BLOCK)
    return lambda: cs.column_inputs(ext, k, v, idx, counts, nqb)


def make_column_kernel(case: SparseCase, q, k, v, idx, counts):
    """The cutlass column forward's kernel alone: column_inputs once (untimed), then ext.fwd into
    preallocated out / lse, as the backend calls it; None where the extension is not built. With
    the gather's row, says how much of the op's time is neither (session 15: 5-10 % at 32K; session
    16 found that to be the rounds' fixed order, the column op always right after a cuDNN call;
    with shuffled rounds it is within the noise)."""
    from dlm_ops.backends import cutlass_sparse as cs

    if cs.CutlassSparseBackend().unavailable_reason() is not None or cs._extension() is None:
        return None
    ext, nqb = cs._extension(), -(-case.seqlen // cs.BLOCK)
    kg, vg, key_len, shared, blocks, order = cs.column_inputs(ext, k, v, idx, counts, nqb)
    b, sq, h, _ = q.shape
    out, lse = torch.empty_like(q), torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    scale = q.shape[-1] ** -0.5
    return lambda: ext.fwd(q, kg, vg, out, lse, shared, blocks, order, cs.BLOCK, cs.BLOCK, scale,
                           key_len=key_len, **cs.launch_args(ext, q, blocks.numel()))


def make_selections(seqlen: int, q, k) -> dict:
    """Selection contenders at one length: name -> fn (the pattern's density does not change the
    cost of scoring; keep / rho 0.3)."""
    from dlm_ops.sparsity import pulsecol_select, sparsed_select

    return {
        "pulsecol select (S/8 rows)": lambda: pulsecol_select(q, k, keep=0.3,
                                                              sample_rows=seqlen // 8),
        "pulsecol select (all rows)": lambda: pulsecol_select(q, k, keep=0.3),
        "sparsed select (block 64)": lambda: sparsed_select(q, k, block_size_q=64, block_size_k=64,
                                                            rho=0.3, prompt_len=seqlen // 2),
    }


def make_flex(case: SparseCase, q, k, v, idx, counts):
    """Compiled flex_attention, (B, H, S, D) layout prepared up front, the same blocks marked
    full (no partial blocks: none of ours needs an element mask either).

    The mask_mod stays flex's default no-op, one function object for every density: dynamo
    guards on the mask_mod, so a per-density closure (a table lookup) would recompile flex for
    every case (12 compiles, past the recompile limit flex silently runs eagerly). Compiled flex
    reads only the block tables for full blocks and never calls the mask_mod there; eager flex
    would evaluate the no-op mask_mod alone and compute DENSE attention (checked on CPU), which is
    why every case compares flex's output with the reference (``err_flex``)."""
    import dlm_ops
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    dlm_ops.compile.disable()  # measure flex itself, never our rewrite
    empty = torch.zeros_like(counts)
    mask = BlockMask.from_kv_blocks(empty, idx, counts, idx, BLOCK_SIZE=case.block_size,
                                    seq_lengths=(case.seqlen, case.seqlen))
    fn = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return lambda: fn(qt, kt, vt, block_mask=mask, enable_gqa=True)


def make_dense(case: SparseCase, q, k, v):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = case.heads // case.kv_heads
    qt = q.transpose(1, 2).contiguous()
    kt, vt = (t.repeat_interleave(g, dim=2).transpose(1, 2).contiguous() for t in (k, v))

    def run():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt)

    return run


def make_equal_work(case: SparseCase, q, k, v):
    """Dense cuDNN SDPA over the first ``listed * block_size`` keys: every query block does the
    work of one sparse item (the same number of 128-key tiles), with none of the list's cost.
    Its time / (dense time x density) is what the fastest dense kernel reaches at this much work
    per query block; the sparse kernel's fixed cost per item (Q load, the pipeline's start and
    end, the epilogue) is paid by that kernel too, so the goal's ratio is only reachable where
    this one is well under it."""
    keys = min(case.seqlen, case.listed * case.block_size)
    return make_dense(case, q, k[:, :keys], v[:, :keys])


def check_accuracy(case: SparseCase, out_ours, out_flex, q, k, v, idx, counts) -> dict:
    """Max abs difference of ours and flex against the fp32 torch backend on the first 1024
    queries of head group 0 (small enough to run at 64K)."""
    import dlm_ops

    rows = min(case.seqlen, 1024)
    nqb = -(-rows // case.block_size)
    g = case.heads // case.kv_heads
    ref = dlm_ops.block_sparse_attn(q[:, :rows, :g].float(), k[:, :, :1].float(),
                                    v[:, :, :1].float(), idx[:, :g, :nqb, :case.listed].contiguous(),
                                    counts[:, :g, :nqb].contiguous(),
                                    block_size_q=case.block_size, block_size_k=case.block_size,
                                    backend="torch")
    res = {"err_ours": (out_ours[:, :rows, :g].float() - ref).abs().max().item()}
    if out_flex is not None:
        res["err_flex"] = (out_flex.transpose(1, 2)[:, :rows, :g].float() - ref).abs().max().item()
    return res


def check_column_accuracy(case: SparseCase, out, q, k, v, idx, counts) -> dict:
    """Max abs difference against the fp32 torch backend, first 1024 queries of head group 0."""
    import dlm_ops

    rows, g = min(case.seqlen, 1024), case.heads // case.kv_heads
    ref = dlm_ops.column_sparse_attn(q[:, :rows, :g].float(), k[:, :, :1].float(),
                                     v[:, :, :1].float(), idx[:, :g].contiguous(),
                                     counts[:, :g].contiguous(), backend="torch")
    return {"err_ours": (out[:, :rows, :g].float() - ref).abs().max().item()}


def _check_ms(checked, unchecked) -> float:
    """What the index check's host sync adds to one call."""
    return (statistics.median(_time_once(None, checked, 1) for _ in range(3))
            - statistics.median(_time_once(None, unchecked, 1) for _ in range(3)))


def bench_seqlen(seqlen: int, densities, rounds: int, block_size: int, with_flex: bool,
                 with_select: bool = True) -> list[dict]:
    """All densities of one sequence length, the selections and the dense baseline, interleaved
    in rounds."""
    import dlm_ops

    base = SparseCase(seqlen, 1.0, block_size=block_size)
    q, k, v = _inputs(base)
    fns = {(DENSE, None): make_dense(base, q, k, v)}
    meta, patterns, columns = {}, {}, {}
    for d in densities:
        case = SparseCase(seqlen, d, block_size=block_size)
        idx, counts = block_pattern(case)
        patterns[d] = (case, idx, counts)
        fns[("dlm_ops", d)] = make_ours(case, q, k, v, idx, counts)
        fns[(TRITON, d)] = make_ours(case, q, k, v, idx, counts, backend="triton")
        fns[(EQUAL_WORK, d)] = make_equal_work(case, q, k, v)
        columns[d] = column_pattern(case)
        fns[(COLUMN, d)] = make_column(case, q, k, v, *columns[d])
        fns[(COLUMN_TRITON, d)] = make_column(case, q, k, v, *columns[d], backend="triton")
        gather = make_column_gather(case, k, v, *columns[d])
        if gather is not None:
            fns[(COLUMN_GATHER, d)] = gather
            fns[(COLUMN_KERNEL, d)] = make_column_kernel(case, q, k, v, *columns[d])
        if with_flex:
            try:
                fns[("flex", d)] = make_flex(case, q, k, v, idx, counts)
            except Exception as e:  # a contender that cannot run is reported, not fatal
                print(f"  flex {case.label}: skipped ({type(e).__name__}: {str(e)[:120]})")
    for key, fn in list(fns.items()):  # warm-up: compilation, allocator
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as e:
            print(f"  {key}: skipped ({type(e).__name__}: {str(e)[:160]})")
            fns.pop(key)
    for d, (case, idx, counts) in patterns.items():
        out_flex = fns[("flex", d)]() if ("flex", d) in fns else None
        meta[("dlm_ops", d)] = check_accuracy(case, fns[("dlm_ops", d)](), out_flex, q, k, v, idx,
                                              counts)
        meta[("flex", d)] = meta[("dlm_ops", d)]  # one row per contender carries both errors
        if (TRITON, d) in fns:
            meta[(TRITON, d)] = check_accuracy(case, fns[(TRITON, d)](), None, q, k, v, idx, counts)
        meta[("dlm_ops", d)]["check_ms"] = _check_ms(
            lambda: dlm_ops.block_sparse_attn(q, k, v, idx, counts, block_size_q=block_size,
                                              block_size_k=block_size, check_indices=True),
            fns[("dlm_ops", d)])
        cidx, ccounts = columns[d]
        if (COLUMN, d) in fns:
            meta[(COLUMN, d)] = dict(
                check_column_accuracy(case, fns[(COLUMN, d)](), q, k, v, cidx, ccounts),
                check_ms=_check_ms(lambda: dlm_ops.column_sparse_attn(q, k, v, cidx, ccounts),
                                   fns[(COLUMN, d)]))
        if (COLUMN_TRITON, d) in fns:
            meta[(COLUMN_TRITON, d)] = check_column_accuracy(case, fns[(COLUMN_TRITON, d)](), q, k,
                                                             v, cidx, ccounts)
    if with_select:
        for name, fn in make_selections(seqlen, q, k).items():
            try:
                fn()  # warm-up (Triton compiles)
                torch.cuda.synchronize()
                fns[(name, "select")] = fn
            except Exception as e:
                print(f"  {name}: skipped ({type(e).__name__}: {str(e)[:160]})")
    calls = {key: _calls_per_measurement(None, fn) for key, fn in fns.items()}
    times = shuffled_rounds(list(fns), rounds, lambda key: _time_once(None, fns[key], calls[key]))
    dense_ms = statistics.median(times[(DENSE, None)])
    rows = [dict(asdict(base), kind="dense", density=1.0, contender=DENSE, ms=dense_ms, ratio=1.0,
                 ratio_over_density=1.0)]
    for (name, d), ts in times.items():
        ms = statistics.median(ts)
        if d == "select":
            rows.append(dict(asdict(base), kind="select", contender=name, ms=ms,
                             ratio=ms / dense_ms, **{f"amortised_{n}": ms / (n * dense_ms)
                                                     for n in AMORTISE_STEPS}))
        elif d is not None:
            case = patterns[d][0]
            column = name in (COLUMN, COLUMN_TRITON, COLUMN_GATHER, COLUMN_KERNEL)
            density = case.columns / seqlen if column else case.true_density
            rows.append(dict(asdict(case), kind="column" if column else "block",
                             true_density=density, contender=name, ms=ms, ratio=ms / dense_ms,
                             ratio_over_density=ms / dense_ms / density, **meta.get((name, d), {})))
    return rows


def markdown(rows: list[dict]) -> str:
    """The block-sparse table, then the column-sparse one, then the selection costs."""
    parts = [block_table(rows)]
    if any(r.get("kind") == "column" for r in rows):
        parts.append(column_table(rows))
    if any(r.get("kind") == "select" for r in rows):
        parts.append(select_table(rows))
    return "\n\n".join(parts)


def _dense_ms(rows: list[dict]) -> dict:
    return {r["seqlen"]: r["ms"] for r in rows if r["contender"] == DENSE}


def column_table(rows: list[dict]) -> str:
    """One line per (S, density): the default dispatch, then the forced-Triton contender and the
    cutlass path's gather alone (``-`` in a run without them)."""
    head = ["S", "density (columns)", "dense cuDNN ms", "column ms", "column / dense",
            "/ density", "err vs fp32", f"column / density <= {GOAL}", "triton ms",
            "triton / density", "triton ms / column ms", "gather ms", "kernel ms",
            "column ms - gather - kernel"]
    lines = ["Column-sparse (`column_sparse_attn`, every query of a head attends to its head's "
             "columns):", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    dense = _dense_ms(rows)
    column = [r for r in rows if r.get("kind") == "column"]
    for s, d in sorted({(r["seqlen"], r["density"]) for r in column}):
        get = lambda name: next((r for r in column if r["contender"] == name
                                 and r["seqlen"] == s and r["density"] == d), None)
        r, t, g, kern = get(COLUMN), get(COLUMN_TRITON), get(COLUMN_GATHER), get(COLUMN_KERNEL)
        f = lambda x, key, fmt: "-" if x is None else format(x[key], fmt)
        lines.append("| " + " | ".join([
            f"{s // 1024}K", f"{(r or t)['true_density']:.3f}", f"{dense[s]:.2f}",
            f(r, "ms", ".2f"), f(r, "ratio", ".3f"), f(r, "ratio_over_density", ".2f"),
            "-" if r is None else f"{r.get('err_ours', float('nan')):.1e}",
            "-" if r is None else ("yes" if r["ratio_over_density"] <= GOAL else "no"),
            f(t, "ms", ".2f"), f(t, "ratio_over_density", ".2f"),
            "-" if not (r and t) else f"{t['ms'] / r['ms']:.2f}x", f(g, "ms", ".3f"),
            f(kern, "ms", ".2f"),
            "-" if not (r and g and kern) else f"{r['ms'] - g['ms'] - kern['ms']:.3f}"]) + " |")
    return "\n".join(lines)


def select_table(rows: list[dict]) -> str:
    head = ["S", "selection", "ms", "x dense"] + [f"/ {n} steps of dense" for n in AMORTISE_STEPS]
    lines = ["Selection cost (one call; keep / rho 0.3), in units of one dense cuDNN attention:", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in (r for r in rows if r.get("kind") == "select"):
        lines.append("| " + " | ".join([f"{r['seqlen'] // 1024}K", r["contender"], f"{r['ms']:.2f}",
                                        f"{r['ratio']:.3f}",
                                        *[f"{r[f'amortised_{n}']:.4f}" for n in AMORTISE_STEPS]])
                     + " |")
    return "\n".join(lines)


def block_table(rows: list[dict]) -> str:
    head = ["S", "density", "dense cuDNN ms", "dlm_ops ms", "dlm_ops / dense", "/ density",
            "flex ms", "flex / dense", "flex / density", "flex ms / dlm_ops ms",
            f"dlm_ops / density <= {GOAL}", "triton ms", "triton / density",
            "triton ms / dlm_ops ms", "cuDNN equal work / density", "dlm_ops / cuDNN equal work"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    dense = _dense_ms(rows)
    keys = sorted({(r["seqlen"], r["density"]) for r in rows
                   if r["contender"] in ("dlm_ops", "flex", TRITON)})
    for s, d in keys:
        get = lambda name: next((r for r in rows if r["contender"] == name and r["seqlen"] == s
                                 and r["density"] == d), None)
        ours, flex, triton, equal = get("dlm_ops"), get("flex"), get(TRITON), get(EQUAL_WORK)
        f = lambda r, key, fmt: "-" if r is None else format(r[key], fmt)
        lines.append("| " + " | ".join([
            f"{s // 1024}K", f"{(ours or flex or triton)['true_density']:.3f}", f"{dense[s]:.2f}",
            f(ours, "ms", ".2f"), f(ours, "ratio", ".3f"), f(ours, "ratio_over_density", ".2f"),
            f(flex, "ms", ".2f"), f(flex, "ratio", ".3f"), f(flex, "ratio_over_density", ".2f"),
            "-" if not (ours and flex) else f"{flex['ms'] / ours['ms']:.2f}x",
            "-" if ours is None else ("yes" if ours["ratio_over_density"] <= GOAL else "no"),
            f(triton, "ms", ".2f"), f(triton, "ratio_over_density", ".2f"),
            "-" if not (ours and triton) else f"{triton['ms'] / ours['ms']:.2f}x",
            f(equal, "ratio_over_density", ".2f"),
            "-" if not (ours and equal) else f"{ours['ms'] / equal['ms']:.2f}x",
        ]) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--preset", default="full", choices=["full", "quick"],
                   help="quick: densities 10/30/50%%, 3 rounds, no flex, tag <tag>_quick")
    p.add_argument("--seqlens", default=",".join(str(s) for s in SEQLENS))
    p.add_argument("--densities", default=None, help="default: 0.1,0.2,0.3,0.5 (quick: 0.1,0.3,0.5)")
    p.add_argument("--block-size", type=int, default=128, choices=[64, 128])
    p.add_argument("--rounds", type=int, default=None, help="default 5 (quick: 3)")
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--no-select", action="store_true", help="skip the selection-cost rows")
    p.add_argument("--tag", default="h200_sparse")
    a = p.parse_args(argv)
    quick = a.preset == "quick"
    a.seqlens = [int(x) for x in a.seqlens.split(",")]
    a.densities = ([float(x) for x in a.densities.split(",")] if a.densities
                   else list(QUICK_DENSITIES if quick else DENSITIES))
    a.rounds = a.rounds or (3 if quick else 5)
    if quick:
        a.no_flex, a.tag = True, a.tag + "_quick"
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU")
        return 1
    meta = run_meta()
    rows = []
    for s in a.seqlens:
        print(f"S={s}", flush=True)
        torch._dynamo.reset()  # a fresh compile cache per length (flex recompiles per shape)
        rows += [dict(meta, **r) for r in bench_seqlen(s, a.densities, a.rounds, a.block_size,
                                                       not a.no_flex, not a.no_select)]
        torch.cuda.empty_cache()
    write_results(a.out, a.tag, rows, meta,
                  f"bf16, B=1, H=32, Hkv=8, D=128, block-sparse selection blocks {a.block_size}; "
                  f"forward; median of {a.rounds} interleaved rounds, each measurement ~25 ms "
                  "of back-to-back calls (at least 3).", markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
