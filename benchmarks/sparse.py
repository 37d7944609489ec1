"""``python -m benchmarks.sparse --out DIR``: block-sparse attention time against dense attention.

Issue #5's yardstick: at S = 16K, 32K, 64K (batch 1, bf16, D=128, GQA 32/8), forward time of
``dlm_ops.block_sparse_attn`` divided by the forward time of dense non-causal attention (cuDNN
SDPA), against the density of the block pattern; the goal is time ratio <= 1.15 x density at
every point. FlexAttention (compiled) with the same block table (``BlockMask.from_kv_blocks``,
every listed block marked full, so no mask_mod runs) is the contender; both outputs are checked
against the torch backend in fp32 on a slice (``err_ours``, ``err_flex``).

Patterns: per (head, query block) a uniformly random set of round(density * nKb) key blocks,
listed in ascending order (what a table-to-indices conversion produces); selection blocks of 128
on both sides. Timed calls skip the index check (``check_indices=False``: one host sync, measured
once per case and reported separately as ``check_ms``). Dense SDPA gets K/V expanded to 32 heads
up front (not timed). Contenders run interleaved in rounds inside one process (DESIGN.md section
5, benchmarks/__main__.py's ``_time_once``); the report is the median per contender and the ratios
of medians measured in the same process. Prints the markdown table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

from .__main__ import _time_once, run_meta, write_results

SEQLENS = (16384, 32768, 65536)
DENSITIES = (0.1, 0.2, 0.3, 0.5)
GOAL = 1.15  # sparse / dense time <= GOAL * density


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


def _inputs(case: SparseCase, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(case.batch, case.seqlen, h, case.head_dim, device="cuda",
                               generator=g, dtype=torch.bfloat16)
    return mk(case.heads), mk(case.kv_heads), mk(case.kv_heads)


def make_ours(case: SparseCase, q, k, v, idx, counts):
    import dlm_ops

    bs = case.block_size
    return lambda: dlm_ops.block_sparse_attn(q, k, v, idx, counts, block_size_q=bs,
                                             block_size_k=bs, check_indices=False)


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


def bench_seqlen(seqlen: int, densities, rounds: int, block_size: int, with_flex: bool) -> list[dict]:
    """All densities of one sequence length and the dense baseline, interleaved in rounds."""
    base = SparseCase(seqlen, 1.0, block_size=block_size)
    q, k, v = _inputs(base)
    fns = {("dense cudnn", None): make_dense(base, q, k, v)}
    meta, patterns = {}, {}
    for d in densities:
        case = SparseCase(seqlen, d, block_size=block_size)
        idx, counts = block_pattern(case)
        patterns[d] = (case, idx, counts)
        fns[("dlm_ops", d)] = make_ours(case, q, k, v, idx, counts)
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
        import dlm_ops

        out_flex = fns[("flex", d)]() if ("flex", d) in fns else None
        meta[d] = check_accuracy(case, fns[("dlm_ops", d)](), out_flex, q, k, v, idx, counts)
        check = lambda: dlm_ops.block_sparse_attn(q, k, v, idx, counts, block_size_q=block_size,
                                                  block_size_k=block_size, check_indices=True)
        meta[d]["check_ms"] = statistics.median(_time_once(None, check, 1) for _ in range(3)) - \
            statistics.median(_time_once(None, fns[("dlm_ops", d)], 1) for _ in range(3))
    times = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            times[key].append(_time_once(None, fn, 3))
    dense_ms = statistics.median(times[("dense cudnn", None)])
    rows = [dict(asdict(base), density=1.0, contender="dense cudnn", ms=dense_ms, ratio=1.0,
                 ratio_over_density=1.0)]
    for (name, d), ts in times.items():
        if d is None:
            continue
        case = patterns[d][0]
        ms = statistics.median(ts)
        rows.append(dict(asdict(case), true_density=case.true_density, contender=name, ms=ms,
                         ratio=ms / dense_ms, ratio_over_density=ms / dense_ms / case.true_density,
                         **meta[d]))
    return rows


def markdown(rows: list[dict]) -> str:
    head = ["S", "density", "dense cuDNN ms", "dlm_ops ms", "dlm_ops / dense", "/ density",
            "flex ms", "flex / dense", "flex / density", "flex ms / dlm_ops ms",
            f"dlm_ops / density <= {GOAL}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    dense = {r["seqlen"]: r["ms"] for r in rows if r["contender"] == "dense cudnn"}
    keys = sorted({(r["seqlen"], r["density"]) for r in rows if r["contender"] != "dense cudnn"})
    for s, d in keys:
        get = lambda name: next((r for r in rows if r["contender"] == name and r["seqlen"] == s
                                 and r["density"] == d), None)
        ours, flex = get("dlm_ops"), get("flex")
        f = lambda r, key, fmt: "-" if r is None else format(r[key], fmt)
        lines.append("| " + " | ".join([
            f"{s // 1024}K", f"{(ours or flex)['true_density']:.3f}", f"{dense[s]:.2f}",
            f(ours, "ms", ".2f"), f(ours, "ratio", ".3f"), f(ours, "ratio_over_density", ".2f"),
            f(flex, "ms", ".2f"), f(flex, "ratio", ".3f"), f(flex, "ratio_over_density", ".2f"),
            "-" if not (ours and flex) else f"{flex['ms'] / ours['ms']:.2f}x",
            "-" if ours is None else ("yes" if ours["ratio_over_density"] <= GOAL else "no"),
        ]) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--seqlens", default=",".join(str(s) for s in SEQLENS))
    p.add_argument("--densities", default=",".join(str(d) for d in DENSITIES))
    p.add_argument("--block-size", type=int, default=128, choices=[64, 128])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--tag", default="h200_sparse")
    a = p.parse_args(argv)
    a.seqlens = [int(x) for x in a.seqlens.split(",")]
    a.densities = [float(x) for x in a.densities.split(",")]
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
                                                       not a.no_flex)]
        torch.cuda.empty_cache()
    write_results(a.out, a.tag, rows, meta,
                  f"bf16, B=1, H=32, Hkv=8, D=128, selection blocks {a.block_size}; forward; median "
                  f"of {a.rounds} interleaved rounds of 3 calls.", markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
