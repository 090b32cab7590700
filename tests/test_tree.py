"""Chapter 10c: token trees (EAGLE-2's static and dynamic trees, verified in one pass of the target).

References: plain decoding (speculative=None) for greedy outputs; a plain forward without a cache (`NoCache`, chapter
00a) of each node's root path for the tree rows' logits; a paged prefill of the accepted tokens for the KV after
compaction; the target's own distribution for the tree sampler (`tree_sample` run once per sequence of its random
choices on a tiny vocabulary, and a chi-square test of `tree_sample` on real random streams with deliberately bad
drafts); chapter 03's PyTorch attention over explicit key lists for the Triton tree kernel (in the interpreter).
"""
import gc, math, os
import pytest, torch

import minfer.trees as trees_mod
from minfer.trees import static_tree, best_nodes, tree_sample, tree_greedy, tree_decode_attention, tree_children
from minfer.trees import root_paths, TreeDraft
from minfer.engine import EngineConfig
from minfer.llm import LLM
from minfer.model import NoCache, attend
from minfer.paged import PagedKVCache, PagedAttention, BlockTable, build_batch_meta
from minfer.sequence import Sequence, SamplingParams
from test_eagle import PROMPTS, SMALL, plain, tiny_head, random_head  # noqa: F401 (fixtures)


@pytest.fixture(autouse=True)
def collect_engines():
    "Free each test's engines when it ends (a proposer and its runner refer to each other: see test_eagle)."
    yield
    gc.collect()


def tree_llm(model_dir, head, tree, n=8, **kw):
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": n, "tree": tree}
    return LLM(model_dir, speculative=spec, **{**SMALL, **kw})


# ---- greedy: identical to plain decoding -------------------------------------------------------------------------
# the default switches (kernels='step': a tree of up to 7 nodes is one C++ call, wider steps run the layers with
# attention='cpu'), and chapter 03's PyTorch attention on the layers
ENGINES = {"step": {}, "layers": dict(kernels="cpu", attention="torch")}

@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_greedy_identical_batch_1_and_8(model_dir, plain, tiny_head, tree, engine):
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(PROMPTS, p, raw=True)]
    spec = tree_llm(model_dir, tiny_head, tree, n=4, **ENGINES[engine])
    if engine == "step": assert (spec.config.kernels, spec.config.attention) == ("step", "cpu")
    assert [spec.generate(x, p, raw=True)[0].token_ids for x in PROMPTS[:2]] == want[:2]
    # 8 prompts of 1 to ~40 tokens, 32 tokens a step: prompt chunks and trees share steps
    mixed = tree_llm(model_dir, tiny_head, tree, max_num_batched_tokens=32, **ENGINES[engine])
    batched = mixed.generate(PROMPTS, p, raw=True)
    assert [o.token_ids for o in batched] == want
    depths = mixed.engine.lookahead.accepted_depths
    assert sum(n for d, n in depths.items() if d >= 2) > 0, depths  # paths of two nodes and more were kept
    assert mixed.engine.cache.allocator.num_used == 0  # every node's block came back


def test_greedy_identical_with_prefix_cache_and_blocks_counted(model_dir, plain, tiny_head):
    "Prefix-cache hits (features the target never computed) and trees; after, every block in use is the cache's."
    p = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [PROMPTS[1] + " one", PROMPTS[1] + " two", PROMPTS[0]]
    want = [o.token_ids for o in plain.generate(prompts, p, raw=True)]
    spec = tree_llm(model_dir, tiny_head, "static", prefix_cache=True)
    assert [o.token_ids for o in spec.generate(prompts, p, raw=True)] == want
    assert [o.token_ids for o in spec.generate(prompts, p, raw=True)] == want  # now from the prefix cache
    stats = spec.engine.stats
    assert stats["blocks_in_use"] == stats["cached_blocks"] > 0, stats


