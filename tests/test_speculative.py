"""Chapter 10: speculative decoding.

References: vLLM's published n-gram cases; chapter 02a's `cached_generate` run alone for greedy outputs (through
test_engine's `assert_solo`, which allows a divergence only at a near-tie); the target distribution itself for the
rejection sampler (histograms over growing sample sizes, as vLLM's test_rejection_sampler does). The property test
drives random arrivals, aborts, budgets and pools with speculation and checks that no KV block leaks.
"""
import itertools, json, random, subprocess, sys
from pathlib import Path
import pytest, torch
from hypothesis import given, settings, HealthCheck, strategies as st

from minfer.engine import LLMEngine, EngineConfig
from minfer.speculative import SPECULATORS, SpeculativeConfig
from minfer.llm import LLM
from minfer.sequence import Sequence, SamplingParams
from minfer.speculative import ngram_propose, rejection_sample, speculation_lengths, expected_tokens
from minfer.step_times import step_time
from test_engine import TEXTS, assert_solo, greedy, pool, run

# prompts whose continuations repeat what came before: prompt lookup has something to find
REPEATS = ["1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,", "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
           "the cat sat on the mat. the cat sat on the mat. the cat sat on the", "a b c d a b c d a b c d a b"]


# ---- the n-gram proposer -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,k,lo,hi,want", [
    ([1, 2, 3, 4, 1, 2, 3], 2, 3, 4, [4, 1]),                  # vLLM's published cases
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 2, 3, 4, [1, 2]),
    ([1, 2, 3, 4, 5, 6], 2, 3, 4, []),                         # no suffix seen before
    ([1, 2, 3, 1, 2, 3], 3, 3, 4, [1, 2, 3]),
    ([5, 1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 2, [9, 1]),           # the earliest of several matches
    ([1, 2, 3, 8, 2, 3, 9, 1, 2, 3], 1, 2, 3, [8]),            # the longest suffix wins over a later shorter one
    ([7, 7], 4, 1, 3, [7]),                                    # runs out of tokens
])
def test_ngram_vllm_rule(tokens, k, lo, hi, want):
    assert ngram_propose(tokens, k, lo, hi) == want


# ---- greedy: the same tokens as decoding without speculation -------------------------------------------------
def spec_engine(model, k=4, blocks=200, block_size=16, budget=256, adaptive=False, **kw):
    "An engine with prompt lookup attached, as the `speculative` switch attaches it (chapter 10a)."
    engine = LLMEngine(model, block_size=block_size, kv_cache_bytes=pool(model, blocks, block_size),
                       max_num_batched_tokens=budget, **kw)
    spec = SpeculativeConfig("ngram", k, 2, 4, adaptive=adaptive)
    engine.lookahead = SPECULATORS["ngram"](spec, engine)
    return engine

@pytest.mark.parametrize("k,budget,blocks,block_size", [(4, 256, 200, 16), (1, 256, 200, 16), (8, 7, 200, 16),
                                                        (4, 24, 14, 4), (8, 64, 60, 2)],
                         ids=["k4", "k1", "k8-tiny-chunks", "preempting", "k8-small-blocks"])
def test_batch_greedy_equals_solo(model, tokenizer, k, budget, blocks, block_size):
    "Mixed prompts in one continuous batch (prefill chunks beside verifies): every output equals its solo decode."
    seqs = [greedy(tokenizer.encode(t), 12, tokenizer) for t in REPEATS + TEXTS[:4]]
    eng = spec_engine(model, k, blocks, block_size, budget)
    for s in seqs: eng.add(s)
    run(eng)
    for s in seqs:
        assert s.finish_reason == "length" and len(s.output_ids) == 12
        assert_solo(model, s)
    assert any(s.metrics.as_dict()["acceptance_rate"] for s in seqs)  # speculation did happen and paid
    assert eng.cache.allocator.num_free == eng.cache.num_blocks
    if blocks == 14: assert eng.stats["preemptions"] > 0

