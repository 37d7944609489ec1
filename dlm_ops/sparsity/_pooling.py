"""Attention mass pooled over (query block x key block) tiles, in chunks, never the S x S matrix.

    mass[b, h, I, J] = sum over rows i in query block I, keys j in key block J of p[b, h, i, j]

with p the softmax of scale * q.k over one key *part*: keys [0, split) and [split, Sk) are
normalised separately (SparseD's isolated selection; split = Sk, the default, is the plain
softmax). Two passes per query chunk, as in a flash-attention forward: pass 1 runs over the key
chunks and keeps each row's log-sum-exp per part; pass 2 runs over them again and accumulates
exp(s - lse) into the tiles. That is twice the QK^T work of one attention forward, and the working
set is a few copies of one (B, H, chunk_q, chunk_k) fp32 score chunk (``chunk_sizes`` says how
many), whatever S is. SparseD (dense), BA-Att's oracle and PulseCol (block_size_k = 1) share it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Peak bytes one chunk may take: the fp32 scores, their exp and the padded copy pooling makes are
# ~3 live copies of (B, H, chunk_q, chunk_k) fp32. 256 MiB keeps a 64K-token selection at H=32
# well inside an H200 beside a model (and is ~3 s of work per chunk at worst on a CPU).
CHUNK_BYTES = 256 * 2**20
LIVE_COPIES = 3


def chunk_sizes(batch: int, heads: int, seqlen_q: int, seqlen_k: int, block_q: int, block_k: int,
                chunk_q: int | None = None, chunk_k: int | None = None) -> tuple[int, int]:
    """Chunk lengths (multiples of the block sizes) whose score chunks fit ``CHUNK_BYTES``."""
    if chunk_k is None:  # up to 4096 keys: long enough rows for the matmul, short enough to fit
        chunk_k = min(math.ceil(seqlen_k / block_k), max(1, 4096 // block_k)) * block_k
    if chunk_q is None:
        rows = CHUNK_BYTES // (LIVE_COPIES * 4 * batch * heads * chunk_k)
        chunk_q = max(1, min(math.ceil(seqlen_q / block_q), rows // block_q)) * block_q
    if chunk_q % block_q or chunk_k % block_k or chunk_q < 1 or chunk_k < 1:
        raise ValueError(f"chunk_q / chunk_k must be positive multiples of block_size_q "
                         f"({block_q}) / block_size_k ({block_k}), got {chunk_q} / {chunk_k}")
    return chunk_q, chunk_k


def _key_chunks(split: int, seqlen_k: int, chunk_k: int) -> list[tuple[int, int, int]]:
    """(start, end, part) chunks that never straddle the split (part 0: [0, split), 1: the rest)."""
    out = [(s, min(s + chunk_k, split), 0) for s in range(0, split, chunk_k)]
    return out + [(s, min(s + chunk_k, seqlen_k), 1) for s in range(split, seqlen_k, chunk_k)]


def pooled_mass(q: torch.Tensor, k: torch.Tensor, block_q: int, block_k: int, scale: float,
                split: int | None = None, chunk_q: int | None = None,
                chunk_k: int | None = None) -> torch.Tensor:
    """q (B, Sq, H, D), k (B, Sk, Hkv, D) -> fp32 mass (B, H, ceil(Sq/block_q), ceil(Sk/block_k)).

    ``split`` (a multiple of block_k, or Sk) separates the two independently normalised key parts.
    """
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    split = sk if split is None else split
    if split % block_k and split != sk:
        raise ValueError(f"split must be a multiple of block_size_k ({block_k}) or Sk, got {split}")
    chunk_q, chunk_k = chunk_sizes(b, h, sq, sk, block_q, block_k, chunk_q, chunk_k)
    nqb, nkb = math.ceil(sq / block_q), math.ceil(sk / block_k)
    # (B, Hkv, G, S, D): the G query heads of a kv head share one matmul against its keys, so
    # GQA never materialises repeated keys.
    qg = q.permute(0, 2, 1, 3).reshape(b, hkv, g, sq, d)
    kt = k.permute(0, 2, 3, 1)  # (B, Hkv, D, Sk)
    mass = q.new_zeros((b, hkv, g, nqb, nkb), dtype=torch.float32)
    chunks = _key_chunks(split, sk, chunk_k)

    for q0 in range(0, sq, chunk_q):
        q1 = min(q0 + chunk_q, sq)
        qc = qg[:, :, :, q0:q1].float().reshape(b, hkv, g * (q1 - q0), d)

        def scores(k0, k1):
            s = qc @ kt[..., k0:k1].float()
            return (s * scale).view(b, hkv, g, q1 - q0, k1 - k0)

        lse = [None, None]  # per part: (B, Hkv, G, rows)
        for k0, k1, part in chunks:  # pass 1
            m = torch.logsumexp(scores(k0, k1), dim=-1)
            lse[part] = m if lse[part] is None else torch.logaddexp(lse[part], m)
        for k0, k1, part in chunks:  # pass 2
            p = torch.exp(scores(k0, k1) - lse[part].unsqueeze(-1))
            pad_q, pad_k = -(q1 - q0) % block_q, -(k1 - k0) % block_k
            p = F.pad(p, (0, pad_k, 0, pad_q))  # zero rows/cols past Sq/Sk add no mass
            tiles = p.view(b, hkv, g, (q1 - q0 + pad_q) // block_q, block_q,
                           (k1 - k0 + pad_k) // block_k, block_k).sum(dim=(-3, -1))
            mass[:, :, :, q0 // block_q: q0 // block_q + tiles.shape[3],
                 k0 // block_k: k0 // block_k + tiles.shape[4]] += tiles
    return mass.view(b, h, nqb, nkb)
