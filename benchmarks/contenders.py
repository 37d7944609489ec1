"""What we time: our op per backend and the yardsticks of DESIGN.md section 5.

Each contender builds its own inputs in its native layout (so no transpose is timed) and returns
callables for the three modes: ``fwd`` (no autograd), ``bwd`` (backward of a retained graph) and
``step`` (forward + backward). All contenders of a case compute attention of the same shape; the
"causal on halves" yardsticks do the same work as block diffusion (n^2 + n*bs pairs per sample ~
two causal halves of n), which is why they are the yardstick.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import dlm_ops
from dlm_ops.geometry import SequenceMask, VarlenMask
from dlm_ops.reference import block_diffusion_mask


# FLOPs of each mode as a multiple of the forward's (DESIGN.md section 5: bwd = 2.5x).
MODE_FLOPS = {"fwd": 1.0, "bwd": 2.5, "step": 3.5}


@dataclass(frozen=True)
class Case:
    batch: int
    n: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def label(self) -> str:
        gqa = f"/{self.kv_heads}" if self.kv_heads != self.heads else ""
        return (f"B={self.batch} n={self.n} H={self.heads}{gqa} D={self.head_dim} "
                f"bs={self.block_size}")

    def flops(self, mode: str) -> float:
        """Visible pairs only: fwd = 4 * pairs * D * H per sample, bwd = 2.5x, step = 3.5x."""
        pairs = SequenceMask.block_diffusion(2 * self.n, self.block_size).num_pairs
        fwd = 4.0 * pairs * self.head_dim * self.heads * self.batch
        return fwd * MODE_FLOPS[mode]


def _rand(*shape, dtype, grad=True):
    return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(grad)


def _modes(run, inputs):
    """fwd / bwd / step callables around ``run(*inputs) -> out``."""
    state = {}

    def fwd():
        with torch.no_grad():
            return run(*inputs)

    def bwd_setup():
        out = run(*inputs)
        state["out"], state["dout"] = out, torch.randn_like(out)

    def bwd():
        torch.autograd.grad(state["out"], inputs, state["dout"], retain_graph=True)

    def step():
        out = run(*inputs)
        torch.autograd.grad(out, inputs, torch.ones_like(out))

    return {"fwd": (None, fwd), "bwd": (bwd_setup, bwd), "step": (None, step)}


def ours(case: Case, backend: str | None = None):
    s, d = 2 * case.n, case.head_dim
    q = _rand(case.batch, s, case.heads, d, dtype=case.dtype)
    k, v = (_rand(case.batch, s, case.kv_heads, d, dtype=case.dtype) for _ in range(2))
    return _modes(lambda q, k, v: dlm_ops.diffusion_attn_func(q, k, v, case.block_size,
                                                              backend=backend), (q, k, v))


@contextlib.contextmanager
def cutlass_switch(name: str, value: bool):
    """Within: the cutlass backend's switch ``cutlass_diffusion.<name>`` set to ``value``."""
    from dlm_ops.backends import cutlass_diffusion

    before = getattr(cutlass_diffusion, name)
    setattr(cutlass_diffusion, name, value)
    try:
        yield
    finally:
        setattr(cutlass_diffusion, name, before)


def python_node_backward():
    """Within: the backward as the Python autograd node (cutlass_diffusion.NATIVE_BACKWARD off),
    as before session 36."""
    return cutlass_switch("NATIVE_BACKWARD", False)


def switched(modes, name: str, value: bool):
    """``modes`` (a contender's) run with ``cutlass_diffusion.<name>`` = ``value``: that switch's
    A/B in one process, against the same contender as shipped."""
    def within(f):
        if f is None:
            return None

        def g():
            with cutlass_switch(name, value):
                return f()
        return g

    return {mode: (within(setup), within(fn)) for mode, (setup, fn) in modes.items()}


def python_node(modes):
    """``modes`` (a contender's) run with the Python autograd node: the C++ node's A/B."""
    return switched(modes, "NATIVE_BACKWARD", False)


def dq_snake(modes):
    """``modes`` (a contender's) with the dS backward's dQ kernel on the snake walk, as before
    session 47 (cutlass_diffusion.DQ_SCHEDULE off): its balanced schedule's A/B through torch."""
    return switched(modes, "DQ_SCHEDULE", False)


