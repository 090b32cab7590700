"""Chapters 03 (paged KV allocator) and 04 (radix prefix cache): invariants under random operations, and greedy tokens
identical to chapter 02's contiguous cache.

The property tests drive a `BlockAllocator`, `BlockTable`s and a `RadixCache` through random allocate / append / fork /
free / match / insert / evict steps against a toy KV pool whose slot for position p holds a fingerprint of the prefix
tokens[:p+1] (what real keys and values depend on). After every step: refcounts equal the number of holders (tables
and tree nodes), free + used = total and free blocks have no holder, every live sequence reads back its own prefix
through its block table (so copy-on-write never let a write land in a shared block), every cached tree block still
holds the KV of the tokens its path spells, locks are counted exactly and locked nodes survive eviction. When every
sequence has finished and the cache is evicted, every block is free.
"""
import random

import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minfer.paged import BlockAllocator, BlockTable, OutOfBlocks, build_batch_meta, PagedAttention, PagedKVCache, paged_generate
from minfer.radix import RadixCache, RadixGenerator


# ---------------------------------------------------------------- allocator unit tests
def test_out_of_blocks_changes_nothing():
    a = BlockAllocator(4, block_size=2)
    t = BlockTable(a)
    t.append_slots(5)  # 3 blocks
    before = (list(a.free_ids), list(a.refcount), list(t.blocks), t.num_tokens)
    with pytest.raises(OutOfBlocks) as e: t.append_slots(4)  # needs 2 more blocks, 1 free
    assert (e.value.needed, e.value.free) == (2, 1)
    assert before == (list(a.free_ids), list(a.refcount), list(t.blocks), t.num_tokens)
    with pytest.raises(OutOfBlocks): a.allocate(2)
    assert a.num_free == 1
    t.free()
    assert a.num_free == 4 and a.refcount == [0] * 4


def test_double_free_and_sharing_a_free_block_are_errors():
    a = BlockAllocator(3)
    b = a.allocate(1)
    a.free(b)
    with pytest.raises(ValueError, match="freed twice"): a.free(b)
    with pytest.raises(ValueError, match="is free"): a.incref(b)


def test_fork_copies_only_the_shared_partial_block():
    a = BlockAllocator(8, block_size=4)
    t = BlockTable(a)
    assert t.append_slots(6) == []          # blocks [0, 1], the second half full
    f = t.fork()
    assert a.refcount[0] == a.refcount[1] == 2
    assert f.append_slots(0) == [] and f.blocks == t.blocks  # nothing written, nothing copied
    copies = f.append_slots(1)              # position 6 is in shared block 1: copy it, leave block 0 shared
    assert copies == [(1, f.blocks[1])] and f.blocks[0] == t.blocks[0] and f.blocks[1] != t.blocks[1]
    assert t.append_slots(1) == []          # block 1 is now t's alone: written in place
    assert t.slots(4, 7) == [t.blocks[1] * 4 + i for i in range(3)]
    f.free(); t.free()
    assert a.num_free == 8


def test_batch_meta_layout():
    m = build_batch_meta([([3, 1], 5, 2), ([2], 0, 3), ([0, 4, 6], 9, 1)], block_size=4)
    # seq 0 positions 5, 6 -> block 1 offsets 1, 2; seq 1 positions 0..2 -> block 2; seq 2 position 9 -> block 6 offset 1
    assert m.slot_mapping.tolist() == [5, 6, 8, 9, 10, 25] and m.slot_mapping.dtype == torch.int64
    assert m.cu_seqlens_q.tolist() == [0, 2, 5, 6] and m.cu_seqlens_q.dtype == torch.int32
    assert m.seq_lens.tolist() == [7, 3, 10] and m.seq_lens.dtype == torch.int32
    assert m.block_tables.tolist() == [[3, 1, 0], [2, 0, 0], [0, 4, 6]] and m.block_tables.dtype == torch.int32
    assert (m.max_seqlen_q, m.max_seqlen_k) == (3, 10)
    with pytest.raises(ValueError, match="cannot hold"): build_batch_meta([([1], 3, 2)], block_size=4)


