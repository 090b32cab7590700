import numpy as np
import torch
from minfer.engine import EngineConfig, SpeculativeConfig, speculative_config, build_model, attention_class
from minfer.paged import PagedKVCache, BlockTable, OutOfBlocks, build_batch_meta
from minfer.sampling import sample, sampling_probs, logprob_entries
def ngram_propose(tokens, k, n_min=3, n_max=5):
    """Prompt lookup (vLLM's n-gram rule): the longest suffix of `tokens` of n in [n_min, n_max] tokens that appeared
    earlier, at its earliest match -> up to k tokens that followed it there ([] when no suffix matches)."""
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(arr) - 1), n_min - 1, -1):
        # windows that start before the suffix itself: i + n <= len - 1
        hits = (np.lib.stride_tricks.sliding_window_view(arr[:-1], n) == arr[-n:]).all(1).nonzero()[0]
        if len(hits): return arr[hits[0] + n:hits[0] + n + k].tolist()
    return []

class NgramProposer:
    "Guesses from the sequence itself: no model, no KV; its distribution is one-hot (`draft_probs` None)."
    def __init__(self, config, engine=None): self.config = config
    def propose(self, seqs, ks):
        c = self.config
        for s, k in zip(seqs, ks):
            s.draft_ids = ngram_propose(s.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max) if k else []
            s.draft_probs = None
