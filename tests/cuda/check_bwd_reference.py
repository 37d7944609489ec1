"""Checks the fp64 reference of tests/cuda/diffusion_bwd_standalone.cu against torch autograd (CPU,
no GPU needed): `bwd_standalone refdump ref.bin && python tests/cuda/check_bwd_reference.py ref.bin`
prints max |reference - autograd| and max |autograd| per gradient and exits 1 if they differ by more
than 1e-9 relative. The harness's CUDA checks are only as good as that reference."""
import numpy as np, torch, sys
raw = open(sys.argv[1], 'rb').read()
B, S, H, Hkv, D, nn, bs = np.frombuffer(raw[:28], dtype=np.int32)
x = np.frombuffer(raw[28:], dtype=np.float64)
nq, nk = B*S*H*D, B*S*Hkv*D
sizes = [nq, nk, nk, nq, nq, nk, nk]
parts, o = [], 0
for s in sizes: parts.append(x[o:o+s]); o += s
q, k, v, g, dq, dk, dv = [torch.tensor(p) for p in parts]
q = q.view(B, S, H, D).requires_grad_(); g = g.view(B, S, H, D)
k = k.view(B, S, Hkv, D).requires_grad_(); v = v.view(B, S, Hkv, D).requires_grad_()
# BD3 mask from the definition (DESIGN.md 1)
i = torch.arange(S); c = i >= nn; blk = torch.where(c, i - nn, i) // bs
qc, kc = c[:, None], c[None, :]; qb, kb = blk[:, None], blk[None, :]
vis = ((qc == kc) & (qb == kb)) | (~qc & kc & (kb < qb)) | (qc & kc & (kb <= qb))
G = H // Hkv
kk = k.repeat_interleave(G, 2); vv = v.repeat_interleave(G, 2)
s = torch.einsum('bihd,bjhd->bhij', q, kk) / D**0.5
s = s.masked_fill(~vis, float('-inf'))
p = s.softmax(-1)
out = torch.einsum('bhij,bjhd->bihd', p, vv)
out.backward(g)
bad = False
for name, ref, got in [('dq', q.grad, dq.view(B,S,H,D)), ('dk', k.grad, dk.view(B,S,Hkv,D)), ('dv', v.grad, dv.view(B,S,Hkv,D))]:
    err, mag = float((ref - got).abs().max()), float(ref.abs().max())
    print(f"{name}: max |reference - autograd| {err:.2e}, max |autograd| {mag:.3f}")
    bad = bad or not err <= 1e-9 * mag
sys.exit(1 if bad else 0)
