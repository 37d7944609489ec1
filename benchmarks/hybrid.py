"""``python -m benchmarks.hybrid --out DIR``: block-hybrid (LLaDA-Hybrid) attention against full
softmax attention over the prefix, on one GPU (issue #6 item 6).

Decode step (bf16, D=128, F=64, active block bs=32, prefix of P committed tokens): the hybrid step
is ``block_hybrid_attn`` (the block against the (S, Z) state, whose size does not depend on P)
plus ``hybrid_state_update`` amortised over the ``--steps-per-block`` denoising steps of a block;
the contenders are SDPA over [prefix; block] (q = the block, no mask), per SDPA backend that
accepts the call (flash, cuDNN, memory-efficient). GQA goes to SDPA with ``enable_gqa=True``, or
with K/V expanded to H heads beforehand (untimed, marked "kv expanded") where a backend refuses.
Both sides are timed eagerly and replayed from CUDA graphs ("graph": launch overhead removed, as a
sampler under torch.compile(mode="reduce-overhead") would see it).

Training (fwd + bwd): ``block_hybrid_train_attn`` on [noisy | clean] of 2n tokens against SDPA
causal attention on 2n tokens, a yardstick of the same length (16K tokens per batch). "hybrid
train" is the default backend (the fused Triton kernels where they accept the shape), "hybrid
train torch" the block-batched PyTorch path forced, for the A/B.

All contenders of a case are timed in interleaved rounds in this process (DESIGN.md section 5);
the report is medians and ratios (SDPA ms / hybrid ms: > 1 means hybrid is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

from .__main__ import run_meta, write_results
import torch.nn.functional as F

TOKENS = 16 * 1024  # training tokens per batch, as in DESIGN.md section 5
SDPA_BACKENDS = ("flash", "cudnn", "efficient")
DEVICE = "cuda"


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    prefix: int
    heads: int
    kv_heads: int
    head_dim: int = 128
    block: int = 32
    features: int = 64

    @property
    def label(self) -> str:
        return (f"decode B={self.batch} P={self.prefix} H={self.heads}/{self.kv_heads} "
                f"D={self.head_dim} bs={self.block} F={self.features}")


@dataclass(frozen=True)
class TrainCase:
    batch: int
    n: int
    heads: int
    kv_heads: int
    head_dim: int = 128
    block_size: int = 32
    features: int = 64

    @property
    def label(self) -> str:
        return (f"train B={self.batch} 2n={2 * self.n} H={self.heads}/{self.kv_heads} "
                f"D={self.head_dim} bs={self.block_size} F={self.features}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _heads(text: str) -> list[tuple[int, int]]:
    return [tuple(int(y) for y in x.split("/")) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hybrid", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="h200_hybrid", help="file name stem of the results")
    p.add_argument("--batches", default="1,16", help="decode batch sizes")
    p.add_argument("--prefixes", default="1024,4096,16384,32768", help="decode prefix lengths")
    p.add_argument("--heads", default="32/8,16/16", help="H/Hkv pairs")
    p.add_argument("--block", type=int, default=32, help="active block size")
    p.add_argument("--features", type=int, default=64, help="F (phi has 2F features)")
    p.add_argument("--steps-per-block", type=int, default=8,
                   help="denoising steps per block: the state update is amortised over them")
    p.add_argument("--train-n", default="1024,4096", help="tokens per half of the training cases")
    p.add_argument("--train-blocks", default="", help="block sizes of the training cases "
                   "(default: --block)")
    p.add_argument("--no-decode", action="store_true", help="time the training cases only")
    p.add_argument("--no-torch-train", action="store_true",
                   help="skip the forced torch backend in the training cases")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replays")
    a = p.parse_args(argv)
    a.batches, a.prefixes, a.train_n = _ints(a.batches), _ints(a.prefixes), _ints(a.train_n)
    a.train_blocks = _ints(a.train_blocks) or [a.block]
    a.heads = _heads(a.heads)
    return a


def decode_cases(a: argparse.Namespace) -> list[DecodeCase]:
    return [DecodeCase(b, p, h, hkv, block=a.block, features=a.features)
            for h, hkv in a.heads for b in a.batches for p in a.prefixes]


def train_cases(a: argparse.Namespace) -> list[TrainCase]:
    return [TrainCase(max(1, TOKENS // (2 * n)), n, h, hkv, block_size=bs, features=a.features)
            for h, hkv in a.heads for n in a.train_n for bs in a.train_blocks]


# -- GPU side ---------------------------------------------------------------------------------


def _sdpa_call(backend: str, q, k, v, causal: bool):
    """A callable running SDPA on one backend, GQA native if the backend takes it, else with K/V
    expanded (untimed); returns (name suffix, callable) or raises if the backend refuses."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    group = q.shape[1] // k.shape[1]

    def make(kk, vv, gqa):
        def run():
            with sdpa_kernel([which]):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=gqa)
        return run

    attempts = [("", make(k, v, group > 1))]
    if group > 1:
        ke, ve = (t.repeat_interleave(group, dim=1) for t in (k, v))
        attempts.append((" (kv expanded)", make(ke, ve, False)))
    err = None
    for suffix, run in attempts:
        try:
            run()
            torch.cuda.synchronize()
            return suffix, run
        except RuntimeError as e:
            err = e
    raise err


