"""Contract 4's checks for lossy paths (bf16 arithmetic, int4 weights): each lossy path is compared with an fp32
reference fed the same inputs, never with another lossy path at a near-tie.

Bounds on logits are counted in bf16 epsilons (2**-7, the spacing of bf16 numbers in [1, 2)) of the largest |logit|
of the fp32 reference: every rounding error of the last matvec is a fraction of that scale, and so are the errors the
layers below pass up. The count is not derived from first principles (30 layers of bf16 activations compound): each
test states what it measured in these units on both kinds of CPU and allows about twice that. Two bounds:
- E on every logit: how far the lossy path's output is from fp32's.
- D on every logit minus the logit of fp32's top token, which is what decides the argmax. A shift common to a row's
  logits moves no token, so this error is smaller than 2E (measured: about 0.6E). A token j can overtake fp32's top
  token t only if (got[j] - got[t]) - (ref[j] - ref[t]) >= ref[t] - ref[j], so the argmax must be fp32's wherever
  fp32's top-2 gap exceeds D, and may differ only below it (a near-tie that any rounding may break either way)."""
import torch

BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7


def top2_gap(logits):
    "The top logit minus the runner-up, per row."
    top2 = logits.float().topk(2, -1).values
    return top2[..., 0] - top2[..., 1]


def bound(ref, k):
    "`k` bf16 epsilons of the largest |logit| in the fp32 reference `ref` (E or D above)."
    return k * BF16_EPS * ref.abs().max().item()


def from_top(logits, top):
    "Every logit minus the logit of token `top` of its row (fp32's argmax): what decides the argmax."
    return logits.float() - logits.float().gather(-1, top)


def in_eps(err, ref):
    "An error in bf16 epsilons of the largest |logit| of `ref` (the unit of `bound`)."
    return (err.abs().max() / (BF16_EPS * ref.abs().max())).item()


def assert_near_fp32(got, ref, k, k_top, what):
    """`got` (a lossy path's logits [..., vocab], fed the same tokens as fp32) against fp32's `ref`: every logit within
    E = `bound(ref, k)`, every logit minus that of fp32's top token within D = `bound(ref, k_top)` of fp32's, and so the
    argmax fp32's in every row whose fp32 top-2 gap exceeds D (checked to name the row). Returns the errors in bf16 eps
    and a bool per row: where the tokens had to agree."""
    top = ref.argmax(-1, keepdim=True)
    err, err_top = in_eps(got.float() - ref, ref), in_eps(from_top(got, top) - from_top(ref, top), ref)
    assert err <= k and err_top <= k_top, f"{what}: {err:.2f}, {err_top:.2f} bf16 eps from fp32 (bounds {k}, {k_top})"
    clear = top2_gap(ref) > bound(ref, k_top)
    differ = (got.argmax(-1) != ref.argmax(-1)) & clear
    assert not differ.any(), f"{what}: not fp32's argmax where its top-2 gap exceeds D: {differ.nonzero().tolist()}"
    return err, err_top, clear


def first_divergence_is_near_tie(got, want, logits_after, threshold):
    """`got` == `want` (fp32's greedy tokens), or they first differ at a position where fp32's top-2 gap is below
    `threshold(logits)`; `logits_after(prefix)` gives fp32's logits for the token after `want`'s first tokens `prefix`.
    Returns (whether it holds, (position, fp32's gap there) for a message)."""
    if got == want: return True, None
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None: return False, ("lengths differ", len(got), len(want))
    logits = logits_after(want[:i])
    gap = top2_gap(logits).item()
    return gap < threshold(logits), (i, gap)


def assert_kv_near_fp32(pool, ref, what, layer0=2**-5, every=2**-1):
    """A lossy path's K or V pool [layers, blocks, slots, heads, dim] against fp32's, both fed the same tokens: each
    head vector in exactly the slots fp32 wrote, and within `layer0` of its length in layer 0 (one projection of the
    embeddings: a few bf16 roundings of 2**-8 each) and `every` in every layer (the drift that 30 layers of bf16
    activations pass up; a vector of another token is off by about its own length). Returns the largest relative
    errors."""
    pool, written = pool.float(), (ref != 0).any(-1)
    assert torch.equal((pool != 0).any(-1), written), f"{what}: K/V written to other slots than fp32's"
    rel = (pool - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    first, worst = rel[0][written[0]].max().item(), rel[written].max().item()
    assert first <= layer0 and worst <= every, f"{what}: relative errors {first:.4f} in layer 0, {worst:.4f} in all"
    return first, worst
