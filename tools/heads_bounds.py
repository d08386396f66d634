"""Where a removed head's error goes and what each compensation could recover (docs/heads.md).

Usage: python tools/heads_bounds.py [MODEL] [CALIB] [HEADS_REMOVED] [IMG_SIZE]
Per block and removed set: the removed heads' output energy, the error left after the proj fold
(least squares from the kept heads' value channels), an upper bound for re-fitting the kept heads'
V with proj (features A_h X, no rank constraint), and the block-output error after the fold alone
and after refitting fc2 (all MLP channels) to the dense block output; all relative to the block's
update energy E||y - x||^2, in-sample least squares on the calibration images (seed 0).
"""
import torch, sys
from edgeprune.zoo.registry import get_model_spec
from edgeprune.anatomy import find_anatomy
torch.set_num_threads(1)
name = sys.argv[1] if len(sys.argv) > 1 else "fmnist-vit"
ncal = int(sys.argv[2]) if len(sys.argv) > 2 else 256
nrem = int(sys.argv[3]) if len(sys.argv) > 3 else 1
spec = get_model_spec(name, img_size=int(sys.argv[4]) if len(sys.argv) > 4 else None)
dense = spec.create(pretrained=True)
an = find_anatomy(dense)
calib = spec.calibration_source(ncal, seed=0)
X = []
caps = {}
hs = [b.block.register_forward_pre_hook(lambda m, a, i=b.index: caps.setdefault(i, []).append(a[0].detach())) for b in an.blocks]
with torch.no_grad():
    for x in calib.batches(32):
        dense(x if torch.is_tensor(x) else x[0])
for h in hs: h.remove()

def lsq_resid(F, T, lam=1e-6):
    F = torch.cat([F, torch.ones(F.shape[0], 1, dtype=F.dtype)], 1)
    G = F.T @ F
    G += lam * G.diagonal().mean() * torch.eye(G.shape[0], dtype=G.dtype)
    W = torch.linalg.solve(G, F.T @ T)
    return float((T - F @ W).pow(2).sum())

def ls(m, t):
    return t if m is None else m(t)

with torch.no_grad():
  for b in an.blocks:
    x = torch.cat(caps[b.index]).double()
    blk = b.block.double()
    B, N, D = x.shape
    H, d = b.num_heads, b.head_dim
    xn = blk.norm1(x)
    qkv = b.qkv(xn).reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    q, k = b.attn.q_norm(q), b.attn.k_norm(k)
    A = (q @ k.transpose(-1, -2) * b.attn.scale).softmax(-1)  # B H N N
    z = (A @ v).transpose(1, 2).reshape(B, N, H * d)
    W = b.proj.weight.double()
    g1 = b.ls1.gamma.double() if b.ls1 is not None and hasattr(b.ls1, "gamma") else torch.ones(D, dtype=torch.float64)
    attn_d = ls(b.ls1, b.proj(z))
    y_d = x + attn_d
    y_d = y_d + ls(b.ls2, b.mlp(blk.norm2(y_d)))
    tot = float((y_d - x).pow(2).sum())
    # try each removal set of size nrem (greedy by fold error: simple: try all single heads / combos)
    import itertools
    res = []
    for P in itertools.combinations(range(H), nrem):
        S = [h for h in range(H) if h not in P]
        ci = lambda hh: torch.cat([torch.arange(h * d, (h + 1) * d) for h in hh])
        zs, zp = z[..., ci(S)], z[..., ci(P)]
        e = (zp @ W[:, ci(P)].T) * g1          # removed contribution in residual
        ez = e.reshape(-1, D)
        fS = zs.reshape(-1, zs.shape[-1])
        r0 = float(ez.pow(2).sum())
        r1 = lsq_resid(fS, ez)
        AX = torch.cat([(A[:, h] @ xn) for h in S], -1).reshape(-1, D * len(S))
        r2 = lsq_resid(AX, ez)
        # fold then MLP refit: pruned attention with fold
        F = torch.cat([fS, torch.ones(fS.shape[0], 1, dtype=fS.dtype)], 1)
        Wf = torch.linalg.lstsq(F, ez).solution
        attn_p = attn_d - e + (F @ Wf).reshape(B, N, D)
        xp = x + attn_p
        hid = b.act(b.fc1(blk.norm2(xp))).reshape(-1, b.mlp_hidden)
        tgt = (y_d - xp).reshape(-1, D)
        base3 = float((tgt - ls(b.ls2, b.fc2(hid))).pow(2).sum())
        r3 = lsq_resid(hid, tgt)
        # output error at block output after fold only: base3 ; after fc2 refit: r3
        res.append((P, r0 / tot, r1 / tot, r2 / tot, base3 / tot, r3 / tot))
    res.sort(key=lambda t: t[2])
    for P, a0, a1, a2, a3, a4 in res[:3]:
        print(f"block {b.index} remove {P}: rel to block update energy: none {a0:.4f} fold {a1:.4f} "
              f"Vrefit-bound {a2:.4f} | blockout after fold {a3:.4f} fc2-refit {a4:.4f}", flush=True)
