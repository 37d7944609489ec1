"""``python -m benchmarks.cached_decode --out DIR``: one block-decoding attention step over a KV
cache (issue #6), dlm_ops against SDPA, and FlashBlock's reuse step against its refresh step.

Shapes: bf16, H=32 query heads over Hkv=8 kv heads (GQA 4), D=128; the block (bs queries, bs own
keys) attends to the whole clean cache and itself, no mask. Contenders, interleaved in rounds in one
process (DESIGN.md section 5), median over rounds:

    dlm_ops             torch.ops.dlm.block_decode_attn (the op: the public function's host check
                        of cache_seqlens values is one sync that a decode loop would not repeat)
                        over the (B, L, Hkv, D) cache + (B, bs, Hkv, D) block keys
    sdpa flash/cudnn/efficient
                        F.scaled_dot_product_attention over [cache; block] already concatenated
                        (B, Hkv, L + bs, D) (the concatenation a real decode step pays is NOT timed),
                        enable_gqa=True where the backend takes it, else K/V expanded to H heads
                        up front (marked "expanded": that one reads 4x the bytes)
    flashblock refresh  dlm_ops.flashblock_refresh: the full pass, also writing the cached part
    flashblock reuse    dlm_ops.flashblock_attn: block-internal attention + merge with the cache

Modes: "eager" times back-to-back calls (a Python decode loop: per-call launch overhead counts,
and it dominates the small cases); "graph" replays each call captured in a CUDA graph (how
production decode loops run: only GPU time counts). A contender that cannot be captured is left
out of the graph mode, and said so.

Grid (the "default" preset, ~2 minutes on an H200): B=1 and B=16 at L in {1K, 4K, 16K, 64K}, B=128
at L in {1K, 4K, 8K} (128 x 64K would hold 34 GB of K/V and 137 GB expanded), each at bs 4 and 32:
22 cases. Effective bandwidth counts the K/V bytes every contender must read once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

from .__main__ import run_meta, write_results

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SDPA_BACKENDS = ("flash", "cudnn", "efficient")


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    cache_len: int
    block_size: int
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM

    @property
    def label(self) -> str:
        return f"B={self.batch} L={self.cache_len} bs={self.block_size}"

    def kv_bytes(self, elem: int = 2) -> int:
        """K and V of the cache and the block, read once."""
        tokens = self.batch * (self.cache_len + self.block_size)
        return 2 * tokens * self.kv_heads * self.head_dim * elem


def cases(preset: str) -> list[DecodeCase]:
    if preset == "quick":
        return [DecodeCase(b, 4096, bs) for b in (1, 16) for bs in (4, 32)]
    if preset == "default":
        grid = [(1, L) for L in (1024, 4096, 16384, 65536)]
        grid += [(16, L) for L in (1024, 4096, 16384, 65536)]
        grid += [(128, L) for L in (1024, 4096, 8192)]
        return [DecodeCase(b, L, bs) for b, L in grid for bs in (4, 32)]
    raise SystemExit(f"unknown preset {preset!r}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.cached_decode",
                                description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default", choices=["default", "quick"])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=20, help="calls per timed sample")
    p.add_argument("--modes", default="eager,graph", help="eager and/or graph (CUDA graphs)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="h200_cached_decode", help="file name stem of the results")
    return p.parse_args(argv)


def markdown(rows: list[dict]) -> str:
    """One line per (case, mode): microseconds per contender, best SDPA / dlm_ops, refresh /
    reuse."""
    names = ["dlm_ops", *[f"sdpa {b}" for b in SDPA_BACKENDS], "flashblock refresh",
             "flashblock reuse"]
    head = ["case", "mode", *[f"{n} us" for n in names], "dlm_ops GB/s", "best sdpa / dlm_ops",
            "refresh / reuse"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, mode in dict.fromkeys((r["case"], r.get("mode", "eager")) for r in rows):
        cell = {r["contender"]: r for r in rows
                if r["case"] == case and r.get("mode", "eager") == mode}
        us = lambda n: (f"{cell[n]['ms'] * 1e3:.1f}" + (" (expanded)" if cell[n].get("expanded")
                                                        else "")) if n in cell else "-"
        sdpa = [cell[f"sdpa {b}"]["ms"] for b in SDPA_BACKENDS if f"sdpa {b}" in cell]
        ours = cell.get("dlm_ops")
        ratio = f"{min(sdpa) / ours['ms']:.2f}" if sdpa and ours else "-"
        fb = (f"{cell['flashblock refresh']['ms'] / cell['flashblock reuse']['ms']:.1f}"
              if "flashblock refresh" in cell and "flashblock reuse" in cell else "-")
        gbs = f"{ours['gb_per_s']:.0f}" if ours else "-"
        lines.append("| " + " | ".join([case, mode, *map(us, names), gbs, ratio, fb]) + " |")
    return "\n".join(lines)


# -- GPU part ------------------------------------------------------------------------------------


def _contenders(case: DecodeCase) -> dict:
    """name -> (callable, expanded?) on fresh inputs of ``case``."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import dlm_ops

    b, L, bs, h, hkv, d = (case.batch, case.cache_len, case.block_size, case.heads, case.kv_heads,
                           case.head_dim)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
    q = rnd(b, bs, h, d)
    kc, vc, kn, vn = rnd(b, L, hkv, d), rnd(b, L, hkv, d), rnd(b, bs, hkv, d), rnd(b, bs, hkv, d)
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    op = torch.ops.dlm
    out = {"dlm_ops": (lambda: op.block_decode_attn(q, kc, vc, lens, kn, vn, None, None), False)}

    # SDPA layout (B, heads, S, D), [cache; block] concatenated once, outside the timing
    q_s = q.transpose(1, 2).contiguous()
    k_s = torch.cat([kc, kn], 1).transpose(1, 2).contiguous()
    v_s = torch.cat([vc, vn], 1).transpose(1, 2).contiguous()
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    expanded = {}

    def sdpa(backend, gqa):
        if gqa:
            return lambda: _sdpa(F, sdpa_kernel, backend, q_s, k_s, v_s, True)
        if "kv" not in expanded:
            g = h // hkv
            expanded["kv"] = (k_s.repeat_interleave(g, 1), v_s.repeat_interleave(g, 1))
        k_e, v_e = expanded["kv"]
        return lambda: _sdpa(F, sdpa_kernel, backend, q_s, k_e, v_e, False)

    for name, backend in backends.items():
        for gqa in (True, False):
            fn = sdpa(backend, gqa)
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as e:  # this backend rejects this form: try the next, then skip
                print(f"  sdpa {name} (gqa={gqa}): {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            out[f"sdpa {name}"] = (fn, not gqa)
            break

    _, _, ext_out, ext_lse = dlm_ops.flashblock_refresh(q, kc, vc, kn, vn, cache_seqlens=lens)
    out["flashblock refresh"] = (
        lambda: op.flashblock_refresh(q, kc, vc, kn, vn, lens, None, None), False)
    out["flashblock reuse"] = (
        lambda: op.flashblock_attn(q, kn, vn, ext_out, ext_lse, None, None, None), False)
    return out


def _sdpa(F, sdpa_kernel, backend, q, k, v, gqa):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)