@pytest.mark.parametrize("switches", [dict(), dict(kernels="cpu", prefix_cache=True)], ids=["step", "cpu-prefix-cache"])
def test_llm_greedy_identical_with_stops_and_lengths(model_dir, switches):
    "Through the LLM API: same tokens, text and finish reasons, incl. stop strings and EOS inside an accepted run."
    plain = LLM(model_dir, **switches)
    spec = LLM(model_dir, speculative={"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2},
               **switches)
    prompts = REPEATS + ["What is the capital of France?"]
    for params in [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 5, 23)] + [
            SamplingParams(max_tokens=40, stop=[" 4,"]), SamplingParams(max_tokens=40, stop=["mat"]),
            SamplingParams(max_tokens=40, stop=["d a"]), SamplingParams(max_tokens=60)]:
        want = plain.generate(prompts, params, raw=True)
        got = spec.generate(prompts, params, raw=True)
        for w, g in zip(want, got):
            assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), params
    radix = spec.engine.scheduler.radix
    assert spec.engine.cache.allocator.num_used == (radix.num_blocks if radix else 0)
    m = spec.generate(REPEATS[0], SamplingParams(max_tokens=20, ignore_eos=True), raw=True)[0].metrics
    assert m["tokens_per_pass"] > 1.5

def test_logprobs_with_speculation(model_dir):
    plain, spec = LLM(model_dir), LLM(model_dir, speculative="ngram")
    p = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    w, g = plain.generate(REPEATS[2], p, raw=True)[0], spec.generate(REPEATS[2], p, raw=True)[0]
    assert g.token_ids == w.token_ids
    for a, b in zip(w.samples[0].logprobs, g.samples[0].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-3 for t in a)

@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.data())
def test_random_arrivals_and_aborts_no_leak(model, tokenizer, data):
    "Random arrivals, aborts, budgets, pools, k: after every step each table holds exactly its computed tokens' blocks;"
    " at the end every block is free (or held by the prefix cache) and every output equals its solo decode."
    budget, blocks = data.draw(st.integers(4, 48), "budget"), data.draw(st.integers(12, 30), "blocks")
    prefix, k = data.draw(st.booleans(), "prefix_cache"), data.draw(st.sampled_from([1, 2, 4, 8]), "k")
    eng = spec_engine(model, k, blocks, 4, budget, adaptive=data.draw(st.booleans(), "adaptive"), prefix_cache=prefix,
                      max_num_seqs=data.draw(st.integers(1, 6)))
    texts = REPEATS + TEXTS[:3]
    pending = [greedy(tokenizer.encode(texts[data.draw(st.integers(0, len(texts) - 1))]), data.draw(st.integers(1, 9)),
                      tokenizer) for _ in range(data.draw(st.integers(1, 6)))]
    added, aborted = [], set()
    a = eng.cache.allocator
    for _ in range(300):
        if pending and data.draw(st.booleans()): s = pending.pop(0); eng.add(s); added.append(s)
        live = [s for s in added if not s.finished]
        if live and data.draw(st.integers(0, 9)) == 0:
            victim = data.draw(st.sampled_from(live)); eng.abort(victim.id); aborted.add(victim.id)
        if eng.has_unfinished(): eng.step()
        elif not pending: break
        for s in eng.scheduler.running:
            assert s.block_table.num_tokens == s.num_computed
            assert len(s.block_table.blocks) == a.blocks_needed(s.num_computed)
    run(eng)
    held_by_tree = eng.scheduler.radix.num_blocks if prefix else 0
    assert a.num_used == held_by_tree and a.num_free + a.num_used == a.num_blocks
    for s in added:
        assert s.finished
        if s.id in aborted: assert s.status == "aborted"; continue
        assert len(s.output_ids) == s.params.max_tokens
        assert_solo(model, s)


# ---- stochastic: the rejection sampler keeps the target distribution --------------------------------------------
def tv(a, b): return 0.5 * (a - b).abs().sum().item()

