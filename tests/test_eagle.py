"""Chapter 10b: EAGLE heads.

References: plain decoding (speculative=None) for greedy outputs, with any head (a randomly initialised one, and a tiny
one trained here for a few seconds on the target's answers to these prompts, so that guesses are accepted too); the
target's own distribution for sampled outputs (the style of test_speculative's histogram tests, its `tv`); a fresh run
of the head over the same tokens and the target's features for the head's KV.
"""
import gc
import json
from pathlib import Path
import pytest, torch

from minfer.cli import main as cli_main
from minfer.eagle import (EagleHead, head_config, save_head, load_head, train_head, draft_vocabulary, tap_of,
                          target_features, unroll_head)
from minfer.engine import EngineConfig
from minfer.llm import LLM
from minfer.model import NoCache, attend
from minfer.paged import BlockTable
from minfer.sequence import Sequence, SamplingParams
from test_speculative import REPEATS, tv
from test_engine import TEXTS

PROMPTS = [REPEATS[2], TEXTS[0], "hi", REPEATS[1], TEXTS[2] * 2, "Tell me a story about a dragon.", REPEATS[0], "x"]


SMALL = dict(kv_cache_bytes=2**27)  # 128 MiB pools, not the default 1 GiB: a test's engines stay alive together


@pytest.fixture(autouse=True)
def collect_engines():
    """Free each test's engines when it ends: a proposer and its runner refer to each other (the runner's `run` is
    wrapped), so only the cyclic collector frees them, and a model's tensors are few objects, which do not wake it."""
    yield
    gc.collect()


@pytest.fixture(scope="module")
def plain(model_dir): return LLM(model_dir, **SMALL)

@pytest.fixture(scope="module")
def random_head(plain, tmp_path_factory):
    torch.manual_seed(0)
    return str(save_head(EagleHead(head_config(plain.model.cfg), 512), tmp_path_factory.mktemp("random") / "h",
                         plain.model_dir))

@pytest.fixture(scope="module")
def tiny_head(plain, tmp_path_factory):
    "A head trained for a few seconds on the target's own greedy answers to PROMPTS: it has learnt them by heart."
    torch.manual_seed(0)
    ids = [plain.tokenizer.encode(p) for p in PROMPTS[:4]]
    outs = plain.generate(PROMPTS[:4], SamplingParams(max_tokens=40, ignore_eos=True), raw=True)
    seqs = [p + o.token_ids for p, o in zip(ids, outs)]
    data = [(torch.tensor(s), f, len(p)) for s, f, p in zip(seqs, target_features(plain.model, seqs), ids)]
    head = EagleHead(head_config(plain.model.cfg), 1024).attach(plain.model)
    d2t = draft_vocabulary(data, 1024)
    with torch.no_grad(): head.lm_head.weight.copy_(plain.model.lm_head.weight[d2t]); head.d2t.copy_(d2t)
    train_head(head, data, steps=60, rows=4, length=64, lr=3e-3, noise=0.0)
    return str(save_head(head, tmp_path_factory.mktemp("tiny") / "h", plain.model_dir))


def eagle(model_dir, head, k=3, adaptive=False, **kw):
    "An engine guessing with `head`: k guesses every step unless `adaptive` (the default of a chain, tested apart)."
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": k, "adaptive": adaptive, **kw}
    return LLM(model_dir, speculative=spec, **SMALL)


