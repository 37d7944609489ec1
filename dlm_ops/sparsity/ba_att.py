r"""BA-Att block selection: block scores from pooled Q/K statistics, no token-level scores at all.

BA-Att selects key blocks in a pre-downsampled space: each block of queries and of keys is reduced
to a few statistics and the block score is computed from those, at O(nQb * nKb * D) cost instead
of SparseD's O(Sq * Sk * D). The paper's code is not public; the correction below is our own
derivation.

Derivation. For a query block I and key block J, the quantity to rank is the attention mass of
the tile, sum_{i in I, j in J} exp(s q_i.k_j - lse_i). Treat the lse_i of one query block as equal
(they drop out of a ranking over J) and the tokens as independent draws, q ~ N(mu_Q, diag v_Q)
over the block's queries, k ~ N(mu_K, diag v_K) over the block's keys. Then

    log mass(I, J) ~ log n_J + log E_{q,k} exp(s X),      X = q.k = sum_d q_d k_d.

The cumulant expansion log E exp(sX) = s E[X] + s^2/2 Var[X] + O(s^3) with, for independent
coordinates (diagonal covariances),

    E[X]   = mu_Q . mu_K
    Var[X] = sum_d Var(q_d k_d) = sum_d (v_Q,d v_K,d + v_Q,d mu_K,d^2 + mu_Q,d^2 v_K,d)

gives the corrected score

    score(I, J) = log n_J + s mu_Q.mu_K + s^2/2 sum_d (v_Q,d v_K,d + v_Q,d mu_K,d^2 + mu_Q,d^2 v_K,d).

Plain mean pooling keeps only s mu_Q.mu_K: it cannot tell a block of keys that all sit near the
mean (small mass) from one whose keys spread along the directions the queries use (by convexity
of exp, more mass), and the variance term is exactly that spread, weighted by the query side.

Sorting by norm. Means and diagonal variances are permutation invariant: sorting the tokens of a
block by norm changes neither, for queries or keys, so plain and corrected pooling gain nothing
from it. Where it matters is the Gaussian assumption: attention mass is dominated by the few keys
with the largest logits, and a block holding one outlier key (a sink, a delimiter) is far from
Gaussian; mean and variance dilute the outlier by 1/n_J. So keys are sorted by norm within each
block (stable, descending) and the ``outliers`` largest-norm keys are scored one by one (exact for
a Gaussian query block: log E_q exp(s q.k_o) = s mu_Q.k_o + s^2/2 sum_d v_Q,d k_o,d^2), the rest
of the block by the corrected cumulant of its own statistics:

    score(I, J) = log( sum_{o <= outliers} exp(s mu_Q.k_o + s^2/2 v_Q.k_o^2)
                       + n_rest exp(s mu_Q.mu_R + s^2/2 sum_d (v_Q v_R + v_Q mu_R^2 + mu_Q^2 v_R)) ).

``outliers=0`` is the plain corrected score. Queries are not split by norm: each query's
probabilities sum to 1, so a large-norm query sharpens its own row but adds no mass.

Selection: top-k (``rho``: SparseD's int(nKb * rho) + 1 per query block, for comparisons at equal
density) or cumulative mass (``mass``: the fewest blocks whose softmax-normalised estimated mass
reaches the threshold, at least one). Ties go to the lowest block index.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ops.sparse_select import check_selection_inputs
from .sparsed import check_fraction, part_k
from .tables import mask_to_indices, topk_mask

METHODS = ("corrected", "mean")


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, Hx, D) -> fp32 (B, Hx, nb, block, D) zero-padded, and bool (nb, block) validity."""
    b, s, hx, d = x.shape
    nb = math.ceil(s / block)
    xf = F.pad(x.float().permute(0, 2, 1, 3), (0, 0, 0, nb * block - s))
    valid = (torch.arange(nb * block, device=x.device) < s).view(nb, block)
    return xf.view(b, hx, nb, block, d), valid