@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-q", "ngram-one-hot"])
def test_rejection_sampler_converges_to_target(one_hot):
    "vLLM-style: small vocabulary, random p and q, k = 3; the histogram of each output position converges to p."
    torch.manual_seed(1)
    V, k = 6, 3
    p = torch.softmax(torch.randn(k + 1, V) * 1.3, -1)  # the target, per position (independent of the guesses here)
    q = torch.softmax(torch.randn(k, V) * 1.3, -1)
    if one_hot: q = torch.nn.functional.one_hot(torch.tensor([0, 1, 2]), V).float()  # fixed guesses 0, 1, 2
    distances = []
    for n in (100, 1000, 10000):
        g = torch.Generator().manual_seed(n)
        counts = torch.zeros(k + 1, V)
        for i in range(n):
            drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(k)]
            gens = [torch.Generator().manual_seed(n * 1000003 + i * 7 + j) for j in range(k + 1)]
            out = rejection_sample(p, drafts, None if one_hot else q, gens)
            for j, t in enumerate(out): counts[j, t] += 1
        # position 0 always exists: its marginal must be p[0]; later positions are conditioned on acceptance, and
        # then (target independent of the prefix) distributed as p[j] as well
        distances.append([tv(counts[j] / counts[j].sum(), p[j]) for j in range(k + 1) if counts[j].sum() >= n / 20])
    first = [d[0] for d in distances]
    assert first[0] > first[-1] and first[-1] < 0.02, distances
    assert max(distances[-1]) < 0.06, distances

def test_seeded_sampling_is_deterministic_and_batch_independent(model_dir):
    spec = LLM(model_dir, speculative={"method": "ngram", "prompt_lookup_min": 2})
    p = SamplingParams(temperature=0.8, seed=123, max_tokens=24, ignore_eos=True)
    alone = spec.generate(REPEATS[0], p, raw=True)[0].token_ids
    assert spec.generate(REPEATS[0], p, raw=True)[0].token_ids == alone
    batched = spec.generate([REPEATS[1], REPEATS[0], TEXTS[0]], [SamplingParams(temperature=0.8, seed=5, max_tokens=24),
                                                                 p, SamplingParams(max_tokens=7)], raw=True)
    assert batched[1].token_ids == alone
    assert spec.generate(REPEATS[0], SamplingParams(temperature=0.8, seed=124, max_tokens=24, ignore_eos=True),
                         raw=True)[0].token_ids != alone

def test_engine_stochastic_first_token_distribution(model, tokenizer):
    "End to end through the engine, with guesses: the distribution of a token after an accepted run is the target's."
    ids = tokenizer.encode(REPEATS[3])
    with torch.inference_mode():
        from minfer.kvcache import ContiguousKVCache
        cache = ContiguousKVCache(model.cfg, len(ids))
        logits = model(torch.tensor(ids), torch.arange(len(ids)), cache, logits_rows=[-1])[0]
    params = SamplingParams(temperature=1.5, top_k=5, max_tokens=2, ignore_eos=True)
    from minfer.sampling import sampling_probs
    target = sampling_probs(logits, params)
    eng = spec_engine(model, k=2)
    counts, n = torch.zeros_like(target), 300
    seqs = [Sequence(ids, SamplingParams(**{**params.__dict__, "seed": i}), tokenizer) for i in range(n)]
    for s in seqs: eng.add(s)
    run(eng)
    for s in seqs: counts[s.output_ids[0]] += 1
    assert tv(counts / n, target) < 0.12  # 5 outcomes, 300 draws: noise ~ 0.06


# ---- adaptive k ------------------------------------------------------------------------------------------------
def test_speculation_lengths_is_the_best_choice():
    """Against brute force over every k per sequence: the most expected tokens per unit of step time, the step's time
    being its rows' on the curve plus, where guesses cost model passes, one pass per depth of guessing."""
    rng = random.Random(0)
    for i in range(400):
        batch, pass_cost = rng.randint(1, 4), 0.0 if i % 2 else rng.uniform(0.0, 0.3)
        row_cost = 0.0 if i % 3 else rng.uniform(0.0, 0.1)
        alphas, caps = [rng.random() for _ in range(batch)], [rng.randint(0, 4) for _ in range(batch)]
        rate = lambda ks: (sum(expected_tokens(a, k) for a, k in zip(alphas, ks))
                           / (step_time(batch + sum(ks)) + pass_cost * max(ks) + row_cost * sum(ks)))
        ks = speculation_lengths(alphas, caps, pass_cost=pass_cost, row_cost=row_cost)
        assert all(0 <= k <= c for k, c in zip(ks, caps))
        assert rate(ks) == pytest.approx(max(rate(c) for c in itertools.product(*[range(c + 1) for c in caps])))
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)