def _check(case: DecodeCase, fns: dict) -> None:
    """Every contender computes the same attention (a wrong kernel must not look fast)."""
    ref = fns["dlm_ops"][0]()[0].float()
    for name, (fn, _) in fns.items():
        if name.startswith("sdpa"):
            got = fn().transpose(1, 2).float()
            err = (got - ref).abs().max().item()
            assert err < 2e-2, f"{case.label}: {name} differs from dlm_ops by {err:.3g}"


def _graphed(fn):
    """fn captured in a CUDA graph (after two warm-up calls on a side stream); returns replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench(case: DecodeCase, rounds: int, iters: int, modes: list[str]) -> list[dict]:
    from .__main__ import _time_once, shuffled_rounds

    fns = _contenders(case)
    _check(case, fns)
    runs = {}  # (name, mode) -> callable
    for name, (fn, _) in fns.items():
        _time_once(None, fn, 3)  # warm-up: compilation, allocator
        if "eager" in modes:
            runs[(name, "eager")] = fn
        if "graph" in modes:
            try:
                runs[(name, "graph")] = _graphed(fn)
            except Exception as e:
                print(f"  {name}: no graph mode ({type(e).__name__}: {str(e)[:100]})", flush=True)
    times = shuffled_rounds(list(runs), rounds, lambda key: _time_once(None, runs[key], iters))
    rows = []
    for (name, mode), ts in times.items():
        ms = statistics.median(ts)
        rows.append(dict(asdict(case), case=case.label, contender=name, mode=mode, ms=ms,
                         expanded=fns[name][1], gb_per_s=case.kv_bytes() / ms / 1e6))
    return rows


def main(argv=None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU")
        return 1
    meta = run_meta(dtype="bfloat16")
    rows = []
    for case in cases(a.preset):
        print(case.label, flush=True)
        try:
            rows += [dict(meta, **r) for r in bench(case, a.rounds, a.iters,
                                                    a.modes.split(","))]
        except torch.cuda.OutOfMemoryError as e:
            print(f"  skipped: {e}", flush=True)
        torch.cuda.empty_cache()
    write_results(a.out, a.tag, rows, meta,
                  f"bf16, H={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}; median of {a.rounds} interleaved "
                  f"rounds of {a.iters} calls; microseconds per call (graph: CUDA-graph replays).",
                  markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
