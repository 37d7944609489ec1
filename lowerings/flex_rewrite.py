"""torch.compile pass: flex_attention with a block-diffusion (or block-causal) mask -> dlm ops.

Where it runs. Inductor's ``pre_grad_custom_pass``: on the Dynamo graph, before AOT autograd. The
``flex_attention`` higher-order op is replaced by ``dlm::diffusion_attn_fwd`` (or
``dlm::block_causal_attn_fwd``), whose registered autograd then gives the backward, so one rewrite
covers training and inference.

When. Only when the call provably computes our op (never on a guess, since a wrong rewrite silently
changes a model):
  * identity score_mod, no captured tensors (score_mod or mask_mod buffers), max_scores unused;
  * q, k, v of one fixed sequence length S, a head dim and dtype our op takes, H % Hkv == 0. Under
    dynamic=True the batch may stay symbolic; flex's own check of the length against the BlockMask
    specialises S (a SymInt with a constant value), and a truly symbolic S is declined, since the
    mask was checked at one length only;
  * the mask_mod never reads its batch or head argument (checked on its graph), and what flex
    computes equals the geometry's BD3 mask (S even) or block-causal mask, for the block size read
    off the first row.

What flex computes is the BlockMask's tables together with the mask_mod: skipped tiles are never
visited, full tiles run without mask_mod, partial tiles call mask_mod per element. Dynamo keeps the
real value of every graph input on its placeholder, so the tables (graph inputs) are read at compile
time and checked tile by tile against the geometry: skipped tiles must hold no visible pair, full
tiles only visible pairs, and the mask_mod is evaluated only on the partial tiles. For a
block-diffusion mask those are the tiles crossing a block boundary, O(S) of them, so the
mask_mod's cost grows linearly with S (the geometry's per-tile pair counts cost S x S/128 integer
operations). Measured on two busy CPU cores: 0.4-1.1 s at S = 16K and 3.9 s at 32K, against 10.7 s
at 16K for evaluating every pair. The q-side (backward) tables must mirror the kv-side ones. The
result is cached per (mask graph code, S, tile sizes, table contents). Where the real tables are
not reachable the mask_mod itself is evaluated on every pair in row chunks (quadratic).
``stats()`` counts which check ran ("checked: partial tiles" / "checked: all pairs").

Trust. A BlockMask made by create_block_mask has tables derived from its mask_mod, so the tables
of a later call with the same mask_mod and length are the ones checked here. Tensors passed in a
later call are not re-read (they are run-time inputs; Dynamo does not guard on their values): a
hand-built BlockMask whose tables are swapped for others of the same shape, under the same
mask_mod, is not detected. That is why an all-visible mask_mod (the default of
BlockMask.from_kv_blocks, where the tables alone carry the sparsity) is always declined.

How. q, k, v (B, H, S, D) are passed as (B, S, H, D) views; out comes back transposed and made
contiguous (as flex returns it); lse is converted to the base-2 statistics the higher-order op
returns (flex multiplies by ln 2 afterwards) unless the FLASH backend was asked for.
"""

from __future__ import annotations

import hashlib
import logging
import math
import operator
import os
from collections import Counter
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

import dlm_ops.ops.diffusion  # noqa: F401  (registers torch.ops.dlm.*)
from dlm_ops.geometry import SequenceMask
from dlm_ops.ops.validation import DTYPES, MAX_HEAD_DIM

log = logging.getLogger("dlm_ops.compile")

_LOG2E = 1.0 / math.log(2.0)
_ROW_CHUNK = 512  # rows of the mask evaluated at once: 512 x S booleans
_TILE_CHUNK = 64  # partial tiles evaluated at once: 64 x 128 x 128 booleans
_STATE = {"enabled": os.environ.get("DLM_OPS_REWRITE_FLEX", "1") != "0"}
_STATS: Counter = Counter()
_CLASSIFIED: dict[tuple[str, int], tuple[str, int] | str] = {}


def enable() -> None:
    _STATE["enabled"] = True


def disable() -> None:
    """Leave every flex_attention call to flex (also: DLM_OPS_REWRITE_FLEX=0 in the environment)."""
    _STATE["enabled"] = False


def is_enabled() -> bool:
    return _STATE["enabled"]


def stats() -> dict[str, int]:
    """Counts since import: 'rewritten' (and per mask kind) and 'declined: <reason>' per reason."""
    return dict(_STATS)