def test_speculation_lengths_see_the_batch():
    assert speculation_lengths([0.0], [8]) == [0] and speculation_lengths([1.0], [8]) == [8]
    # a rate that pays alone does not pay in a batch of 8, where a row slows a step that makes 8 tokens
    assert speculation_lengths([0.3], [8])[0] >= 1 and speculation_lengths([0.3] * 8, [8] * 8) == [0] * 8
    # one request that quotes its prompt among seven that do not: the guesses go to it
    ks = speculation_lengths([0.9] + [0.2] * 7, [8] * 8)
    assert ks[0] >= 2 and ks[1:] == [0] * 7
    # guesses that cost a model pass each go less deep: alone at 0.35, an EAGLE head's 6% of a step per pass
    assert speculation_lengths([0.35], [6]) == [3] and speculation_lengths([0.35], [6], pass_cost=0.06) == [2]

def test_a_first_guess_pays_for_the_rows_its_proposer_reruns():
    """A head or draft that has not run for a sequence since its prompt (or a stretch without guesses) re-runs those
    positions before its first guess: rows that pays for. At batch 8 guesses of 0.9 pay on the chapter's curve; when
    each sequence's first guess must first re-run 48 positions, none does. Alone at 0.3 a guess pays, not after a
    48-row re-run; at 0.5 it pays even then."""
    costs = dict(pass_cost=0.03, row_cost=0.012)
    assert sum(speculation_lengths([0.9] * 8, [4] * 8, **costs)) > 0
    assert speculation_lengths([0.9] * 8, [4] * 8, **costs, catch_up=[48] * 8) == [0] * 8
    mixed = speculation_lengths([0.9] * 8, [4] * 8, **costs, catch_up=[48] + [0] * 7)
    assert mixed[0] == 0 and sum(mixed[1:]) > 0  # the guesses go to the sequences that need no re-run
    assert speculation_lengths([0.3], [4], **costs)[0] > 0
    assert speculation_lengths([0.3], [4], **costs, catch_up=[48]) == [0]
    assert speculation_lengths([0.5], [4], **costs, catch_up=[48])[0] > 0

def test_adaptive_greedy_equals_plain(model_dir):
    plain, spec = LLM(model_dir), LLM(model_dir, speculative={"method": "ngram", "num_speculative_tokens": 8,
                                                              "adaptive": True})
    p = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = REPEATS + TEXTS[:3]
    want = [o.token_ids for o in plain.generate(prompts, p, raw=True)]
    assert [o.token_ids for o in spec.generate(prompts, p, raw=True)] == want