@pytest.mark.parametrize("engine", ENGINES)
def test_tree_rows_equal_a_plain_forward_of_their_path(model_dir, plain, tiny_head, engine):
    """Each node's logits row equals the target's forward without a cache over the sequence + its root path (fp32).
    8 nodes: 9 rows, which the default switches run on the layers with attention='cpu' (a step of 1 + 4 rows is one
    C++ call: the greedy test above)."""
    spec = tree_llm(model_dir, tiny_head, "dynamic", **ENGINES[engine])
    sp = spec.engine.lookahead
    seen, verify = [], sp.verify
    def keep(seq, logits):
        draft, nodes = sp.requests[seq.id].draft, len(logits) - 1  # the nodes the step ran
        if isinstance(draft, TreeDraft) and len(seen) < 3:
            seen.append((list(seq.token_ids), draft.ids[:nodes], draft.parents[:nodes], logits.clone()))
        return verify(seq, logits)
    sp.verify = keep
    spec.generate(PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True))
    assert len(seen) == 3 and all(len(d) == 8 for _, d, _, _ in seen)
    for ids, drafts, parents, logits in seen:
        assert max(len(p) for p in root_paths(parents)) >= 2  # a tree with depth, not only first guesses
        for row, path in enumerate([[]] + root_paths(parents)):
            x = torch.tensor(ids + [drafts[i] for i in path])
            with torch.inference_mode():
                want = plain.model(x, torch.arange(len(x)), NoCache(), logits_rows=torch.tensor([len(x) - 1]))[0]
            torch.testing.assert_close(logits[row], want, atol=1e-4, rtol=0)


def test_kv_after_compaction_equals_a_prefill(model_dir, plain, tiny_head, monkeypatch):
    "After verifies that moved kept nodes, the sequence's K/V equal a paged prefill of the same tokens, every layer."
    moved, move_kv = [], trees_mod.move_kv
    def counting(cache, src, dst):
        moved.append(len(src))
        move_kv(cache, src, dst)
    monkeypatch.setattr(trees_mod, "move_kv", counting)
    spec = tree_llm(model_dir, tiny_head, "static")
    seq = Sequence(plain.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=40, ignore_eos=True), plain.tokenizer)
    spec.engine.add(seq)
    while len(seq.output_ids) < 30: spec.engine.step()
    assert sum(moved) > 0, moved  # some kept node was not its parent's first child: its rows moved
    n = seq.num_computed
    ref = plain.engine
    other = Sequence(seq.token_ids[:n], SamplingParams(max_tokens=2, ignore_eos=True), plain.tokenizer)
    ref.add(other)
    while other.num_computed < n: ref.step()  # the prefill of positions 0..n - 1 (it stays for one more token)
    s1, s2 = torch.tensor(seq.block_table.slots(0, n)), torch.tensor(other.block_table.slots(0, n))
    for a, b in ((spec.engine.cache.k, ref.cache.k), (spec.engine.cache.v, ref.cache.v)):
        fa, fb = (x.view(x.shape[0], -1, *x.shape[3:]) for x in (a, b))
        torch.testing.assert_close(fa[:, s1], fb[:, s2], atol=1e-4, rtol=1e-4)
    while ref.has_unfinished(): ref.step()


# ---- the tree sampler is exact -------------------------------------------------------------------------------------
def exact_outputs(probs, drafts, parents):
    """Every output of `tree_sample` and its exact probability: it is run once per sequence of its random choices
    (keep a draft or not, which token to draw), each choice weighted by its probability (the rule's own arithmetic,
    not re-implemented here)."""
    law, todo = {}, [()]
    while todo:
        script, taken, weight = todo.pop(), [], [1.0]
        def choose(options):
            if len(taken) < len(script): pick = script[len(taken)]
            else:
                pick = 0
                todo.extend(tuple(taken) + (alt,) for alt in range(1, len(options)))
            taken.append(pick)
            weight[0] *= options[pick][1]
            return options[pick][0]
        keep = lambda p, d, gen: choose([(True, float(p[d] / p.sum())), (False, float(1 - p[d] / p.sum()))])
        draw = lambda p, gen: choose([(t, float(p[t] / p.sum())) for t in range(len(p))])
        _, out = tree_sample(lambda row: probs[row], drafts, parents, [None] * (len(parents) + 1), keep, draw)
        if weight[0] > 0: law[tuple(out)] = law.get(tuple(out), 0) + weight[0]
    return law

def target_law(probs, drafts, parents, out):
    "The target's probability of `out`: each token from the row of the node the tokens before it reached."
    children, row, law = tree_children(parents), 0, 1.0
    for t in out:
        law *= float(probs[row][t])
        child = next((c for c in children[row] if drafts[c] == t), None)
        if child is None: break
        row = child + 1
    return law