# ---- greedy: identical to plain decoding, whatever the head ------------------------------------------------------
@pytest.mark.parametrize("which", ["random", "tiny"])
def test_greedy_identical_batch_1_and_8(model_dir, plain, random_head, tiny_head, which):
    head = random_head if which == "random" else tiny_head
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(PROMPTS, p, raw=True)]
    spec = eagle(model_dir, head)
    alone = [spec.generate(x, p, raw=True)[0] for x in PROMPTS[:3]]
    assert [o.token_ids for o in alone] == want[:3]
    batched = spec.generate(PROMPTS, p, raw=True)  # 8 prompts of 1 to ~40 tokens, one continuous batch
    assert [o.token_ids for o in batched] == want
    if which == "tiny":  # the machinery after an accepted guess ran: a head that learnt these answers is often right
        assert sum(o.metrics["acceptance_rate"] for o in batched[:4]) / 4 > 0.2  # the four it learnt
    adaptive = eagle(model_dir, head, k=4, adaptive=True).generate(PROMPTS, p, raw=True)
    assert [o.token_ids for o in adaptive] == want
    assert spec.engine.cache.allocator.num_used == 0
    proposer = spec.engine.lookahead.proposer
    spec.generate("one more", SamplingParams(max_tokens=3))
    assert len(proposer.states) == 1  # the head's KV of finished requests is freed (the last one's at the next step)

def test_greedy_identical_on_the_layers_path_with_prefix_cache(model_dir, plain, tiny_head):
    "kernels='cpu' (features from the last layer's output) and prefix-cache hits (features the target never computed)."
    p = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [TEXTS[0] + " one", TEXTS[0] + " two", REPEATS[2]]
    want = [o.token_ids for o in plain.generate(prompts, p, raw=True)]
    spec = LLM(model_dir, kernels="cpu", prefix_cache=True,
               speculative={"method": "eagle", "model": tiny_head, "num_speculative_tokens": 2, "adaptive": False},
               **SMALL)
    assert [o.token_ids for o in spec.generate(prompts, p, raw=True)] == want
    assert [o.token_ids for o in spec.generate(prompts, p, raw=True)] == want  # now from the prefix cache


# ---- sampled: the target's distribution ---------------------------------------------------------------------------
def test_sampled_distribution_is_the_target(model_dir, plain, tmp_path):
    """The token after the first: guessed by a head that always guesses one token (the target's likeliest there, so
    it is accepted often and rejected often); its histogram over seeds must be the target's distribution."""
    params = SamplingParams(temperature=1.5, top_k=3, max_tokens=2, ignore_eos=True)
    text = "The capital of France is"
    prompt = plain.tokenizer.encode(text)
    from minfer.sampling import sampling_probs
    def target_next(ids):
        with torch.inference_mode():
            logits = plain.model(torch.tensor(ids), torch.arange(len(ids)), NoCache(), logits_rows=[-1])[0]
        return sampling_probs(logits, params)
    first = target_next(prompt)
    likeliest = int(first.argmax())
    guess = int(target_next(prompt + [likeliest]).argmax())
    torch.manual_seed(0)
    head = EagleHead(head_config(plain.model.cfg), 1)
    head.d2t.fill_(guess)  # one draft token: every guess is `guess`
    folder = str(save_head(head, tmp_path / "one-token", plain.model_dir))
    spec = eagle(model_dir, folder, k=1)
    n = 400
    outs = spec.generate([text] * n, [SamplingParams(**{**params.__dict__, "max_tokens": 3, "seed": i})
                                        for i in range(n)], raw=True)
    firsts = [o.token_ids[0] for o in outs]
    want, got = torch.zeros_like(first), torch.zeros_like(first)
    for t0 in set(firsts):  # the second token's law: the target's, given each first token, mixed as they came
        want += firsts.count(t0) / n * target_next(prompt + [t0])
    for o in outs: got[o.token_ids[1]] += 1 / n
    rates = [o.metrics["acceptance_rate"] for o in outs]  # one guess per request: 0 or 1
    assert None not in rates and 0.1 < sum(rates) / n < 0.9, sum(rates) / n  # both branches of the sampler ran
    assert tv(got, want) < 0.08, (tv(got, want), got[got > 0], want[want > 0])  # ~9 outcomes, 400 draws