# ---- this machine's curve -------------------------------------------------------------------------------------
def test_adaptive_k_reads_this_machines_curve_measured_once(model_dir, tmp_path, monkeypatch):
    """The first adaptive engine measures the verify-step curve on this machine (one sequence, then 8) and keeps it
    under data_dir(), keyed by machine and runner; the next reads it; `remeasure` and an unreadable table measure
    again. The curve is time in one-row steps: 1 at one row, and a 72-row step costs more than a one-row one."""
    import minfer.step_times as st
    monkeypatch.setenv("MINFER_HOME", str(tmp_path))
    llm = LLM(model_dir, speculative="ngram")  # named alone: adaptive
    spec = llm.engine.lookahead
    assert llm.config.speculative.adaptive and spec.pass_cost == spec.row_cost == 0.0
    table = json.loads((tmp_path / "step_times.json").read_text())
    [(key, entry)] = table.items()
    assert key.startswith(st.machine_name(torch.device("cpu"))) and st.runner_signature(llm.engine.runner) in key
    curve = tuple(map(tuple, entry["curve"]))
    assert spec.curve == curve and curve[0] == (1, 1.0) and [r for r, _ in curve] == [1, 2, 3, 5, 8, 16, 24, 40, 72]
    assert curve[-1][1] > 1.5 and entry["one_row_seconds"] > 0
    def measured(runner):
        raise AssertionError("measured again")
    with monkeypatch.context() as m:  # a second engine reads the table
        m.setattr(st, "measure_step_times", measured)
        assert LLM(model_dir, speculative="ngram").engine.lookahead.curve == curve
        with pytest.raises(AssertionError, match="measured again"):
            st.machine_step_times(llm.engine.runner, remeasure=True)
    (tmp_path / "step_times.json").write_text("{not json")
    assert st.machine_step_times(llm.engine.runner)[0][0] == (1, 1.0)  # measured again, and the table written whole
    assert list(json.loads((tmp_path / "step_times.json").read_text())) == [key]
    # a fixed k measures nothing and reads the chapter's curve; a tree's budget is fixed by default
    fixed = LLM(model_dir, speculative={"method": "ngram", "adaptive": False}).engine.lookahead
    assert fixed.curve == st.STEP_TIMES and not fixed.config.adaptive


def test_a_draft_pass_costs_what_it_takes_here(model_dir, tokenizer):
    """A draft model's one-row pass, timed: the target as its own draft costs about one target step. (Loose bounds:
    the step in the table may have been timed under another load than this pass; the byte share would also say 1.)
    Before its first guess for a sequence it has not seen, the draft re-runs the whole sequence but its last token."""
    llm = LLM(model_dir, speculative={"method": "draft", "model": str(model_dir), "num_speculative_tokens": 2})
    spec = llm.engine.lookahead
    assert 0.25 < spec.pass_cost + spec.row_cost < 4.0 and spec.row_cost >= 0
    seq = Sequence(tokenizer.encode("The capital of France is"), SamplingParams())
    assert spec.proposer.catch_up_rows(seq) == len(seq.token_ids) - 1


# ---- draft model -----------------------------------------------------------------------------------------------
def test_draft_model_greedy_and_stochastic(model_dir, tokenizer):
    "The target itself as its own draft: every greedy guess is right; outputs equal decoding without speculation."
    plain = LLM(model_dir)
    # a fixed k: adaptive k (the default) would rightly make no guesses with a draft that costs a whole step
    spec = LLM(model_dir, speculative={"method": "draft", "model": str(model_dir), "num_speculative_tokens": 3,
                                       "adaptive": False})
    p = SamplingParams(max_tokens=14, ignore_eos=True)
    prompts = [TEXTS[0], TEXTS[2], REPEATS[1]]
    got = spec.generate(prompts, p, raw=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, p, raw=True)]
    assert all(o.metrics["acceptance_rate"] > 0.9 for o in got)
    s = SamplingParams(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True)
    assert spec.generate(TEXTS[0], s, raw=True)[0].token_ids == spec.generate(TEXTS[0], s, raw=True)[0].token_ids
    assert spec.engine.cache.allocator.num_used == 0


# ---- the switch: values, errors, command line ------------------------------------------------------------------
def test_config_values():
    c = EngineConfig(speculative='{"method": "ngram", "num_speculative_tokens": 2}').resolve().speculative
    assert c == SpeculativeConfig("ngram", 2, adaptive=True)  # a chain adapts unless told not to
    assert EngineConfig(speculative="ngram").resolve().speculative.method == "ngram"
    assert EngineConfig().resolve().speculative is None

@pytest.mark.parametrize("value,words", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ("medusa", "'medusa' is not supported"), ({"method": "ngram", "k": 2}, "unknown key 'k'"),
    ("{not json", "not valid JSON"), (3, "is invalid"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_max=2"),
    ({"method": "ngram", "model": "x"}, "is for method 'draft'"),
])
def test_bad_values_one_line(value, words):
    with pytest.raises(ValueError, match=words) as e: EngineConfig(speculative=value).resolve()
    assert "\n" not in str(e.value)