def target_outputs(probs, drafts, parents):
    """The target's own law over a step's outputs, enumerated from its rows alone: a token that is a node's (the first
    child with it) continues into that node's row; any other ends the output."""
    children, law = tree_children(parents), {}
    def walk(row, prefix, weight):
        for t, pt in enumerate(probs[row].tolist()):
            if pt == 0: continue
            child = next((c for c in children[row] if drafts[c] == t), None)
            if child is None: law[prefix + (t,)] = weight * pt
            else: walk(child + 1, prefix + (t,), weight * pt)
    walk(0, (), 1.0)
    return law

@pytest.mark.parametrize("seed", range(6))
def test_tree_sample_is_exact_by_enumeration(seed):
    g = torch.Generator().manual_seed(seed)
    V = 4
    parents = [[-1, -1, 0, 0, 2], [-1, 0, 1], [-1, -1, -1, 0, 3, 3], [-1, -1, 0, 1, 1, 4], [-1], [-1, -1, -1, -1]][seed]
    probs = torch.rand(len(parents) + 1, V, generator=g, dtype=torch.float64) ** 3
    probs[:, int(torch.randint(V, (1,), generator=g))] = 0  # a token the target never writes: drafts of it must fail
    probs /= probs.sum(-1, keepdim=True)
    drafts = torch.randint(V, (len(parents),), generator=g).tolist()  # duplicates among siblings included
    law, want = exact_outputs(probs, drafts, parents), target_outputs(probs, drafts, parents)
    assert abs(sum(law.values()) - 1) < 1e-12 and abs(sum(want.values()) - 1) < 1e-12
    for out in set(law) | set(want):
        assert abs(law.get(out, 0) - want.get(out, 0)) < 1e-12, (out, law.get(out), want.get(out))

def test_tree_sample_chi_square_with_bad_drafts():
    "`tree_sample` itself, drafts the target finds unlikely (accepted rarely): its outputs follow the target's law."
    g = torch.Generator().manual_seed(1)
    V, parents = 5, [-1, -1, 0, 0, 1]
    probs = torch.softmax(torch.randn(len(parents) + 1, V, generator=g) * 2, -1)
    # the root's 2nd and 3rd least likely of 5 tokens, and unlikely ones below them: rejected more often than not
    drafts = [int(probs[0].argsort()[1]), int(probs[0].argsort()[2])]
    drafts += [int(probs[1].argsort()[1]), int(probs[1].argsort()[2]), int(probs[2].argsort()[1])]
    n, counts = 20000, {}
    for i in range(n):
        gens = [torch.Generator().manual_seed(i * 7 + j) for j in range(3)]
        _, out = tree_sample(lambda row: probs[row], drafts, parents, gens)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    law = target_outputs(probs, drafts, parents)  # the target's, not the sampler's own enumeration
    assert set(counts) <= set(law)
    chi2 = sum((counts.get(o, 0) - n * p) ** 2 / (n * p) for o, p in law.items())
    dof = len(law) - 1
    assert chi2 < dof + 4 * math.sqrt(2 * dof), (chi2, dof)  # about the 99.9th percentile of chi-square(dof)
    assert 0 < sum(c for o, c in counts.items() if len(o) > 1) < n  # guesses accepted and rejected


def test_greedy_walk_takes_the_targets_choices():
    drafts, parents = [5, 7, 1, 2, 3], [-1, -1, 1, 1, 3]
    choice = {0: 7, 2: 2, 4: 3, 5: 9}  # row -> the target's argmax: 7 (node 1), then 2 (node 3), then 3 (node 4), 9
    assert tree_greedy(lambda row: choice[row], drafts, parents) == ([1, 3, 4], [7, 2, 3, 9])
    assert tree_greedy(lambda row: 4, drafts, parents) == ([], [4])


# ---- shapes ----------------------------------------------------------------------------------------------------------
def test_static_and_best_node_shapes():
    for n in (1, 4, 8, 16):
        parents, ranks = static_tree(n)
        assert len(parents) == n and all(p < i for i, p in enumerate(parents)) and ranks[0] == 0
    assert static_tree(4) == ([-1, -1, -1, 0], [0, 1, 2, 0])
    keep, parents = best_nodes([-1, -1, 0, 0, 2], [-0.1, -0.5, -0.3, -0.2, -0.3], 3)
    assert keep == [0, 2, 3] and parents == [-1, 0, 0]
    keep, parents = best_nodes([-1, 0, 1], [-0.1, -0.1, -0.1], 2)  # a tie goes to the shallower: the parent
    assert keep == [0, 1] and parents == [-1, 0]
    with pytest.raises(ValueError, match="parent"): root_paths([-1, 3])