# ---- the head's KV -------------------------------------------------------------------------------------------------
def test_head_kv_after_rerun_equals_a_fresh_run(model_dir, plain, tiny_head):
    "After steps with accepted guesses, the head's KV of every position it holds equals a fresh run over the tokens."
    spec = eagle(model_dir, tiny_head)
    seq = Sequence(plain.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=40, ignore_eos=True), plain.tokenizer)
    spec.engine.add(seq)
    while len(seq.output_ids) < 30: spec.engine.step()
    assert spec.engine.lookahead.requests[seq.id].kept > 3
    proposer = spec.engine.lookahead.proposer
    st = proposer.states[seq.id]
    n = st.held
    ids = torch.tensor(seq.token_ids)
    class Keep:  # attention that remembers the head's keys and values
        def __call__(self, layer, q, k, v, **kw):
            self.k, self.v = k, v
            return attend(q, k, v)
    keep = Keep()
    with torch.inference_mode():
        plain.model(ids[:n], torch.arange(n), NoCache())
        features = tap_of(plain.model).features()
        proposer.head(ids[1:n + 1], features, torch.arange(n), keep)
    slots = torch.tensor(st.table.slots(0, n))
    k_pool, v_pool = (x[0].reshape(-1, *x.shape[3:]) for x in (proposer.cache.k, proposer.cache.v))
    torch.testing.assert_close(k_pool[slots], keep.k, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(v_pool[slots], keep.v, atol=2e-3, rtol=1e-3)


def test_head_reads_its_history(model_dir, plain, tiny_head, monkeypatch):
    """Past `EagleProposer.history` positions a head row reads the last `history` keys only: with every position's K/V
    in the head's pool, a row's prediction equals the head's modules run afresh over the history (chapter 00a's
    attention, absolute positions), on the one-call step and on the layers; and a re-run after a gap covers only the
    history."""
    from minfer.eagle import EagleProposer
    history = 16
    for kernels in ("step", "cpu"):
        spec = LLM(model_dir, speculative={"method": "eagle", "model": tiny_head, "num_speculative_tokens": 2,
                                           "adaptive": False}, kernels=kernels, **SMALL)
        seq = Sequence(plain.tokenizer.encode(PROMPTS[4]), SamplingParams(max_tokens=8, ignore_eos=True),
                       plain.tokenizer)
        spec.engine.add(seq)
        while not seq.output_ids: spec.engine.step()  # the prompt: its features filed, no guess yet
        proposer, n = spec.engine.lookahead.proposer, seq.num_computed
        assert n >= 2 * history
        with torch.inference_mode():
            monkeypatch.setattr(EagleProposer, "history", 10 ** 6)
            table, start, tokens, features = proposer._catch_up(seq, 1)
            assert start == 0
            proposer._forward([(table, start, tokens, features)])  # every position's K/V in the pool
            monkeypatch.setattr(EagleProposer, "history", history)
            g, _ = proposer._forward([(table, n - 1, tokens[-1:], features[-1:])])  # the last position again
            ids = torch.tensor(seq.token_ids)
            want = proposer.head(ids[n - history + 1:n + 1], features[n - history:n], torch.arange(n - history, n),
                                 lambda layer, q, k, v, **kw: attend(q, k, v))[-1]
            proposer.states[seq.id].held = 0  # as if the sequence had made no guess since its prompt
            assert proposer._catch_up(seq, 1)[1] == n - history  # the history's positions, not all n
        torch.testing.assert_close(g[0], want, atol=2e-3, rtol=1e-3)


def test_catch_up_rows_are_the_rows_a_pass_reruns(model_dir, tiny_head):
    """Adaptive k prices a sequence's first guess by the positions the head re-runs first: after the prompt, the
    prompt's last `history` positions less the guess's own row; right after a re-run, none."""
    spec = LLM(model_dir, speculative={"method": "eagle", "model": tiny_head, "num_speculative_tokens": 2,
                                       "adaptive": False}, **SMALL)
    seq = Sequence(spec.tokenizer.encode(PROMPTS[4]), SamplingParams(max_tokens=8, ignore_eos=True), spec.tokenizer)
    spec.engine.add(seq)
    while not seq.output_ids:
        spec.engine.step()  # the prompt: its features filed, no guess yet
    proposer, n = spec.engine.lookahead.proposer, seq.num_computed
    rows = proposer.catch_up_rows(seq)
    assert rows == min(n, proposer.history) - 1
    with torch.inference_mode():
        _, start, tokens, _ = proposer._catch_up(seq, 1)
    assert len(tokens) == n - start == rows + 1
    assert proposer.catch_up_rows(seq) == 0


def test_head_keeps_the_features_of_its_history_only(model_dir, plain, tiny_head, monkeypatch):
    """The target's features are filed after every pass, but no re-run reads further back than the history: a sequence
    holds at most the history's (and one more), after its prompt and while it decodes with or without guesses."""
    from minfer.eagle import EagleProposer
    history = 16
    monkeypatch.setattr(EagleProposer, "history", history)
    spec = LLM(model_dir, speculative={"method": "eagle", "model": tiny_head, "num_speculative_tokens": 2,
                                       "adaptive": True}, **SMALL)
    seq = Sequence(plain.tokenizer.encode(PROMPTS[4]), SamplingParams(max_tokens=40, ignore_eos=True),
                   plain.tokenizer)
    spec.engine.add(seq)
    proposer, sizes = spec.engine.lookahead.proposer, []
    while not seq.finished:
        spec.engine.step()
        if seq.id in proposer.states:
            held = proposer.states[seq.id].features
            assert min(held) >= seq.num_computed - history - 1, (min(held), seq.num_computed)
            sizes.append(len(held))
    assert len(seq.token_ids) > 3 * history and max(sizes) <= history + 3, sizes


def test_head_on_the_one_call_step_equals_its_modules(model_dir, plain, tiny_head, monkeypatch):
    """With the target on kernels='step', a head pass is one `decode_step` call (one layer, no final norm, the reduced
    LM head): its predicted features and draft logits equal the head's PyTorch modules over chapter 03's attention,
    for runs of positions (the re-run) and for rows with their own key lists (a tree's nodes). Past
    `EagleProposer.step_rows` rows the modules run, and only the rows asked for meet the LM head."""
    from minfer.eagle import EagleProposer
    monkeypatch.setattr(EagleProposer, "step_rows", 64)  # these 33 rows in one call
    spec = eagle(model_dir, tiny_head)
    proposer = spec.engine.lookahead.proposer
    assert proposer.pointers is not None and proposer.step_cfg.vocab_size == proposer.head.lm_head.out_features
    g = torch.Generator().manual_seed(0)
    tables = [BlockTable(proposer.cache.allocator) for _ in range(2)]
    for t in tables: t.append_slots(40)
    entries = [(tables[0], p, 1) for p in range(23)] + [(tables[1], p, 1) for p in range(9)] + [(tables[1], 30, 1)]
    keys = [None] * 32 + [[0, 1, 2, 5, 8, 30]]  # a node that sees part of its sequence and itself
    tokens = torch.randint(0, 2000, (33,), generator=g)
    features = torch.randn(33, plain.model.cfg.hidden_size, generator=g)
    positions = torch.tensor([p for _, p, _ in entries[:32]] + [9])
    with torch.inference_mode():
        got = proposer._head(entries, tokens, features, positions, keys)
        some = torch.tensor([3, 22, 31, 32])
        _, step_some = proposer._head(entries, tokens, features, positions, keys, logits_rows=some)
        monkeypatch.setattr(EagleProposer, "step_rows", 16)  # 33 rows: the modules
        g_some, logits_some = proposer._head(entries, tokens, features, positions, keys, logits_rows=some)
        proposer.pointers = None  # the modules, every row's logits
        want = proposer._head(entries, tokens, features, positions, keys)
    for a, b in zip(got, want): torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(g_some, want[0], atol=1e-4, rtol=1e-4)
    for logits in (step_some, logits_some):
        assert logits.shape[0] == len(some)
        torch.testing.assert_close(logits, want[1][some], atol=1e-4, rtol=1e-4)
    for t in tables: t.free()


# ---- the command and bad input -------------------------------------------------------------------------------------
def test_batched_features_equal_one_pass_per_sequence(plain):
    "target_features pads several sequences into one pass: each one's features equal a pass over it alone."
    seqs = [plain.tokenizer.encode(p) for p in (PROMPTS[0], PROMPTS[1], "hi", PROMPTS[4])]
    got, tap = target_features(plain.model, seqs, batch=3), tap_of(plain.model)
    with torch.inference_mode():
        for s, f in zip(seqs, got):
            plain.model(torch.tensor(s), torch.arange(len(s)), NoCache(), logits_rows=torch.tensor([len(s) - 1]))
            torch.testing.assert_close(f, tap.features(), atol=1e-4, rtol=1e-4)

def test_unrolled_training_step_is_the_run_time_guess(plain, tiny_head):
    """Training's second unrolled step at row t must compute what guess 2 computes at run time: the head over rows
    0..t (the target's features) and then one more row at position t + 1 reading x[t+2] and the head's own
    prediction at t, with plain causal attention over those t + 2 rows (00a's `attend`)."""
    head = load_head(tiny_head, plain.model)
    ids = torch.tensor(plain.tokenizer.encode(PROMPTS[4]))
    feats = target_features(plain.model, [ids.tolist()])[0]
    L = len(ids) - 2
    tokens, features, starts = ids[None], feats[None], torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        g1, g2 = unroll_head(head, tokens, features, starts, ahead=2)
        for t in (0, L // 2, L - 1):
            rows = torch.cat([ids[1:t + 2], ids[t + 2:t + 3]])
            x = torch.cat([feats[:t + 1], g1[0, t:t + 1]])
            want = head(rows, x, torch.arange(t + 2), lambda layer, q, k, v, **kw: attend(q, k, v))[-1]
            torch.testing.assert_close(g2[0, t], want, atol=1e-4, rtol=1e-4)

def test_train_eagle_tiny_writes_a_folder_that_loads(model_dir, plain, tmp_path, capsys):
    out = tmp_path / "head"
    assert cli_main(["train-eagle", str(model_dir), str(out), "--schedule", "tiny"]) in (0, None)
    printed = capsys.readouterr()
    assert "wrote" in printed.out
    # tqdm's bars with their time estimates: the answers written, then the training steps ("4/4 [...<00:00")
    assert "training the head" in printed.err and "4/4" in printed.err and "<" in printed.err, printed.err
    assert "prompts" in printed.err
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["EagleHead"] and config["eagle"]["learning_curve"]
    head = load_head(out, plain.model)
    assert head.d2t.shape == (config["draft_vocab_size"],)
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    assert eagle(model_dir, str(out)).generate("hi", p)[0].token_ids == plain.generate("hi", p)[0].token_ids

def test_bad_heads_one_line(model_dir, plain, random_head, tmp_path):
    with pytest.raises(FileNotFoundError, match="minfer train-eagle") as e: eagle(model_dir, str(tmp_path / "none"))
    assert "\n" not in str(e.value)
    (tmp_path / "target").mkdir()
    for f in Path(model_dir).iterdir(): (tmp_path / "target" / f.name).symlink_to(f)
    with pytest.raises(FileNotFoundError, match="target-eagle") as e:  # no default head beside this target
        LLM(str(tmp_path / "target"), speculative="eagle")
    assert "minfer train-eagle" in str(e.value) and "\n" not in str(e.value)
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((Path(random_head) / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "hidden_size": 960}))
    (other / "model.safetensors").symlink_to(Path(random_head) / "model.safetensors")
    with pytest.raises(ValueError, match="hidden size 960") as e: eagle(model_dir, str(other))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no EAGLE head") as e: eagle(model_dir, str(model_dir))  # a model, no head
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="reads the target's hidden states"):
        EngineConfig(speculative={"method": "eagle", "model": random_head}, tensor_parallel_size=3).resolve()
    p = SamplingParams(max_tokens=4)
    assert plain.generate("hi", p)[0].token_ids  # nothing broke