def switch_aa(modes):
    """``modes`` (a contender's) through the same switch machinery with every switch left as shipped
    (DQ_SCHEDULE set to its own value): the A/A arm of the switch contenders, a second instance
    with its own inputs. Session 48 (H100, main preset): a switched contender read 0.3-1.5 % faster
    on the backward and 2-3 % slower on the step than ``dlm_ops`` where its switch changes nothing
    (D = 64, which has no dS backward), so a switch's A/B is read against this arm, not against
    ``dlm_ops``."""
    from dlm_ops.backends import cutlass_diffusion

    return switched(modes, "DQ_SCHEDULE", cutlass_diffusion.DQ_SCHEDULE)


def causal_halves(case: Case, sdp_backend: SDPBackend):
    """SDPA causal over the 2B halves of n tokens (GQA expanded up front, not timed)."""
    shape = (2 * case.batch, case.heads, case.n, case.head_dim)
    q, k, v = (_rand(*shape, dtype=case.dtype) for _ in range(3))

    def run(q, k, v):
        with sdpa_kernel([sdp_backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return _modes(run, (q, k, v))


def sdpa_dense_mask(case: Case):
    shape_q = (case.batch, case.heads, 2 * case.n, case.head_dim)
    shape_kv = (case.batch, case.kv_heads, 2 * case.n, case.head_dim)
    q, k, v = _rand(*shape_q, dtype=case.dtype), _rand(*shape_kv, dtype=case.dtype), \
        _rand(*shape_kv, dtype=case.dtype)
    mask = block_diffusion_mask(2 * case.n, case.block_size, "cuda")
    gqa = case.kv_heads != case.heads
    return _modes(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                 enable_gqa=gqa), (q, k, v))


def flex(case: Case):
    """Compiled FlexAttention with the BD3 mask_mod (dlm_ops.masks, the same mask BD3-LM writes),
    with dlm_ops' flex rewrite switched off: this contender is flex itself.

    Dynamo caches compiled code per code object and guards on the mask_mod closure, so every case
    recompiles flex_attention; past the recompile limit it would silently run flex eagerly (a few
    TFLOPS, seen in a first run). A reset per case gives each case a fresh compile cache."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    dlm_ops.compile.disable()
    fn = torch.compile(flex_attention, dynamic=False)
    n, bs = case.n, case.block_size
    block_mask = create_block_mask(dlm_ops.masks.block_diffusion(n, bs), None, None, 2 * n, 2 * n,
                                   device="cuda")
    shape_q = (case.batch, case.heads, 2 * n, case.head_dim)
    shape_kv = (case.batch, case.kv_heads, 2 * n, case.head_dim)
    q, k, v = _rand(*shape_q, dtype=case.dtype), _rand(*shape_kv, dtype=case.dtype), \
        _rand(*shape_kv, dtype=case.dtype)
    gqa = case.kv_heads != case.heads
    return _modes(lambda q, k, v: fn(q, k, v, block_mask=block_mask, enable_gqa=gqa), (q, k, v))


@dataclass(frozen=True)
class ExactCase:
    """Exact attention, SDPA layout (B, H, S, D)."""

    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool
    dtype: torch.dtype = torch.bfloat16

    @property
    def label(self) -> str:
        kind = "causal" if self.causal else "full"
        return f"B={self.batch} H={self.heads} S={self.seqlen} D={self.head_dim} {kind}"

    def flops(self, mode: str) -> float:
        s = self.seqlen
        pairs = s * (s + 1) // 2 if self.causal else s * s
        fwd = 4.0 * pairs * self.head_dim * self.heads * self.batch
        return fwd * MODE_FLOPS[mode]


class _Deterministic:
    def __enter__(self):
        self.prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.prev)


def exact_ours(case: ExactCase):
    shape = (case.batch, case.heads, case.seqlen, case.head_dim)
    q, k, v = (_rand(*shape, dtype=case.dtype) for _ in range(3))
    return _modes(lambda q, k, v: dlm_ops.attention(q, k, v, is_causal=case.causal), (q, k, v))


def exact_sdpa(case: ExactCase, sdp_backend: SDPBackend, deterministic: bool):
    shape = (case.batch, case.heads, case.seqlen, case.head_dim)
    q, k, v = (_rand(*shape, dtype=case.dtype) for _ in range(3))

    def run(q, k, v):
        with sdpa_kernel([sdp_backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)

    modes = _modes(run, (q, k, v))
    if not deterministic:
        return modes

    def wrap(fn):
        def det():
            with _Deterministic():
                return fn()
        return det if fn else None

    return {m: (wrap(setup), wrap(fn)) for m, (setup, fn) in modes.items()}


@dataclass(frozen=True)
class VarlenCase:
    """Packed samples (varlen) of the given halves: sample i is 2 * halves[i] tokens."""

    name: str
    halves: tuple[int, ...]
    heads: int = 16
    kv_heads: int = 16
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def cu_seqlens(self) -> list[int]:
        cu = [0]
        for n in self.halves:
            cu.append(cu[-1] + 2 * n)
        return cu

    @property
    def n(self) -> int:  # the longest half (bench_case skips the dense-mask contender by it)
        return max(self.halves, default=0)

    @property
    def label(self) -> str:
        gqa = f"/{self.kv_heads}" if self.kv_heads != self.heads else ""
        return (f"varlen {self.name}: {len(self.halves)} samples, {self.cu_seqlens[-1]} tokens "
                f"H={self.heads}{gqa} D={self.head_dim} bs={self.block_size}")

    def flops(self, mode: str) -> float:
        pairs = VarlenMask(tuple(self.cu_seqlens), self.block_size).num_pairs
        return 4.0 * pairs * self.head_dim * self.heads * MODE_FLOPS[mode]


def ours_varlen(case: VarlenCase, backend: str | None = None):
    cu = case.cu_seqlens
    q = _rand(cu[-1], case.heads, case.head_dim, dtype=case.dtype)
    k, v = (_rand(cu[-1], case.kv_heads, case.head_dim, dtype=case.dtype) for _ in range(2))
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    return _modes(lambda q, k, v: dlm_ops.diffusion_attn_varlen_func(
        q, k, v, cu_t, 2 * case.n, case.block_size, backend=backend), (q, k, v))


def _batched(case: VarlenCase) -> Case:
    """The batched case doing a packing's work: only where every sample has the same half."""
    if len(set(case.halves)) != 1:
        raise ValueError("samples of different lengths have no batched counterpart")
    return Case(len(case.halves), case.halves[0], case.heads, case.kv_heads, case.head_dim,
                case.block_size, case.dtype)


# Packed samples: the backends against each other (ratio vs Triton's) and, where every sample has
# the same half, the batched op and cuDNN's causal halves on the same work (what packing costs).
VARLEN_CONTENDERS = {
    "dlm_ops": ours_varlen,
    "dlm_ops triton": lambda c: ours_varlen(c, "triton"),
    "dlm_ops cutlass": lambda c: ours_varlen(c, "cutlass"),
    "dlm_ops batched": lambda c: ours(_batched(c)),
    "dlm_ops python node": lambda c: python_node(ours_varlen(c)),
    "dlm_ops dq snake": lambda c: dq_snake(ours_varlen(c)),
    "dlm_ops switch a/a": lambda c: switch_aa(ours_varlen(c)),
    "cudnn causal halves": lambda c: causal_halves(_batched(c), SDPBackend.CUDNN_ATTENTION),
}

EXACT_CONTENDERS = {
    "dlm_ops": exact_ours,
    "sdpa cudnn": lambda c: exact_sdpa(c, SDPBackend.CUDNN_ATTENTION, False),
    "sdpa flash": lambda c: exact_sdpa(c, SDPBackend.FLASH_ATTENTION, False),
    "sdpa cudnn det": lambda c: exact_sdpa(c, SDPBackend.CUDNN_ATTENTION, True),
    "sdpa flash det": lambda c: exact_sdpa(c, SDPBackend.FLASH_ATTENTION, True),
}

CONTENDERS = {
    "dlm_ops": ours,
    # "dlm_ops" is the default dispatch (on sm90 the cutlass backend: the CUTLASS forward, and the
    # CUTLASS backward at D=64/128; Triton elsewhere); the other two force one backend.
    "dlm_ops triton": lambda c: ours(c, "triton"),
    "dlm_ops cutlass": lambda c: ours(c, "cutlass"),  # forced: both sm90 kernels where they cover
    "dlm_ops python node": lambda c: python_node(ours(c)),
    "dlm_ops dq snake": lambda c: dq_snake(ours(c)),
    "dlm_ops switch a/a": lambda c: switch_aa(ours(c)),
    "cudnn causal halves": lambda c: causal_halves(c, SDPBackend.CUDNN_ATTENTION),
    "flash causal halves": lambda c: causal_halves(c, SDPBackend.FLASH_ATTENTION),
    "flex BD3": flex,
    "sdpa dense mask": sdpa_dense_mask,
}
YARDSTICK = "cudnn causal halves"