def dequantized(x, kv_dtype):
    "Independent reference for chapter 09's formats: symmetric, one scale (amax / largest code) per token per head."
    if kv_dtype == "auto": return x
    qmax = 127.0 if kv_dtype == "int8" else 448.0
    scale = x.abs().amax(-1, keepdim=True) / qmax
    y = (x / scale).round().clamp(-127, 127) if kv_dtype == "int8" else (x / scale).to(torch.float8_e4m3fn).float()
    return y * scale


def dequantized_keys(k, kv_dtype):
    """Keys: fp8 stores them turned by the normalised Hadamard matrix (chapter 09's `key_rotation`) and turns them back
    when read; built here by Kronecker products (Sylvester's construction)."""
    if kv_dtype != "fp8": return dequantized(k, kv_dtype)
    H = torch.ones(1, 1)
    while H.shape[0] < k.shape[-1]: H = torch.kron(H, torch.tensor([[1.0, 1.0], [1.0, -1.0]]))
    H = H / k.shape[-1] ** 0.5
    return dequantized(k @ H, kv_dtype) @ H.T


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("layout", ["shuffled", "consecutive"])
@pytest.mark.parametrize("lens, q_lens, decode_group", [
    ([7, 1, 12], [3, 1, 12], 16),                   # prefill chunk after a cached prefix, a lone decode, a whole prompt
    ([5, 9, 16, 2, 11, 3], [1] * 6, 4),              # decodes of different lengths: two padded groups, masked
    ([7, 13, 4, 20, 6], [1, 5, 1, 1, 1], 16),        # mixed: one prefill chunk among decodes
    ([3, 6, 9], [1, 1, 1], 16),                      # decodes already in length order: one group of every row, in order
    ([21], [1], 16),                                 # batch-1 decode
])
def test_paged_attention_matches_contiguous_attention(lens, q_lens, decode_group, layout, kv_dtype):
    """Random K/V in blocks that are out of order (gathered) or consecutive per sequence (viewed in place), NaN
    everywhere else, including the unused tail of each last block: same output as `attend` on contiguous K/V.
    Quantized pools (chapter 09, NaN scales where nothing was written): same as `attend` on dequantized K/V."""
    from types import SimpleNamespace
    from minfer.model import attend
    g = torch.Generator().manual_seed(0)
    bs, H, Hq, D = 4, 2, 6, 8
    nblocks = sum(-(-n // bs) for n in lens) + 3  # spare blocks stay NaN; padding may point at them
    cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=H, head_dim=D)
    if kv_dtype == "auto":
        cache = PagedKVCache(cfg, nblocks, bs)
        cache.k.fill_(float("nan")), cache.v.fill_(float("nan"))
    else:
        from minfer.kvquant import QuantizedKVCache
        cache = QuantizedKVCache(cfg, nblocks, bs, kv_dtype=kv_dtype)
        cache.k_scale.fill_(float("nan")), cache.v_scale.fill_(float("nan"))
    ids = torch.randperm(nblocks, generator=g).tolist() if layout == "shuffled" else list(range(nblocks))
    tables, seqs, ks, vs, qs = [], [], [], [], []
    for n, nq in zip(lens, q_lens):
        nb = -(-n // bs); tables.append(ids[:nb]); ids = ids[nb:]
        k, v, q = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g), torch.randn(nq, Hq, D, generator=g)
        slots = torch.tensor(BlockTable.slots(SimpleNamespace(blocks=tables[-1], block_size=bs), 0, n - nq))
        if len(slots): cache.store(0, slots, k[:n - nq], v[:n - nq])
        seqs.append((tables[-1], n - nq, nq)); ks.append(k); vs.append(v); qs.append(q)
    attn = PagedAttention(cache)
    attn.decode_group = decode_group
    attn = attn.bind(build_batch_meta(seqs, bs))
    new_k, new_v = torch.cat([k[n - nq:] for k, n, nq in zip(ks, lens, q_lens)]), torch.cat([v[n - nq:] for v, n, nq in zip(vs, lens, q_lens)])
    out = attn(0, torch.cat(qs), new_k, new_v)
    ref = torch.cat([attend(q, dequantized_keys(k, kv_dtype), dequantized(v, kv_dtype))
                     for q, k, v in zip(qs, ks, vs)])
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_an_unbound_backend_says_so_in_one_line(backend):
    "A backend called without a step's batch (`bind(meta)`) refuses in one line naming the fix, for every backend."
    from types import SimpleNamespace
    from minfer.paged import attention_backend
    cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=2, head_dim=8)
    attn = attention_backend(backend, PagedKVCache(cfg, 4, 4))
    q, k = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    with pytest.raises(RuntimeError, match=r"bind\(meta\)") as e:
        attn(0, q, k, k)
    assert "\n" not in str(e.value)
    bound = attn.bind(build_batch_meta([([0], 0, 1)], 4))
    assert bound(0, q, k, k).shape == q.shape and attn.meta is None  # the step's copy holds the batch, not the backend