# ---- the Triton kernel -----------------------------------------------------------------------------------------------
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton on a CPU runs only in its interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_tree_kernel_matches_the_reference(model_dir, dtype):
    from minfer.model import ModelConfig
    cfg = ModelConfig.from_folder(model_dir)
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(cfg, 12, 4, dtype)
    for t in (cache.k, cache.v): t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    table = BlockTable(cache.allocator)
    table.append_slots(13)
    c, parents = 5, [-1, -1, 0, 1, 2, 2, 4]  # the root at position 5, seven nodes at 6..12
    keys = [list(range(c + 1))] + [list(range(c + 1)) + [c + 1 + j for j in p] for p in root_paths(parents)]
    meta = build_batch_meta([(table, c + i, 1) for i in range(len(keys))], 4, "cpu",
                            [None] + keys[1:])
    q = torch.randn(len(keys), cfg.num_attention_heads, cfg.head_dim, generator=g).to(dtype)
    ref = PagedAttention(cache).attention(q, cache.k[0], cache.v[0], meta)
    slots = torch.zeros(len(keys), max(map(len, keys)), dtype=torch.int32)
    for r, k in enumerate(keys): slots[r, :len(k)] = torch.tensor(table.slots(0, 13))[k].int()
    got = tree_decode_attention(q, cache.k[0], cache.v[0], slots, torch.tensor([len(k) for k in keys]).int())
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    # and the reference is what attention over the gathered keys says
    kf, vf = (x[0].view(-1, *x.shape[3:]) for x in (cache.k, cache.v))
    for r, k in enumerate(keys):
        s = torch.tensor(table.slots(0, 13))[k]
        want = attend(q[r:r + 1].float(), kf[s].float(), vf[s].float())
        torch.testing.assert_close(ref[r:r + 1].float(), want, atol=tol, rtol=tol)


# ---- the switch ------------------------------------------------------------------------------------------------------
def test_trees_plug_in_through_eagle_trees(model_dir, random_head):
    """Chapter 10c adds its trees through chapter 10b's `EAGLE_TREES` (10a's `Speculator.variant` looks them up): a
    chain stays 10b's `EagleSpeculator`, a tree is 10c's `TreeSpeculator`, and a shape that is taken is refused."""
    from minfer.eagle import EAGLE_TREES, EagleSpeculator
    from minfer.trees import TreeSpeculator
    assert EAGLE_TREES["static"] is EAGLE_TREES["dynamic"] is TreeSpeculator
    chain = LLM(model_dir, speculative={"method": "eagle", "model": random_head, "num_speculative_tokens": 2}, **SMALL)
    tree = tree_llm(model_dir, random_head, "static", n=2)
    assert type(chain.engine.lookahead) is EagleSpeculator and type(tree.engine.lookahead) is TreeSpeculator
    class Bushier(TreeSpeculator):
        pass
    with pytest.raises(ValueError, match="registered already"):
        EAGLE_TREES.register("static", Bushier)


def test_tree_switch_refusals_one_line(model_dir, random_head):
    base = {"method": "eagle", "model": random_head, "tree": "static"}
    bad = [(dict(speculative=base, kernels="torch", attention="triton"), "attention='triton' reads whole block tables"),
           (dict(speculative=base, kv_dtype="int8"), "kv_dtype='int8'"),
           (dict(speculative={**base, "adaptive": True}), "adaptive=True"),
           (dict(speculative={**base, "tree": "bushy"}), "tree='bushy'"),
           (dict(speculative={"method": "ngram", "tree": "static"}), "for method 'eagle'")]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match) as e: EngineConfig(**kw).resolve()
        assert "\n" not in str(e.value) and "auto" not in str(e.value)
    c = EngineConfig(speculative=base).resolve()
    assert (c.kernels, c.attention, c.speculative.tree) == ("step", "cpu", "static")