def test_draft_with_another_vocabulary_refused(model_dir, tmp_path):
    for f in Path(model_dir).iterdir(): (tmp_path / f.name).symlink_to(f)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 64}))
    with pytest.raises(ValueError, match="another vocabulary") as e:
        LLM(model_dir, speculative={"method": "draft", "model": str(tmp_path)})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="kv='paged'"): EngineConfig(speculative="ngram", kv="contiguous").resolve()

def test_cli_generate_speculative():
    minfer = str(Path(sys.executable).parent / "minfer")
    r = subprocess.run([minfer, "generate", "--raw", REPEATS[2], "--max-tokens", "12", "--speculative", "ngram",
                        "--metrics"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "acceptance_rate=" in r.stderr and "tokens_per_pass=" in r.stderr
    r = subprocess.run([minfer, "generate", "hi", "--speculative", '{"method": "ngram", "num_speculative_tokens": 0}'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "num_speculative_tokens=0" in r.stderr and len(r.stderr.strip().splitlines()) == 1

@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.85])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_acceptance_counts_read_the_true_rate(alpha, k):
    """Verifies drawn from the geometric model (each guess right with probability alpha until the first wrong one):
    the running counts' ratio, averaged over the run, is alpha within 0.03 at any k. Averaging each verify's own ratio
    would read 0.20 for 0.3 at k = 2 and 0.41 for 0.6 at k = 4 (the ratio bias of counts decayed by 0.8 is 0.02 at
    most). The rate the rule reads adds the prior as one judged guess: the prior before any verify, 0.3 after a
    first verify that rejected its first guess."""
    from minfer.speculative import count_verify, acceptance_rate, PRIOR_ALPHA, PRIOR_WEIGHT, RequestGuesses
    rng, record, ratios = random.Random(k), RequestGuesses(Sequence([1], SamplingParams())), []
    assert acceptance_rate(record) == PRIOR_ALPHA  # nothing judged yet
    count_verify(record, 3, 0)
    assert PRIOR_WEIGHT == 1 and acceptance_rate(record) == pytest.approx(0.3)  # (0 + 0.6) / (1 + 1)
    for _ in range(6000):
        accepted = 0
        while accepted < k and rng.random() < alpha: accepted += 1
        count_verify(record, k, accepted)
        ratios.append(record.accepted / record.judged)
    assert abs(sum(ratios[20:]) / len(ratios[20:]) - alpha) < 0.03

def test_a_probe_comes_where_the_prior_rate_would_earn_a_guess():
    """A request whose rate says no guesses is probed with one guess every 16 tokens only where a request with the
    prior rate would get that guess in this step: alone it is, in a batch of 8 on the measured curve it is not."""
    from minfer.speculative import Speculator, PRIOR_ALPHA, Draft
    from minfer.step_times import STEP_TIMES
    from minfer.speculative import SpeculativeConfig
    class Recorder:
        cheap = False
        def __init__(self): self.ks = None
        def catch_up_rows(self, seq):
            return 0
        def propose(self, seqs, ks):
            self.ks = ks
            return [Draft([]) for _ in seqs]
    def probed(batch):
        spec = Speculator.__new__(Speculator)
        spec.config, spec.proposer, spec.requests = SpeculativeConfig(method="ngram", adaptive=True), Recorder(), {}
        spec.curve, spec.pass_cost, spec.row_cost = STEP_TIMES, 0.0, 0.0  # the curve the test's numbers assume
        seqs = []
        for _ in range(batch):
            s = Sequence([1, 2, 3], SamplingParams(max_tokens=64))
            s.output_ids = list(range(16))
            record = spec.request(s)
            record.accepted, record.judged = 0.0, 100.0  # 16 tokens out, and a rate that earns nothing
            s.num_computed = len(s) - 1
            seqs.append(s)
        spec.propose(seqs)
        return spec.proposer.ks
    assert speculation_lengths([PRIOR_ALPHA], [4]) != [0] and probed(1) == [1]
    assert speculation_lengths([PRIOR_ALPHA] * 8, [4] * 8) == [0] * 8 and probed(8) == [0] * 8
