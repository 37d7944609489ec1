"""``python -m benchmarks.sparse_quality --out DIR [--device cpu|cuda]``: how well each selector
approximates full attention at equal density, and (on a GPU) what selection costs.

Quality. Model weights cannot be downloaded here, so the inputs are synthetic attention with
planted structure (``planted_qkv``): queries and keys share a few cluster directions, key blocks
are "smooth" (every key a moderate match) or "spiky" (a few keys a strong match, the rest
noise), and a few sink columns every query attends to. For each selector at densities 10-50% the
relative output error ||O_sparse - O_full|| / ||O_full|| (fp32, dense attention restricted to
the pattern, so this measures the pattern and not a kernel) and the attention mass the pattern
keeps. Contenders: SparseD (pooled mass, isolated prompt/generation selection), BA-Att with plain
mean pooling, BA-Att corrected (diagonal-variance term), BA-Att corrected + norm-sorted outlier
keys, PulseCol (columns; sampled query rows), random blocks.

Cost (CUDA only). Selection time for S = 16K and 32K (bf16, D=128, GQA 32/8, block 64), cuDNN
SDPA time for the same shape measured in the same rounds, and the selection cost amortised over
64/256/1024 steps as a fraction of one dense attention: sel_ms / (steps x sdpa_ms).

Results: DIR/sparse_quality_<device>.json (rows) and .md (tables, printed last).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from .__main__ import run_meta

from dlm_ops.sparsity import ba_att_select, pulsecol_select, sparsed_select
from dlm_ops.sparsity.tables import indices_to_block_table, indices_to_column_mask, mask_to_indices

DENSITIES = (0.1, 0.2, 0.3, 0.5)


def planted_qkv(batch=1, seqlen=1024, heads=8, kv_heads=8, head_dim=64, block=32, clusters=8,
                sinks=4, support=4, local_logit=6.0, seed=0, device="cpu"):
    """q, k (B, S, H / Hkv, D) fp32 with planted cluster / block / sink structure, v Gaussian.

    Cluster directions u_c live on ``support`` of the D coordinates (trained models concentrate
    q/k energy in a few channels; the diagonal BA-Att correction sees spread along coordinates
    only, ~support/D of it for dense random directions). Each key block draws a cluster c and a
    type: smooth, keys (m_J + tau_J eps) u_c with its own mean m_J ~ U(0, 1.5) and spread
    tau_J ~ U(0, 1.5), or spiky, 2 keys 2 m_J u_c and the rest noise. ``sinks`` random keys carry
    a shared sink direction that every query also holds. Each query block draws a cluster
    (local topics). A rotary-style positional code adds up to ``local_logit`` to nearby pairs.
    Amplitudes put logits in O(5): peaked, not one-hot, as in trained models.
    """
    gen = torch.Generator().manual_seed(seed)
    d, s, nb = head_dim, seqlen, math.ceil(seqlen / block)
    amp = 2.5 * d ** 0.25  # scale * amp^2 = 6.25: the logit of a unit match
    u = torch.zeros(batch, kv_heads, clusters + 1, d)
    coords = torch.rand(batch, kv_heads, clusters + 1, d, generator=gen).argsort(-1)[..., :support]
    signs = torch.randint(0, 2, coords.shape, generator=gen) * 2.0 - 1.0
    u.scatter_(-1, coords, signs / math.sqrt(support))
    sink_dir = u[:, :, clusters]

    def per_token(x):  # (B, Hkv, nb, ...) -> (B, Hkv, S, ...)
        return x.repeat_interleave(block, 2)[:, :, :s]

    def rand(*shape):
        return torch.rand(*shape, generator=gen)

    kc = torch.randint(0, clusters, (batch, kv_heads, nb), generator=gen)
    m, tau = 1.5 * rand(batch, kv_heads, nb), 1.5 * rand(batch, kv_heads, nb)
    spiky = per_token(rand(batch, kv_heads, nb) < 0.5)
    spike = (rand(batch, kv_heads, nb, block).argsort(-1) < 2).view(batch, kv_heads, -1)[..., :s]
    eps = torch.randn(batch, kv_heads, s, generator=gen)
    coef = torch.where(spiky, spike * 2.0 * per_token(m), per_token(m) + per_token(tau) * eps)
    dirs = torch.gather(u, 2, per_token(kc)[..., None].expand(-1, -1, -1, d))
    k = amp * (coef[..., None] * dirs + 0.15 * torch.randn(batch, kv_heads, s, d, generator=gen))
    k[:, :, torch.randperm(s, generator=gen)[:sinks]] += 1.5 * amp * sink_dir[:, :, None]

    g = heads // kv_heads
    u_h, sink_h = u.repeat_interleave(g, 1), sink_dir.repeat_interleave(g, 1)
    qc = torch.randint(0, clusters, (batch, heads, nb), generator=gen)
    q_dirs = torch.gather(u_h, 2, per_token(qc)[..., None].expand(-1, -1, -1, d))
    q = amp * (q_dirs + 0.5 * sink_h[:, :, None]
               + 0.15 * torch.randn(batch, heads, s, d, generator=gen))
    # Locality (what columns cannot express): 4 rotary-style frequencies on the last 8
    # coordinates, periods 1, 2, 4, 8 blocks; q_i.k_j gains local_logit * mean_f cos(w_f (i - j))
    # / scale, so nearby key blocks win (every query row, not the same columns for all).
    pos = torch.arange(s, dtype=torch.float32)
    w = 2 * math.pi / (block * 2.0 ** torch.arange(4))
    ang = pos[:, None] * w[None, :]
    code = torch.stack([ang.cos(), ang.sin()], -1).reshape(s, 8)
    a_p = math.sqrt(local_logit * math.sqrt(d) / 4)
    q[..., -8:] += a_p * code
    k[..., -8:] += a_p * code
    v = torch.randn(batch, kv_heads, s, d, generator=gen)
    return tuple(t.transpose(1, 2).contiguous().to(device) for t in (q, k, v))


def expand_blocks(table: torch.Tensor, block: int, seqlen: int) -> torch.Tensor:
    """Boolean (B, H, nQb, nKb) -> (B, H, S, S) token mask."""
    return table.repeat_interleave(block, 2)[:, :, :seqlen].repeat_interleave(block, 3)[..., :seqlen]


def dense(q, k, v, mask=None):
    """fp32 attention (B, S, H, D) under an optional (B, H, S, S) mask; also the probabilities."""
    g = q.shape[2] // k.shape[2]
    kf, vf = (t.repeat_interleave(g, 2).transpose(1, 2).float() for t in (k, v))
    s = (q.transpose(1, 2).float() @ kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1)
    return (p @ vf).transpose(1, 2), p


def selectors(block: int, prompt_len: int):
    """name -> (kind, fn(q, k, density) -> pattern); equal densities by construction."""
    def blocks(fn):
        return ("block", fn)

    def rho_for(density, nkb):  # k = int(nkb * rho) + 1 blocks == round(density * nkb)
        return max(0.0, (max(1, round(density * nkb)) - 1) / nkb + 1e-9)

    def sparsed(q, k, dens):
        nkb = math.ceil(k.shape[1] / block)
        return sparsed_select(q, k, block_size_q=block, block_size_k=block, rho=rho_for(dens, nkb),
                              prompt_len=None)

    def sparsed_isolated(q, k, dens):
        # Isolation keeps >= 1 block per part, so rho is set on the whole: k_p + k_g ~ density.
        nkb = math.ceil(k.shape[1] / block)
        return sparsed_select(q, k, block_size_q=block, block_size_k=block,
                              rho=rho_for(dens, nkb), prompt_len=prompt_len)

    def ba(method, outliers):
        def fn(q, k, dens):
            nkb = math.ceil(k.shape[1] / block)
            return ba_att_select(q, k, block_size_q=block, block_size_k=block,
                                 rho=rho_for(dens, nkb), method=method, outliers=outliers)
        return fn

    def pulsecol(q, k, dens):
        return pulsecol_select(q, k, keep=dens, sample_rows=max(1, q.shape[1] // 8))

    def random_blocks(q, k, dens):
        b, h = q.shape[0], q.shape[2]
        nqb, nkb = math.ceil(q.shape[1] / block), math.ceil(k.shape[1] / block)
        gen = torch.Generator().manual_seed(1)
        r = torch.rand(b, h, nqb, nkb, generator=gen).argsort(-1) < max(1, round(dens * nkb))
        return mask_to_indices(r.to(q.device))

    return {
        "sparsed": blocks(sparsed),
        "sparsed isolated": blocks(sparsed_isolated),
        "ba-att mean": blocks(ba("mean", 0)),
        "ba-att corrected": blocks(ba("corrected", 0)),
        "ba-att corrected+outlier": blocks(ba("corrected", 1)),
        "pulsecol": ("column", pulsecol),
        "random": blocks(random_blocks),
    }


def quality_rows(seqlen=1024, heads=8, kv_heads=8, head_dim=64, block=32, seeds=(0, 1),
                 device="cpu") -> list[dict]:
    rows = []
    for seed in seeds:
        q, k, v = planted_qkv(1, seqlen, heads, kv_heads, head_dim, block, seed=seed, device=device)
        full, p = dense(q, k, v)
        nkb = math.ceil(seqlen / block)
        for name, (kind, fn) in selectors(block, prompt_len=seqlen // 2).items():
            for dens in DENSITIES:
                idx, cnt = fn(q, k, dens)
                if kind == "block":
                    mask = expand_blocks(indices_to_block_table(idx, cnt, nkb), block, seqlen)
                else:
                    mask = indices_to_column_mask(idx, cnt, seqlen)[:, :, None, :].expand(
                        -1, -1, seqlen, -1)
                out, _ = dense(q, k, v, mask)
                err = ((out - full).norm() / full.norm()).item()
                rows.append(dict(selector=name, density_target=dens, seed=seed,
                                 density=mask.float().mean().item(), rel_error=err,
                                 mass_kept=(p * mask).sum(-1).mean().item(), seqlen=seqlen,
                                 block=block, heads=heads, head_dim=head_dim))
    return rows


def summarize(rows: list[dict]) -> str:
    names = list(dict.fromkeys(r["selector"] for r in rows))
    head = ["density"] + [f"{n} err (mass)" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dens in DENSITIES:
        cells = [f"{dens:.0%}"]
        for n in names:
            sel = [r for r in rows if r["selector"] == n and r["density_target"] == dens]
            err = statistics.mean(r["rel_error"] for r in sel)
            mass = statistics.mean(r["mass_kept"] for r in sel)
            real = statistics.mean(r["density"] for r in sel)
            cells.append(f"{err:.3f} ({mass:.2f}; d={real:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


COST_SEQLENS = (16384, 32768)
AMORTISE_STEPS = (64, 256, 1024)


def cost_rows(rounds=5) -> list[dict]:
    """GPU: selection ms vs cuDNN SDPA ms, interleaved in rounds in this process."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .__main__ import _time_once

    rows = []
    for s in COST_SEQLENS:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, s, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(1, s, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def sdpa():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        contenders = {
            "sdpa cudnn": sdpa,
            "sparsed select (triton)": lambda: sparsed_select(
                q, k, block_size_q=64, block_size_k=64, rho=0.3, prompt_len=s // 2),
            "sparsed select (torch chunked)": lambda: sparsed_select(
                q, k, block_size_q=64, block_size_k=64, rho=0.3, prompt_len=s // 2, backend="torch"),
            "ba-att select": lambda: ba_att_select(q, k, block_size_q=64, block_size_k=64, rho=0.3),
            "pulsecol select (triton, S/8 rows)": lambda: pulsecol_select(
                q, k, keep=0.3, sample_rows=s // 8),
            "pulsecol select (torch chunked, S/8 rows)": lambda: pulsecol_select(
                q, k, keep=0.3, sample_rows=s // 8, backend="torch"),
        }
        for fn in contenders.values():
            _time_once(None, fn, 1)
        times = {n: [] for n in contenders}
        for _ in range(rounds):
            for n, fn in contenders.items():
                times[n].append(_time_once(None, fn, 1))
        base = statistics.median(times["sdpa cudnn"])
        for n, ts in times.items():
            ms = statistics.median(ts)
            row = dict(seqlen=s, contender=n, ms=ms, ratio_vs_sdpa=ms / base)
            row.update({f"amortised_{n_steps}": ms / (n_steps * base) for n_steps in AMORTISE_STEPS})
            rows.append(row)
        del q, k, v, qt, kt, vt
        torch.cuda.empty_cache()
    return rows


def cost_table(rows: list[dict]) -> str:
    head = ["S", "contender", "ms", "x sdpa"] + [f"/ {n} steps of sdpa" for n in AMORTISE_STEPS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([str(r["seqlen"]), r["contender"], f"{r['ms']:.2f}",
                                        f"{r['ratio_vs_sdpa']:.2f}",
                                        *[f"{r[f'amortised_{n}']:.4f}" for n in AMORTISE_STEPS]]) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Relative error against density, one line per selector (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (pip install -e '.[bench]')")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["selector"] for r in rows):
        pts = [(d, statistics.mean(r["rel_error"] for r in rows
                                   if r["selector"] == name and r["density_target"] == d))
               for d in DENSITIES]
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xlabel("density (target)")
    ax.set_ylabel("relative output error vs full attention")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse_quality",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cpu", "cuda"])
    p.add_argument("--seqlen", type=int, default=None, help="quality S (default 1024 cpu, 4096 cuda)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="timing rounds (cuda)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    seqlen = a.seqlen or (4096 if a.device == "cuda" else 1024)
    meta = run_meta()
    meta["device"] = meta.pop("gpu") if a.device == "cuda" else "cpu"
    rows = [dict(meta, kind="quality", **r) for r in quality_rows(
        seqlen, a.heads, a.heads, 64, a.block, tuple(range(a.seeds)), a.device)]
    text = (f"{meta['device']}, torch {meta['torch']}, commit {meta['commit']}. Planted structure, "
            f"S={seqlen}, H={a.heads}, D=64, block {a.block}, {a.seeds} seeds. Cell: relative "
            f"output error vs full attention (mean attention mass kept; real density).\n\n"
            + summarize([r for r in rows if r["kind"] == "quality"]))
    if a.device == "cuda":
        cost = [dict(meta, kind="cost", **r) for r in cost_rows(a.rounds)]
        rows += cost
        text += ("\n\nSelection cost, bf16 D=128 GQA 32/8 block 64, median of "
                 f"{a.rounds} interleaved rounds:\n\n" + cost_table(cost))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"sparse_quality_{a.device}.json").write_text(json.dumps(rows, indent=1))
    (out / f"sparse_quality_{a.device}.md").write_text(text + "\n")
    plot([r for r in rows if r["kind"] == "quality"], out / f"sparse_quality_{a.device}.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