# ---------------------------------------------------------------- radix unit tests
def test_radix_match_insert_split_and_evict_order():
    a = BlockAllocator(10, block_size=2)
    r = RadixCache(a)
    t = BlockTable(a); t.append_slots(6)
    assert r.insert(list("abcdef"), t.blocks) == (0, r.match_prefix(list("abcdef"))[2])
    t.free()                                   # the tree now holds the 3 blocks alone
    assert a.num_free == 7 and r.num_blocks == 3
    blocks, n, node = r.match_prefix(list("abcdxy"))
    assert n == 4 and blocks == r.match_prefix(list("abcd"))[0] and len(node.key) == 4  # split after 2 blocks
    assert r.match_prefix(list("abc"))[1] == 2 and r.match_prefix(list("x"))[1] == 0
    u = BlockTable(a, blocks, 4); u.append_slots(2)
    r.insert(list("abcdxy"), u.blocks); u.free()
    r.match_prefix(list("abcdef"))             # "ef" is now more recent than "xy"
    assert r.evict(1) == 1 and r.match_prefix(list("abcdxy"))[1] == 4 and r.match_prefix(list("abcdef"))[1] == 6
    r.lock(r.match_prefix(list("abcdef"))[2])
    assert r.evict(10) == 0 and r.num_blocks == 3  # everything left is on the locked path


def test_eviction_is_least_recently_used_first():
    a = BlockAllocator(6, block_size=1)
    r = RadixCache(a)
    stamps = []
    for s in ("ab", "cd", "ef"):
        t = BlockTable(a); t.append_slots(2); stamps.append(r.insert(list(s), t.blocks)[1].last_access); t.free()
    assert stamps == sorted(set(stamps)), "each new leaf must be newer than the last"
    r.match_prefix(list("ab"))                 # now "cd" is the oldest, then "ef"
    assert r.evict(2) == 2 and r.match_prefix(list("cd"))[1] == 0 and r.match_prefix(list("ab"))[1] == 2
    assert r.evict(2) == 2 and r.match_prefix(list("ef"))[1] == 0 and r.match_prefix(list("ab"))[1] == 2


def test_parent_becomes_evictable_when_its_last_child_goes():
    a = BlockAllocator(6, block_size=1)
    r = RadixCache(a)
    for s in ("ab", "ac"):
        t = BlockTable(a); t.append_slots(2); r.insert(list(s), t.blocks); t.free()
    assert r.num_blocks == 3  # a -> {b, c}
    assert r.evict(3) == 3 and r.num_blocks == 0 and a.num_free == 6


def test_allocation_evicts_from_the_cache_before_running_out():
    a = BlockAllocator(4, block_size=2)
    r = RadixCache(a)
    t = BlockTable(a); t.append_slots(8); r.insert(list("abcdefgh"), t.blocks); t.free()
    assert a.num_free == 0
    u = BlockTable(a); u.append_slots(3)      # 2 blocks: the LRU leaf goes (one edge of 4 blocks here)
    assert a.num_free + len(u.blocks) + r.num_blocks == 4
    r.lock(r.match_prefix(list("ab"))[2]) if r.num_blocks else None
    u.free()