def _graphed(fn):
    """Capture ``fn`` (one call) in a CUDA graph; replaying it removes Python and launch costs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up on a side stream, as torch.cuda.graphs asks
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _decode_contenders(c: DecodeCase, graph: bool) -> dict:
    import dlm_ops

    dt, dev = torch.bfloat16, DEVICE
    b, h, hkv, d, bs, f = c.batch, c.heads, c.kv_heads, c.head_dim, c.block, c.features
    q = torch.randn(b, bs, h, d, device=dev, dtype=dt)
    k, v = (torch.randn(b, bs, hkv, d, device=dev, dtype=dt) for _ in range(2))
    w = torch.randn(h, d, f, device=dev) * d ** -0.5
    gate = torch.zeros(h, device=dev)
    # A state of P committed tokens: S is a sum of P rank-one terms, Z of P feature vectors summing
    # to 2 each; magnitudes do not change the time, only the shape does.
    s = torch.randn(b, h, 2 * f, d, device=dev) * c.prefix ** 0.5
    z = torch.full((b, h, 2 * f), c.prefix / f, device=dev)
    fns = {
        "hybrid attn": lambda: dlm_ops.block_hybrid_attn(q, k, v, s, z, w, gate),
        "hybrid update": lambda: dlm_ops.hybrid_state_update(s, z, k, v, w),
    }
    # SDPA layout (B, H, S, D): q is the block, keys/values the prefix followed by the block.
    qs = q.transpose(1, 2).contiguous()
    ks, vs = (torch.randn(b, hkv, c.prefix + bs, d, device=dev, dtype=dt) for _ in range(2))
    for name in SDPA_BACKENDS:
        try:
            suffix, run = _sdpa_call(name, qs, ks, vs, causal=False)
            fns[f"sdpa {name}{suffix}"] = run
        except RuntimeError as e:
            print(f"  sdpa {name}: refused ({str(e).splitlines()[0][:100]})", flush=True)
    modes = {"eager": fns}
    if graph:
        modes["graph"] = {}
        for name, fn in fns.items():
            try:
                modes["graph"][name] = _graphed(fn)
            except Exception as e:  # reported, not fatal: the eager row still stands
                print(f"  {name}: no CUDA graph ({type(e).__name__}: {str(e)[:100]})", flush=True)
    return modes


def _train_contenders(c: TrainCase, with_torch: bool = True) -> dict:
    import dlm_ops

    dt, dev = torch.bfloat16, DEVICE
    b, s, h, hkv, d, f = c.batch, 2 * c.n, c.heads, c.kv_heads, c.head_dim, c.features
    q = torch.randn(b, s, h, d, device=dev, dtype=dt, requires_grad=True)
    k, v = (torch.randn(b, s, hkv, d, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
    w = (torch.randn(h, d, f, device=dev) * d ** -0.5).requires_grad_()
    gate = torch.zeros(h, device=dev, requires_grad=True)
    dout = torch.randn(b, s, h, d, device=dev, dtype=dt)

    def hybrid_step(backend=None):
        out = dlm_ops.block_hybrid_train_attn(q, k, v, w, gate, c.block_size, backend=backend)
        return torch.autograd.grad(out, (q, k, v, w, gate), dout)

    fns = {"hybrid train": hybrid_step}
    if with_torch:
        fns["hybrid train torch"] = lambda: hybrid_step("torch")
    qs, ks, vs = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    douts = dout.transpose(1, 2).contiguous()
    for name in ("flash", "cudnn"):
        try:
            suffix, run = _sdpa_call(name, qs, ks, vs, causal=True)
        except RuntimeError as e:
            print(f"  sdpa {name}: refused ({str(e).splitlines()[0][:100]})", flush=True)
            continue

        def step(run=run):
            out = run()
            return torch.autograd.grad(out, (qs, ks, vs), douts)

        step()
        fns[f"sdpa {name} causal{suffix}"] = step
    return {"fwd+bwd": fns}


def _interleaved(modes: dict, rounds: int) -> dict:
    """{mode: {name: median ms}}, every (mode, name) timed once per round, in turn."""
    from .__main__ import _calls_per_measurement, _time_once, shuffled_rounds

    for fns in modes.values():
        for fn in fns.values():
            _time_once(None, fn, 2)  # warm-up: compilation, allocator
    calls = {(m, n): _calls_per_measurement(None, fn)
             for m, fns in modes.items() for n, fn in fns.items()}
    times = shuffled_rounds([(m, n) for m, fns in modes.items() for n in fns], rounds,
                            lambda key: _time_once(None, modes[key[0]][key[1]], calls[key]))
    return {m: {n: statistics.median(times[(m, n)]) for n in fns} for m, fns in modes.items()}


def decode_rows(case: DecodeCase, ms: dict, steps_per_block: int) -> list[dict]:
    """One row per (mode, contender), plus the amortised hybrid step and the ratios."""
    rows = []
    for mode, by_name in ms.items():
        step = None
        if "hybrid attn" in by_name and "hybrid update" in by_name:
            step = by_name["hybrid attn"] + by_name["hybrid update"] / steps_per_block
        entries = dict(by_name, **({"hybrid step": step} if step is not None else {}))
        for name, t in entries.items():
            rows.append(dict(asdict(case), kind="decode", case=case.label, mode=mode,
                             contender=name, ms=t, steps_per_block=steps_per_block,
                             ratio_sdpa_over_hybrid=(t / step if step and name.startswith("sdpa")
                                                     else None)))
    return rows


def train_rows(case: TrainCase, ms: dict) -> list[dict]:
    rows = []
    for mode, by_name in ms.items():
        ours = by_name.get("hybrid train")
        for name, t in by_name.items():  # every other contender over the default hybrid path
            ratio = t / ours if ours and name != "hybrid train" else None
            rows.append(dict(asdict(case), kind="train", case=case.label, mode=mode, contender=name,
                             ms=t, ratio_sdpa_over_hybrid=ratio))
    return rows


def markdown(rows: list[dict]) -> str:
    """One line per (case, mode): every contender's ms, then SDPA / hybrid for each SDPA row."""
    out = []
    for kind, ours in (("decode", "hybrid step"), ("train", "hybrid train")):
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        names = list(dict.fromkeys(r["contender"] for r in sel))
        sdpa = [n for n in names if n.startswith("sdpa") or n == "hybrid train torch"]
        head = ["case", "mode", *[f"{n} ms" for n in names], *[f"{n} / {ours}" for n in sdpa]]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for case in dict.fromkeys(r["case"] for r in sel):
            for mode in dict.fromkeys(r["mode"] for r in sel):
                cell = {r["contender"]: r for r in sel if r["case"] == case and r["mode"] == mode}
                if not cell:
                    continue
                ms = [f"{cell[n]['ms']:.3f}" if n in cell else "-" for n in names]
                ratio = [f"{cell[n]['ratio_sdpa_over_hybrid']:.2f}"
                         if n in cell and cell[n]["ratio_sdpa_over_hybrid"] else "-" for n in sdpa]
                out.append("| " + " | ".join([case, mode, *ms, *ratio]) + " |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU")
        return 1
    meta = run_meta()
    torch.manual_seed(0)
    rows = []
    for case in [] if a.no_decode else decode_cases(a):
        print(case.label, flush=True)
        ms = _interleaved(_decode_contenders(case, graph=not a.no_graph), a.rounds)
        rows += [dict(meta, **r) for r in decode_rows(case, ms, a.steps_per_block)]
        torch.cuda.empty_cache()
    for case in train_cases(a):
        print(case.label, flush=True)
        try:
            ms = _interleaved(_train_contenders(case, not a.no_torch_train), a.rounds)
        except torch.cuda.OutOfMemoryError as e:
            print(f"  skipped: {str(e)[:120]}", flush=True)
            continue
        rows += [dict(meta, **r) for r in train_rows(case, ms)]
        torch.cuda.empty_cache()
    write_results(a.out, a.tag, rows, meta,
                  f"bf16; median of {a.rounds} interleaved rounds; hybrid step = attn + update / "
                  f"{a.steps_per_block} steps per block; ratios are SDPA ms / hybrid ms (> 1: hybrid "
                  f"faster).", markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