def reset_stats() -> None:
    _STATS.clear()


# -- deciding ----------------------------------------------------------------------------------


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _is_identity_score_mod(gm: torch.fx.GraphModule) -> bool:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    ret = out.args[0]
    ret = ret[0] if isinstance(ret, (tuple, list)) and len(ret) == 1 else ret
    return ret is _placeholders(gm)[0]


def classify_mask(mask_mod, seqlen: int, key: str | None = None) -> tuple[str, int] | str:
    """("block_diffusion" | "block_causal", block_size) if ``mask_mod`` (b, h, q_idx, kv_idx) equals
    that mask on every pair of a length-``seqlen`` sequence, else the reason it does not."""
    cache_key = (key, seqlen) if key is not None else None
    if cache_key in _CLASSIFIED:
        return _CLASSIFIED[cache_key]
    result = _classify(mask_mod, seqlen)
    if cache_key is not None:
        _CLASSIFIED[cache_key] = result
    return result


def _eval_rows(mask_mod, r0: int, r1: int, seqlen: int) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.int32)
    q_idx = torch.arange(r0, r1, dtype=torch.int32)[:, None]
    kv_idx = torch.arange(seqlen, dtype=torch.int32)[None, :]
    with torch.no_grad():
        out = mask_mod(zero, zero, q_idx, kv_idx)
    return torch.as_tensor(out).to(torch.bool).expand(r1 - r0, seqlen)


def _classify(mask_mod, seqlen: int) -> tuple[str, int] | str:
    if seqlen < 1:
        return "empty sequence"
    try:
        first = _eval_rows(mask_mod, 0, 1, seqlen)[0]
    except Exception as e:  # a mask_mod we cannot evaluate on plain index tensors
        return f"mask_mod not evaluable ({type(e).__name__})"
    block = int(first.sum())
    if block < 1 or not bool(first[:block].all()):
        return "not a block-diffusion or block-causal mask"
    if block >= seqlen:
        # An all-visible mask_mod (e.g. the default of BlockMask.from_kv_blocks) leaves the sparsity
        # to the BlockMask's tables, which are run-time values: nothing to prove it against.
        return "mask_mod sees everything (the BlockMask tables decide)"
    cols = torch.arange(seqlen)
    for kind, mask in _candidates(seqlen, block):
        # Against the geometry every kernel runs from, so a match means our op computes this mask.
        if all(torch.equal(_eval_rows(mask_mod, r0, r1, seqlen), mask.visible(torch.arange(r0, r1), cols))
               for r0 in range(0, seqlen, _ROW_CHUNK) for r1 in [min(r0 + _ROW_CHUNK, seqlen)]):
            return kind, block
    return "not a block-diffusion or block-causal mask"


def _tile_states(num: torch.Tensor, idx: torch.Tensor, full_num: torch.Tensor,
                 full_idx: torch.Tensor, n_other: int) -> torch.Tensor | None:
    """Dense int8 (rows, n_other) from one (batch, head) slice of a BlockMask's tables: 0 = tile
    skipped, 1 = partial (mask_mod decides per element), 2 = full (no mask_mod). None when a tile is
    listed both ways (flex would visit it twice)."""
    states = torch.zeros((num.shape[0], n_other), dtype=torch.int8)
    for value, (n, ix) in ((1, (num, idx)), (2, (full_num, full_idx))):
        listed = torch.arange(ix.shape[-1])[None, :] < n[:, None].long()
        rows = torch.arange(ix.shape[0])[:, None].expand_as(ix)[listed]
        cols = ix[listed].long()
        if bool((states[rows, cols] != 0).any()):
            return None
        states[rows, cols] = value
    return states


def _eval_tiles(mask_mod, r0: torch.Tensor, c0: torch.Tensor, bm: int, bn: int, seqlen: int):
    """mask_mod on whole tiles (P, bm, bn) starting at rows r0 / cols c0 (positions past the
    sequence are clamped; callers ignore them)."""
    zero = torch.zeros((), dtype=torch.int32)
    q_idx = (r0[:, None] + torch.arange(bm)).clamp(max=seqlen - 1).to(torch.int32)[:, :, None]
    kv_idx = (c0[:, None] + torch.arange(bn)).clamp(max=seqlen - 1).to(torch.int32)[:, None, :]
    with torch.no_grad():
        out = mask_mod(zero, zero, q_idx, kv_idx)
    return torch.as_tensor(out).to(torch.bool).expand(len(r0), bm, bn)