def rejection_sample(target_probs, draft_ids, draft_probs, generators):
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023). target_probs [k + 1, vocab]: p at each guessed
    position and one more; draft_ids: the k guesses; draft_probs [k, vocab]: the proposer's q (None: one-hot on the
    guess, as for n-gram); generators: k + 1 `torch.Generator`s, one per output position.
    Guess j is accepted with probability min(1, p(d) / q(d)); the first rejected one is replaced by a draw from
    norm(max(0, p - q)); if all are accepted, a bonus token is drawn from the last p. -> the output tokens (1..k + 1)."""
    out = []
    for j, d in enumerate(draft_ids):
        p = target_probs[j]
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        u = float(torch.rand((), generator=generators[j]))
        if u * q_d < float(p[d]):  # u < p/q without dividing by a zero q
            out.append(d)
            continue
        if draft_probs is None: residual = p.clone(); residual[d] = 0  # max(0, p - onehot(d))
        else: residual = (p - draft_probs[j]).clamp_min(0)
        if float(residual.sum()) <= 0: residual = p  # only when p == q, where nothing is ever rejected
        return out + [int(torch.multinomial(residual, 1, generator=generators[j]))]
    return out + [int(torch.multinomial(target_probs[len(draft_ids)], 1, generator=generators[len(draft_ids)]))]
# Cost of one more row in a decode step, relative to a 1-row step (measured in this chapter on the course machine: the
# one-call step streams the weights once for up to 8 rows in fp32, each extra row adding a few percent)
ROW_COST = 0.06

def expected_tokens(alpha, k):
    "Tokens per target pass with k guesses each accepted with probability alpha (i.i.d.): 1 + alpha + ... + alpha^k."
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)

def adaptive_k(alpha, k_max, row_cost=ROW_COST):
    "The k in 0..k_max with the most tokens per unit of step time, 1 + alpha + ... + alpha^k over 1 + row_cost * k."
    return max(range(k_max + 1), key=lambda k: expected_tokens(alpha, k) / (1 + row_cost * k))

def update_alpha(alpha, k, accepted, decay=0.8):
    "A running acceptance rate: the geometric model's estimate from this step (accepted of k, then a rejection), averaged."
    step = accepted / (accepted + (accepted < k))
    return step if alpha is None else decay * alpha + (1 - decay) * step
class Speculator:
    """The engine's half of speculative decoding (chapter 08b calls it): before each step `propose` gives every decoding
    sequence up to k guesses (`seq.draft_ids`), the scheduler runs 1 + k tokens for it, and the runner hands the k + 1
    logits rows to `verify` -> [(seq, token, logprobs)]: the accepted guesses and one token from the target model."""
    def __init__(self, config, engine):
        self.config = speculative_config(config)
        self.proposer = PROPOSERS[self.config.method](self.config, engine)

    def length(self, seq):
        "How many guesses for `seq` now: k, or the adaptive choice, never past its max_tokens / max_len."
        c, room = self.config, min(seq.max_len - len(seq), seq.params.max_tokens - len(seq.output_ids)) - 1
        k = c.num_speculative_tokens
        if c.adaptive:
            k = adaptive_k(0.6 if seq.spec_alpha is None else seq.spec_alpha, k)
            if k == 0 and len(seq.output_ids) % 16 == 0: k = 1  # a probe now and then: acceptance can come back
        return max(0, min(k, room))

    def propose(self, running):
        seqs = [s for s in running if s.num_computed == len(s) - 1 and not s.finished]
        self.proposer.propose(seqs, [self.length(s) for s in seqs])

    def verify(self, seq, logits):
        "logits [k + 1, vocab]: row j is the target's prediction for output position j of this step."
        drafts, params = seq.draft_ids, seq.params
        if params.temperature == 0:  # greedy: accept while the guess is the target's argmax, exactly `sample`'s choice
            out = []
            for j, d in enumerate(drafts + [None]):
                out.append(sample(logits[j], params))
                if out[-1] != d: break
        else:
            probs = torch.stack([sampling_probs(row, params) for row in logits])
            gens = [seq.token_generator(ahead=j) for j in range(len(drafts) + 1)]
            q = None if seq.draft_probs is None else seq.draft_probs[:len(drafts)]
            out = rejection_sample(probs, drafts, q, gens)
        accepted = len(out) - 1
        m = seq.metrics
        m.num_draft_tokens, m.num_accepted_tokens = m.num_draft_tokens + len(drafts), m.num_accepted_tokens + accepted
        seq.spec_alpha = update_alpha(seq.spec_alpha, len(drafts), accepted)
        k = params.logprobs
        entries = [None] * len(out) if k is None else logprob_entries(logits[:len(out)], out, k)
        return [(seq, t, e) for t, e in zip(out, entries)]
class DraftProposer:
    """Guesses from a small model of the same vocabulary, its KV in a paged pool of its own (chapter 03's machinery).
    Per sequence it remembers which tokens its KV holds; each `propose` first catches up on what the target accepted
    (one varlen pass over every sequence), then runs one-row steps for the remaining guesses. Guesses are sampled with
    the request's own sampling parameters (greedy: argmax); their distributions q are kept for the rejection sampler."""
    def __init__(self, config, engine):
        # the draft is built like any model (chapter 08b): its folder's own weight format, the fastest kernels here
        c = EngineConfig(model=config.model, device=engine.model.device.type).resolve()
        self.model, bs = build_model(c), engine.cache.block_size
        pool = engine.cache.num_blocks * PagedKVCache.block_bytes(self.model.cfg, bs, self.model.dtype)
        self.cache = PagedKVCache.from_budget(self.model.cfg, pool, bs, self.model.dtype, self.model.device)
        self.attn = attention_class(c.attention)(self.cache)
        self.tables = {}  # sequence id -> (its BlockTable in the draft's pool, the tokens whose KV that holds)

    def _forward(self, work):
        "work: [(table, start position, tokens)] -> the logits of each one's last token; writes their KV."
        dev = self.model.device
        self.attn.meta = build_batch_meta([(t, s, len(x)) for t, s, x in work], self.cache.block_size, dev)
        tokens = torch.tensor([i for _, _, x in work for i in x], device=dev)
        positions = torch.cat([torch.arange(s, s + len(x), device=dev) for _, s, x in work])
        last = torch.tensor(np.cumsum([len(x) for _, _, x in work]) - 1, device=dev)
        return self.model(tokens, positions, self.attn, logits_rows=last)

    def _catch_up(self, seq, k):
        """-> (table, first position to compute) for `seq` in the draft's pool, its table cut back to the tokens that
        still agree with the sequence and grown for k guesses; None if the draft's pool is full."""
        table, held = self.tables.get(seq.id) or (BlockTable(self.cache.allocator), [])
        ids = seq.token_ids
        same = next((i for i, (a, b) in enumerate(zip(held, ids)) if a != b), min(len(held), len(ids)))
        table.truncate(min(same, table.num_tokens, len(ids) - 1))
        self.tables[seq.id] = (table, ids[:table.num_tokens])
        start = table.num_tokens
        try: table.append_slots(len(ids) + k - 1 - start)
        except OutOfBlocks: return None
        self.tables[seq.id] = (table, ids)
        return table, start

    def propose(self, seqs, ks):
        live = {s.id for s in seqs}
        for sid in [i for i in self.tables if i not in live]: self.tables.pop(sid)[0].free()
        jobs, work = [], []  # (seq, k, table) and what its next draft pass computes
        for s, k in zip(seqs, ks):
            s.draft_ids, s.draft_probs = [], []
            got = self._catch_up(s, k) if k else None
            if got is None: continue
            jobs.append((s, k, got[0]))
            work.append((got[0], got[1], s.token_ids[got[1]:]))
        while jobs:
            for (s, k, t), row in zip(jobs, self._forward(work)):
                p = s.params
                if p.temperature == 0: s.draft_ids.append(int(row.argmax()))
                else:
                    q = sampling_probs(row, p)
                    g = torch.Generator().manual_seed((s.seed * 7_919 + len(s) + len(s.draft_ids)) % 2**63)  # own stream
                    s.draft_ids.append(int(torch.multinomial(q, 1, generator=g)))
                    s.draft_probs.append(q)
            jobs = [(s, k, t) for s, k, t in jobs if len(s.draft_ids) < k]
            work = [(t, len(s) - 1 + len(s.draft_ids), s.draft_ids[-1:]) for s, _, t in jobs]
        for s in seqs:
            s.draft_probs = torch.stack(s.draft_probs) if s.draft_probs else None
            if s.id in self.tables:  # its KV holds the guesses but the last; the next propose keeps what was accepted
                t, ids = self.tables[s.id]
                self.tables[s.id] = (t, ids + s.draft_ids[:-1])

PROPOSERS = {"ngram": NgramProposer, "draft": DraftProposer}