def _stats(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted (0/1) mean and population variance over dim -2; and the weight count."""
    n = w.sum(-1)
    wn = (w / n.clamp(min=1).unsqueeze(-1)).unsqueeze(-1)
    mu = (x * wn).sum(-2)
    var = ((x - mu.unsqueeze(-2)).square() * wn).sum(-2)
    return mu, var, n


def ba_att_scores(q, k, *, block_size_q: int, block_size_k: int, method: str = "corrected",
                  outliers: int = 1, softmax_scale=None) -> torch.Tensor:
    """Estimated log tile mass, fp32 (B, H, nQb, nKb) (for "mean": s mu_Q.mu_K, a ranking only)."""
    check_selection_inputs(q, k, block_size_q, block_size_k)
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    if isinstance(outliers, bool) or not isinstance(outliers, int) or outliers < 0:
        raise ValueError(f"outliers must be an int >= 0, got {outliers!r}")
    s = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    b, _, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    qb, qvalid = _blocks(q, block_size_q)  # (B, H, nQb, bq, D)
    kb, kvalid = _blocks(k, block_size_k)  # (B, Hkv, nKb, bk, D)
    nqb, nkb = qb.shape[2], kb.shape[2]
    mu_q, v_q, _ = _stats(qb, qvalid.float())
    # (B, Hkv, G * nQb, D): the G query heads of one kv head meet its key blocks in one matmul.
    mu_q, v_q = (t.reshape(b, hkv, g * nqb, d) for t in (mu_q, v_q))

    if method == "mean":
        mu_k, _, _ = _stats(kb, kvalid.float())
        score = s * (mu_q @ mu_k.transpose(-1, -2))
        return score.view(b, h, nqb, nkb)

    # Sort each key block by norm, largest first; padding (norm -1) sorts last. Stable: equal
    # norms keep their order, so the split into outliers and rest is deterministic.
    norms = kb.norm(dim=-1).masked_fill(~kvalid, -1.0)
    order = torch.sort(norms, dim=-1, descending=True, stable=True).indices
    kb = kb.gather(3, order.unsqueeze(-1).expand_as(kb))
    n_valid = kvalid.sum(-1)  # (nKb,) tokens per key block
    slot = torch.arange(block_size_k, device=k.device)
    r = min(outliers, block_size_k)
    rest_w = ((slot >= r) & (slot < n_valid.unsqueeze(-1))).float()  # (nKb, bk)
    mu_r, v_r, n_r = _stats(kb, rest_w)

    def t(x):  # (B, Hkv, nKb, D) -> (B, Hkv, D, nKb)
        return x.transpose(-1, -2)

    terms = []
    var = v_q @ t(v_r) + v_q @ t(mu_r.square()) + mu_q.square() @ t(v_r)
    rest = s * (mu_q @ t(mu_r)) + 0.5 * s * s * var + torch.log(n_r.float())  # log 0 = -inf
    terms.append(rest)
    for o in range(r):
        ko = kb[:, :, :, o]  # (B, Hkv, nKb, D): each block's o-th largest-norm key
        a = s * (mu_q @ t(ko)) + 0.5 * s * s * (v_q @ t(ko.square()))
        terms.append(a.masked_fill(~(o < n_valid), float("-inf")))
    score = torch.logsumexp(torch.stack(terms), dim=0)
    return score.view(b, h, nqb, nkb)


def select_from_scores(scores: torch.Tensor, *, rho=None, mass=None) -> torch.Tensor:
    """Boolean table from log-mass scores: top-k (``rho``) or cumulative mass (``mass``)."""
    if (rho is None) == (mass is None):
        raise ValueError("exactly one of rho (top-k) and mass (cumulative mass) must be given, "
                         f"got rho={rho!r}, mass={mass!r}")
    if rho is not None:
        check_fraction("rho", rho)
        return topk_mask(scores, part_k(scores.shape[-1], rho))
    check_fraction("mass", mass)
    est = torch.softmax(scores, dim=-1)
    ranked = torch.sort(est, dim=-1, descending=True, stable=True).values
    before = ranked.cumsum(-1) - ranked  # the mass of the blocks ranked above
    k = (before < mass).sum(-1).clamp(min=1)  # the fewest blocks that reach ``mass``
    return topk_mask(est, k)


def ba_att_select(q, k, *, block_size_q: int, block_size_k: int, rho=None, mass=None,
                  method: str = "corrected", outliers: int = 1, softmax_scale=None):
    """BA-Att selection -> (kv_block_indices int32, kv_block_counts int32) for
    ``dlm_ops.block_sparse_attn``. Give ``rho`` (top int(nKb * rho) + 1 blocks per query block) or
    ``mass`` (cumulative estimated mass). ``method``/``outliers``: see the module docstring."""
    scores = ba_att_scores(q, k, block_size_q=block_size_q, block_size_k=block_size_k,
                           method=method, outliers=outliers, softmax_scale=softmax_scale)
    return mask_to_indices(select_from_scores(scores, rho=rho, mass=mass))