def classify_mask_tiles(mask_mod, seqlen: int, tables: tuple[torch.Tensor, ...], bm: int, bn: int,
                        key: str | None = None) -> tuple[str, int] | str:
    """Like ``classify_mask`` for what flex runs with these BlockMask tables (kv_num_blocks,
    kv_indices, full_kv_num_blocks, full_kv_indices, then the q-side four; tiles bm x bn): skipped
    tiles must hold no visible pair, full tiles only visible pairs, and mask_mod is evaluated only
    on the partial tiles, so the cost grows linearly with S for block-diffusion masks."""
    tables = [t.detach().cpu().contiguous() for t in tables]
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in tables)).hexdigest()
    cache_key = (key, seqlen, bm, bn, digest) if key is not None else None
    if cache_key in _CLASSIFIED:
        return _CLASSIFIED[cache_key]
    result = _classify_tiles(mask_mod, seqlen, tables, bm, bn)
    if cache_key is not None:
        _CLASSIFIED[cache_key] = result
    return result


def _classify_tiles(mask_mod, seqlen, tables, bm, bn) -> tuple[str, int] | str:
    if seqlen < 1:
        return "empty sequence"
    if any(not bool((t == t[:1, :1]).all()) for t in tables):
        return "BlockMask tables differ per batch or head"
    kv, q = [t[0, 0] for t in tables[:4]], [t[0, 0] for t in tables[4:]]
    n_q, n_kv = -(-seqlen // bm), -(-seqlen // bn)
    if kv[0].shape[0] != n_q or q[0].shape[0] != n_kv:
        return "BlockMask built for another sequence length"
    states = _tile_states(*kv, n_kv)
    states_t = _tile_states(*q, n_q)
    if states is None or states_t is None:
        return "BlockMask lists a tile as both full and partial"
    if not torch.equal(states.T, states_t):
        return "BlockMask backward tables disagree with its forward tables"
    try:
        own_first = _eval_rows(mask_mod, 0, 1, seqlen)[0]
    except Exception as e:  # a mask_mod we cannot evaluate on plain index tensors
        return f"mask_mod not evaluable ({type(e).__name__})"
    if bool(own_first.all()):
        # An all-visible mask_mod (e.g. the default of BlockMask.from_kv_blocks) leaves the sparsity
        # to the tables alone; tables of the same shape can be swapped without a recompile.
        return "mask_mod sees everything (the BlockMask tables decide)"
    col_state = states[0].long().repeat_interleave(bn)[:seqlen]
    first = (col_state == 2) | ((col_state == 1) & own_first)  # what flex computes for row 0
    block = int(first.sum())
    if block < 1 or not bool(first[:block].all()) or block >= seqlen:
        return "not a block-diffusion or block-causal mask"
    partial = (states == 1).nonzero()
    area = ((torch.arange(n_q) * bm + bm).clamp(max=seqlen) - torch.arange(n_q) * bm)[:, None] * \
        ((torch.arange(n_kv) * bn + bn).clamp(max=seqlen) - torch.arange(n_kv) * bn)[None, :]
    for kind, mask in _candidates(seqlen, block):
        counts = mask.grid_counts(bm, bn)
        if bool((counts[states == 0] != 0).any()) or bool((counts != area)[states == 2].any()):
            continue
        if all(_partial_tiles_match(mask_mod, mask, partial[i:i + _TILE_CHUNK], bm, bn, seqlen)
               for i in range(0, len(partial), _TILE_CHUNK)):
            return kind, block
    return "not a block-diffusion or block-causal mask"


def _partial_tiles_match(mask_mod, mask: SequenceMask, tiles: torch.Tensor, bm, bn, seqlen) -> bool:
    r0, c0 = tiles[:, 0] * bm, tiles[:, 1] * bn
    rows = r0[:, None] + torch.arange(bm)  # (P, bm)
    cols = c0[:, None] + torch.arange(bn)  # (P, bn)
    iv = mask.row_intervals(rows.clamp(max=seqlen - 1).reshape(-1)).reshape(len(tiles), bm, 1, 4)
    c = cols[:, None, :]
    want = ((iv[..., 0] <= c) & (c < iv[..., 1])) | ((iv[..., 2] <= c) & (c < iv[..., 3]))
    inside = (rows < seqlen)[:, :, None] & (cols < seqlen)[:, None, :]
    got = _eval_tiles(mask_mod, r0, c0, bm, bn, seqlen)
    return bool(((got == want) | ~inside).all())


def _candidates(seqlen: int, block: int) -> list[tuple[str, SequenceMask]]:
    out = []
    if seqlen % 2 == 0 and block <= seqlen // 2:
        out.append(("block_diffusion", SequenceMask.block_diffusion(seqlen, block)))
    out.append(("block_causal", SequenceMask.block_causal(seqlen, block)))
    return out


def _block_mask_tables(block_mask) -> tuple[tuple[torch.Tensor, ...], int, int] | None:
    """The BlockMask's eight tables as real tensors and its tile sizes, or None. Dynamo keeps each
    graph input's real example on its placeholder (meta["grapharg"]); the tables sit at positions
    2..9 of the block_mask tuple in both torch 2.11 and 2.13, the tile sizes just before the mask
    graph."""
    nodes, (bm, bn) = block_mask[2:10], block_mask[-3:-1]
    if not (isinstance(bm, int) and isinstance(bn, int)):
        return None
    real = []
    for node in nodes:
        if not (isinstance(node, torch.fx.Node) and node.op == "placeholder"):
            return None
        try:
            example = node.meta["grapharg"].example
        except Exception:  # no grapharg, or its weak reference is gone
            return None
        if not isinstance(example, torch.Tensor) or isinstance(example, FakeTensor) or example.dim() < 3:
            return None
        real.append(example.detach())
    return tuple(real), bm, bn


def _example(node) -> torch.Tensor | None:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None


def _static_int(x) -> int | None:
    """x as an int if it is one, or a SymInt whose value is fixed (dynamic=True graphs carry
    specialised sizes as SymInts with a constant expression), else None (no guard is added)."""
    if isinstance(x, torch.SymInt):
        return int(x) if is_concrete_int(x) else None
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _static_float(x) -> float | None:
    """The scale argument: a float, or a graph node whose example value is a fixed number."""
    if isinstance(x, torch.fx.Node):
        x = x.meta.get("example_value", x.meta.get("val"))
    if isinstance(x, torch.SymFloat):  # e.g. flex's 1/sqrt(head_dim) with a specialised head_dim
        expr = x.node.expr
        return None if getattr(expr, "free_symbols", True) else float(expr)
    if isinstance(x, torch.SymInt):
        x = _static_int(x)
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _decide(gm: torch.fx.GraphModule, node: torch.fx.Node):
    """(op, block_size, scale, lse_is_log2, mask kind) for a flex_attention node we can replace,
    else the reason we leave it to flex."""
    (q, k, v, score_mod, block_mask, scale, kernel_options,
     score_bufs, mask_bufs) = (list(node.args) + [(), ()])[:9]
    if any(isinstance(_example(x), (torch.SymInt, torch.SymFloat)) for x in (*score_bufs, *mask_bufs)):
        # dynamic=True lifts ints that a locally built mask_mod closes over (n, block_size) into
        # symbolic inputs: the mask then holds for values we cannot check at compile time.
        return "mask_mod closes over values made symbolic (dynamic=True; build the mask globally)"
    if score_bufs or mask_bufs:
        return "captures tensors"
    if not _is_identity_score_mod(getattr(gm, score_mod.target)):
        return "score_mod is not the identity"
    if not all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
        return "outputs used as a tuple"
    if any(u.args[1] not in (0, 1) and u.users for u in node.users):
        return "max_scores used"
    vals = [_example(t) for t in (q, k, v)]
    if any(t is None for t in vals):
        return "no example values"
    qv, kv, vv = vals
    if qv.dim() != 4 or kv.shape != vv.shape or kv.dim() != 4:
        return "unexpected ranks"
    # The batch may stay symbolic (the mask ignores it); heads, head dim and length must be static:
    # the mask is checked at one length. (flex's own length check against a BlockMask built for a
    # fixed length specialises the sequence length under dynamic=True.)
    dims = [_static_int(x) for x in (qv.shape[1], qv.shape[2], qv.shape[3],
                                     kv.shape[1], kv.shape[2], kv.shape[3])]
    if any(d is None for d in dims):
        return "symbolic sequence length or head shape"
    h, sq, d, hkv, skv, dk = dims
    if not statically_known_true(qv.shape[0] == kv.shape[0]):
        return "q and k/v batch sizes differ"
    if sq != skv or d != dk or h % hkv:
        return "q and k/v shapes differ (cross-attention or mismatched heads)"
    if qv.dtype not in DTYPES or d % 8 or d > MAX_HEAD_DIM:
        return "dtype or head dim outside the op"
    mask_gm = getattr(gm, block_mask[-1].target)
    b_arg, h_arg = _placeholders(mask_gm)[:2]
    if b_arg.users or h_arg.users:
        return "mask depends on batch or head"
    found = _block_mask_tables(block_mask)
    if found is not None:
        kind = classify_mask_tiles(mask_gm, sq, *found, key=mask_gm.code)
        _STATS["checked: partial tiles"] += 1
    else:  # no real tables to read: prove the mask_mod itself on every pair (quadratic)
        kind = classify_mask(mask_gm, sq, key=mask_gm.code)
        _STATS["checked: all pairs"] += 1
    if isinstance(kind, str):
        return kind
    name, bs = kind
    scale_value = _static_float(scale)
    if scale_value is None:
        return "symbolic scale"
    op = (torch.ops.dlm.diffusion_attn_fwd if name == "block_diffusion"
          else torch.ops.dlm.block_causal_attn_fwd).default
    lse_is_log2 = dict(kernel_options or {}).get("BACKEND", "AUTO") != "FLASH"
    return op, bs, scale_value, lse_is_log2, name


# -- rewriting ---------------------------------------------------------------------------------


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, op, bs, scale, lse_is_log2) -> None:
    q, k, v = node.args[:3]
    with graph.inserting_before(node):
        qt, kt, vt = (graph.call_function(torch.transpose, (t, 1, 2)) for t in (q, k, v))
        res = graph.call_function(op, (qt, kt, vt, bs, scale, 0.0, False, None))
        out = graph.call_function(operator.getitem, (res, 0))
        out = graph.call_function(torch.transpose, (out, 1, 2))
        out = graph.call_method("contiguous", (out,))
        lse = graph.call_function(operator.getitem, (res, 1))
        if lse_is_log2:
            lse = graph.call_function(operator.mul, (lse, _LOG2E))
    for user in list(node.users):
        index = user.args[1]
        if index in (0, 1):
            user.replace_all_uses_with(out if index == 0 else lse)
        graph.erase_node(user)
    graph.erase_node(node)