# ---------------------------------------------------------------- property-based state machine
TOKENS = st.integers(0, 1)  # a small alphabet, so prefixes are shared often


def fingerprint(tokens, p): return hash(tuple(tokens[:p + 1]))


class PagedRadixMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 16), block_size=st.integers(1, 3))
    def setup(self, num_blocks, block_size):
        self.alloc = BlockAllocator(num_blocks, block_size)
        self.radix = RadixCache(self.alloc)
        self.pool = [[None] * block_size for _ in range(num_blocks)]
        self.seqs = {}   # id -> [table, tokens, locked node or None]
        self.next_id = 0
        self.evicted_locked = False

    def _write(self, table, tokens, start):
        "Append tokens[start:] to a table the way the engine does: reserve slots, copy-on-write, then write KV."
        for src, dst in table.append_slots(len(tokens) - start):
            self.pool[dst] = list(self.pool[src])
        bs = self.alloc.block_size
        for p, s in zip(range(start, len(tokens)), table.slots(start, len(tokens))):
            self.pool[s // bs][s % bs] = fingerprint(tokens, p)

    def _just_used(self, node):
        "The path just matched or inserted is the most recently used in the tree (what LRU eviction relies on)."
        if node is not self.radix.root:
            assert all(node.last_access >= x.last_access for x in self.radix.nodes()), "LRU order is wrong"

    def _snapshot(self):
        return (list(self.alloc.free_ids), list(self.alloc.refcount), self.radix.num_blocks)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), cut=st.integers(0, 12), tail=st.lists(TOKENS, max_size=6))
    def new_sequence_sharing_a_prefix(self, data, cut, tail):
        "A request that starts like a live one (a shared system prompt, the next turn of a chat): splits locked edges."
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens = self.seqs[sid][1][:cut] + tail
        if tokens: self.new_sequence(tokens, True)

    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=12), use_cache=st.sampled_from([True, True, True, False]))
    def new_sequence(self, tokens, use_cache):
        node = None
        if use_cache:
            table, node = self.radix.admit(tokens)  # the engine's admit path
        else:
            table = BlockTable(self.alloc)
        start = table.num_tokens
        before = (list(table.blocks), table.num_tokens)
        try:
            self._write(table, tokens, start)
        except OutOfBlocks:
            assert (list(table.blocks), table.num_tokens) == before
            if node is not None: self.radix.unlock(node)
            table.free()
            return
        self.seqs[self.next_id] = [table, list(tokens), node]
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), more=st.lists(TOKENS, min_size=1, max_size=6))
    def append(self, data, more):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        table, tokens, _ = self.seqs[sid]
        before = self._snapshot() + (list(table.blocks), table.num_tokens)
        try:
            self._write(table, tokens + more, len(tokens))
        except OutOfBlocks:
            # nothing changed, except that the evictor may have dropped cache entries
            after = self._snapshot() + (list(table.blocks), table.num_tokens)
            assert after[3:] == before[3:]
            return
        tokens += more

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        table, tokens, node = self.seqs[sid]
        if node is not None: self.radix.lock(node)
        self.seqs[self.next_id] = [table.fork(), list(tokens), node]
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), cache_it=st.booleans())
    def finish(self, data, cache_it):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        table, tokens, node = self.seqs.pop(sid)
        if cache_it:
            _, leaf = self.radix.insert(tokens[:table.num_tokens], table.blocks)
            self._just_used(leaf)
        if node is not None: self.radix.unlock(node)
        table.free()

    @rule(data=st.data(), cut=st.integers(0, 12), tail=st.lists(TOKENS, max_size=4))
    def match_near_a_live_sequence(self, data, cut, tail):
        if not self.seqs: return
        self.match(self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))][1][:cut] + tail)

    @rule(tokens=st.lists(TOKENS, max_size=14))
    def match(self, tokens):
        blocks, n, node = self.radix.match_prefix(tokens)
        self._just_used(node)
        bs = self.alloc.block_size
        assert n % bs == 0 and n <= len(tokens) and len(blocks) == n // bs
        for p in range(n):
            assert self.pool[blocks[p // bs]][p % bs] == fingerprint(tokens, p), "cache returned KV of another prefix"
        # the longest: the next block of tokens is not cached under this node
        assert n + bs > len(tokens) or tuple(tokens[n:n + bs]) not in node.children

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        locked = [(x, list(x.blocks)) for x in self.radix.nodes() if x.lock_ref > 0]
        free_before = self.alloc.num_free
        freed = self.radix.evict(n)
        assert self.alloc.num_free == free_before + freed
        assert freed >= n or self.radix.evictable_blocks() == 0
        for x, blocks in locked:
            assert x.parent is not None and all(self.alloc.refcount[b] > 0 for b in blocks), "evicted a locked node"

    @invariant()
    def books_balance(self):
        a = self.alloc
        holders = [0] * a.num_blocks
        for table, tokens, _ in self.seqs.values():
            for b in table.blocks: holders[b] += 1
        tree_blocks = [b for x in self.radix.nodes() for b in x.blocks]
        assert len(tree_blocks) == len(set(tree_blocks)), "one block cached twice"
        for b in tree_blocks: holders[b] += 1
        assert holders == a.refcount, "refcount != number of holders"
        free = list(a.free_ids)
        assert len(free) == len(set(free)) and a.num_free + a.num_used == a.num_blocks
        assert all(a.refcount[b] == 0 for b in free) and sum(r > 0 for r in a.refcount) == a.num_used

    @invariant()
    def contents_are_right(self):
        bs = self.alloc.block_size
        for table, tokens, _ in self.seqs.values():
            assert table.num_tokens == len(tokens) and len(table.blocks) == -(-len(tokens) // bs)
            for p in range(table.num_tokens):
                b = table.blocks[p // bs]
                assert self.pool[b][p % bs] == fingerprint(tokens, p), "a sequence's KV was overwritten"

        def walk(node, prefix):
            for first, child in node.children.items():
                assert child.parent is node and child.key[:bs] == first and len(child.key) == len(child.blocks) * bs > 0
                assert child.lock_ref <= (node.lock_ref if node is not self.radix.root else child.lock_ref)
                path = prefix + list(child.key)
                for i, b in enumerate(child.blocks):
                    for o in range(bs):
                        p = len(prefix) + i * bs + o
                        assert self.pool[b][o] == fingerprint(path, p), "a cached block was overwritten"
                walk(child, path)
        walk(self.radix.root, [])

    @invariant()
    def locks_are_counted(self):
        expect = {}
        for _, _, node in self.seqs.values():
            while node is not None and node is not self.radix.root:
                expect[id(node)] = expect.get(id(node), 0) + 1
                node = node.parent
        for x in self.radix.nodes(): assert x.lock_ref == expect.get(id(x), 0), x

    def teardown(self):
        for sid in list(self.seqs): self._finish(sid)
        self.radix.evict(self.alloc.num_blocks)
        assert self.radix.num_blocks == 0 and self.alloc.num_free == self.alloc.num_blocks, "blocks leaked"
        assert all(r == 0 for r in self.alloc.refcount)

    def _finish(self, sid):
        table, tokens, node = self.seqs.pop(sid)
        self.radix.insert(tokens[:table.num_tokens], table.blocks)
        if node is not None: self.radix.unlock(node)
        table.free()


PagedRadixMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
test_paged_radix_invariants = PagedRadixMachine.TestCase


# ---------------------------------------------------------------- generation: same tokens as the contiguous cache
from minfer.kvcache import ContiguousKVCache, cached_generate  # noqa: E402
from minfer.model import NoCache, load_model  # noqa: E402
from minfer.gguf import default_model_dir  # noqa: E402
from minfer.tokenizer import Tokenizer
from minfer.sampling import SamplingParams, sample  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model(default_model_dir())


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(default_model_dir())


def assert_same_greedy(model, prompt, got, ref):
    "Equal, or the first difference is at a near-tie of the reference's logits (batching changes summation order)."
    if got == ref: return
    i = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b) if any(a != b for a, b in zip(got, ref)) else min(len(got), len(ref))
    assert i < min(len(got), len(ref)), f"lengths differ without a divergence: {got} vs {ref}"
    with torch.inference_mode():
        ids = list(prompt) + ref[:i]
        top2 = model(torch.tensor(ids), torch.arange(len(ids)), NoCache(), logits_rows=[-1])[0].topk(2).values
    assert float(top2[0] - top2[1]) < 1e-3, f"diverged at token {i} without a near-tie: {got} vs {ref}"


@torch.inference_mode()
def contiguous_sampled(model, prompt, params, seed, n):
    """Independent reference for a sampled sequence: contiguous cache, one sequence, token k drawn with a generator
    seeded by (seed, k) as chapter 02c specifies (seed * 1_000_003 + k, modulo 2**63)."""
    cache = ContiguousKVCache(model.cfg, len(prompt) + n)
    tokens, out = list(prompt), []
    for k in range(n):
        logits = model(torch.tensor(tokens), torch.arange(cache.length, cache.length + len(tokens)), cache, logits_rows=[-1])
        cache.advance(len(tokens))
        g = torch.Generator().manual_seed((seed * 1_000_003 + k) % 2**63)
        out.append(sample(logits[0], params, g)); tokens = out[-1:]
    return out


PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time, in a land far, far away,"]


def test_paged_greedy_equals_contiguous_including_forks(model, tok):
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode("one two three four five six seven eight")[:8]]  # ends on a block edge
    params = [SamplingParams(max_tokens=7, n=2), SamplingParams(max_tokens=4), SamplingParams(max_tokens=6, n=3), SamplingParams(max_tokens=5, n=2)]
    cache = PagedKVCache(model.cfg, num_blocks=40, block_size=4)
    outs = paged_generate(model, prompts, params, cache=cache)
    for p, sp, group in zip(prompts, params, outs):
        assert len(group) == sp.n
        ref = cached_generate(model, p, sp.max_tokens)
        for s in group: assert_same_greedy(model, p, s.output_ids, ref)
    assert cache.allocator.num_free == cache.allocator.num_blocks  # every block back


def test_sampled_forks_diverge_and_match_independent_references(model, tok):
    "Forks that write different tokens into a shared block: a missing copy-on-write would corrupt a sibling's KV."
    prompt = tok.encode("My favourite animal is the")  # 6 tokens: the last block (block_size 4) is shared, half full
    sp = SamplingParams(temperature=1.0, top_k=40, seed=11, max_tokens=8, n=3)
    group = paged_generate(model, [prompt], sp, block_size=4)[0]
    outs = [s.output_ids for s in group]
    assert len({tuple(o) for o in outs}) > 1, "the samples did not diverge: this test would not see a missing copy"
    for j, o in enumerate(outs): assert o == contiguous_sampled(model, prompt, sp, 11 + j, 8), j


def test_out_of_blocks_is_raised_and_nothing_leaks(model, tok):
    cache = PagedKVCache(model.cfg, num_blocks=3, block_size=4)
    with pytest.raises(OutOfBlocks):
        paged_generate(model, [tok.encode(p) for p in PROMPTS], SamplingParams(max_tokens=4), cache=cache)
    assert cache.allocator.num_free == 3 and cache.allocator.refcount == [0, 0, 0]
    gen = RadixGenerator(model, cache=cache, block_size=4)
    gen.generate([tok.encode("Hi")], SamplingParams(max_tokens=2))              # fits: now cached
    with pytest.raises(OutOfBlocks):
        gen.generate([tok.encode(PROMPTS[2])], SamplingParams(max_tokens=4))
    assert all(x.lock_ref == 0 for x in gen.radix.nodes())
    assert cache.allocator.num_free + gen.radix.num_blocks == 3
    s = gen.generate([tok.encode("Hi")], SamplingParams(max_tokens=2))[0][0]    # still usable afterwards
    assert s.output_ids == cached_generate(model, tok.encode("Hi"), 2)


def test_radix_cache_is_lossless(model, tok):
    "Re-sent prompt, prefix of a cached prompt, full hit, extension, forks on a hit: tokens as with no cache."
    gen = RadixGenerator(model, num_blocks=48, block_size=4)
    base = tok.encode("The three primary colors are red, yellow and")
    first = gen.generate([base], SamplingParams(max_tokens=5))[0][0]
    assert first.metrics.num_cached_tokens == 0
    cases = [("re-sent", base, 1), ("prefix", base[:6], 1), ("full hit", base[:8], 1),
             ("extends", base + first.output_ids + tok.encode(" And the sky"), 1), ("forks on a hit", base, 2)]
    for name, p, n in cases:
        group = gen.generate([p], SamplingParams(max_tokens=5, n=n))[0]
        ref = cached_generate(model, p, 5)
        for s in group: assert_same_greedy(model, p, s.output_ids, ref)
        cached = group[0].metrics.num_cached_tokens
        assert 0 < cached < len(p), (name, cached)
        if name == "full hit": assert cached == 7
        if name == "extends": assert cached >= 12  # the prompt's and the answer's whole blocks
    assert all(x.lock_ref == 0 for x in gen.radix.nodes())
    a = gen.cache.allocator
    assert a.num_free + gen.radix.num_blocks == a.num_blocks and all(a.refcount[b] == 1 for x in gen.radix.nodes() for b in x.blocks)


def test_radix_generator_evicts_when_the_pool_is_short(model, tok):
    gen = RadixGenerator(model, num_blocks=10, block_size=4)  # 40 tokens: every request evicts earlier ones
    for p in PROMPTS + [PROMPTS[0], "Water boils at"]:
        ids = tok.encode(p)
        s = gen.generate([ids], SamplingParams(max_tokens=4))[0][0]
        assert s.output_ids == cached_generate(model, ids, 4), p
    a = gen.cache.allocator
    assert a.num_free + gen.radix.num_blocks == a.num_blocks
    cached = gen.radix.num_blocks
    assert gen.radix.evict(a.num_blocks) == cached  # nothing running: every cached block goes back
    assert a.num_free == a.num_blocks


# ---------------------------------------------------------------- the stepper, headless
def test_stepper_steps_and_draws():
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from minfer.paged import draw_block_map
    from minfer.radix import draw_stepper, draw_tree, stepper_start, stepper_step
    sys_ = "you are a bot .".split()
    reqs = [sys_ + ["hi"], sys_ + ["yo", "!"], "a b c d e f g h".split(), sys_ + ["hi"]]
    s0 = stepper_start(reqs, num_blocks=6, block_size=2)
    states = [s0]
    for _ in range(len(reqs) + 1): states.append(stepper_step(states[-1]))
    assert s0.step == 0 and not s0.log and s0.radix.num_blocks == 0, "step must not change the state it was given"
    log = states[-1].log
    # request 2 (4 blocks) evicts the two LRU leaves; request 3 locks the cached "you are a bot" and evicts request 2's leaf
    assert [e["cached"] for e in log] == [0, 4, 0, 4] and [e["computed"] for e in log] == [6, 3, 8, 2]
    assert [e["evicted"] for e in log] == [0, 0, 2, 4]
    assert states[-1] is states[-2]                    # past the end: nothing to do
    a = states[-1].allocator
    assert a.num_free + states[-1].radix.num_blocks == a.num_blocks
    assert len(states[-1].history) == len(reqs) + 1
    for fig in (draw_stepper(states[2]), draw_stepper(s0), draw_tree(states[3].radix), draw_block_map(states[-1].history)):
        assert isinstance(fig, Figure)


def test_stepper_widget_clicks():
    pytest.importorskip("ipywidgets")
    import matplotlib
    matplotlib.use("Agg")
    from minfer.radix import radix_stepper
    w = radix_stepper([list("abcd"), list("abce"), list("xyz")], num_blocks=4, block_size=2)
    nxt, reset = w.children[0].children
    assert (nxt.description, reset.description) == ("next request", "reset")
    for _ in range(4): nxt.click()
    reset.click()