def rewrite_graph(graph: torch.fx.Graph) -> int:
    """Replace every qualifying flex_attention call in ``graph``; returns how many."""
    gm = graph.owning_module
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.higher_order.flex_attention:
            continue
        try:
            decision = _decide(gm, node)
        except Exception as e:  # the pass runs in every user's compile: it must never break one
            decision = f"internal error ({type(e).__name__}: {e})"
            log.warning("dlm_ops: flex rewrite skipped a call after %s", decision)
        if isinstance(decision, str):
            _STATS[f"declined: {decision}"] += 1
            log.info("dlm_ops: flex_attention left to flex (%s)", decision)
            continue
        op, bs, scale, lse_is_log2, name = decision
        _rewrite(graph, node, op, bs, scale, lse_is_log2)
        _STATS["rewritten"] += 1
        _STATS[f"rewritten: {name}"] += 1
        log.info("dlm_ops: flex_attention -> %s (block_size %d)", op, bs)
        done += 1
    return done


class FlexRewritePass(CustomGraphPass):
    """The pre-grad pass; it runs the pass that was installed before it (if any) afterwards."""

    def __init__(self, chained=None):
        self.chained = chained

    def __call__(self, graph: torch.fx.Graph) -> None:
        if _STATE["enabled"]:
            rewrite_graph(graph)
        if self.chained is not None:
            self.chained(graph)

    def uuid(self):
        h = hashlib.sha256(Path(__file__).read_bytes())
        h.update(str(_STATE["enabled"]).encode())
        chained = getattr(self.chained, "uuid", lambda: repr(self.chained))()
        h.update(repr(chained).encode())
        return h.hexdigest()


def install() -> None:
    """Chain the pass in front of whatever pre-grad pass is configured (idempotent)."""
    import torch._inductor.config as inductor_config

    current = inductor_config.pre_grad_custom_pass
    if isinstance(current, FlexRewritePass):
        return
    inductor_config.pre_grad_custom_pass = FlexRewritePass(chained=current)
