"""The extension points, used from outside the library as a later chapter (or a user) would: a toy entry of each kind is
registered here, in a test, and the engine runs with it without any library file knowing its name. Registries are
add-only: a different entry under a taken name is refused, the same definition run again (a notebook cell re-run) is
not."""
import pytest
import torch

from minfer.model import ModelConfig, Registry
from minfer.paged import KV_FORMATS, KV_READERS, PagedAttention, PagedKVCache
from minfer.scheduler import Lookahead
from minfer.engine import SWITCHES, EngineConfig, Rule, Switch
from minfer.cli import COMMANDS, Command, main as cli_main
from minfer.llm import LLM
from minfer.sampling import SamplingParams, sample


def test_a_taken_name_is_refused_and_a_rerun_is_not():
    reg = Registry("toy", kind=object)

    class Entry:
        pass
    reg.register("a", Entry)

    class Entry:  # the same definition, run again: no conflict
        pass
    reg.register("a", Entry)

    class Other:
        pass
    with pytest.raises(ValueError, match="registered already"):
        reg.register("a", Other)
    with pytest.raises(ValueError, match="registered already"):
        reg["a"] = Other
    with pytest.raises(TypeError, match="must be a"):
        Registry("typed", kind=int).register("x", "not an int")


def test_no_later_chapter_replaces_an_earlier_entry():
    "Chapter 09 reads its pools through KV_READERS: chapters 05a/05b's backends are still theirs."
    from minfer.cpu_kernels import CpuAttention
    from minfer.paged import ATTENTION_BACKENDS
    assert ATTENTION_BACKENDS["cpu"] is CpuAttention and ATTENTION_BACKENDS["torch"] is PagedAttention
    from minfer.flash import TritonAttention
    assert ATTENTION_BACKENDS["triton"] is TritonAttention


class HalfPool(PagedKVCache):
    "A toy KV format: K and V stored in float16 whatever the model's dtype (half of fp32's bytes, no scales)."
    format_name = "toy-half"

    def __init__(self, cfg, num_blocks, block_size=16, dtype=torch.float32, device="cpu"):
        super().__init__(cfg, num_blocks, block_size, torch.float16, device)


class HalfFormat:
    name, truncatable, movable, runs = "toy-half", True, True, None

    def block_bytes(self, cfg, block_size):
        return PagedKVCache.block_bytes(cfg, block_size, torch.float16)

    def from_budget(self, cfg, budget_bytes, block_size, dtype, device, max_seqs):
        return HalfPool(cfg, int(budget_bytes // self.block_bytes(cfg, block_size)), block_size, dtype, device)


@pytest.fixture
def toy_format(monkeypatch):
    monkeypatch.setitem(KV_FORMATS, "toy-half", HalfFormat())
    monkeypatch.setitem(KV_READERS, ("torch", "toy-half"), PagedAttention)


def test_a_toy_kv_format_runs_in_the_engine(model_dir, toy_format):
    "Registered from here, chosen by the kv_dtype switch (chapter 09's), read by chapter 03's backend."
    ref = LLM(model_dir, kernels="cpu", attention="torch")
    toy = LLM(model_dir, kv_dtype="toy-half", kernels="cpu", attention="torch")
    assert isinstance(toy.engine.cache, HalfPool) and toy.engine.cache.k.dtype == torch.float16
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt = "The capital of France is"
    want, got = ref.generate(prompt, params)[0], toy.generate(prompt, params)[0]
    assert got.finish_reason == "length" and len(got.token_ids) == 8
    # half the KV bytes of fp32 per token: the ledger counts the format's own block size
    assert got.metrics["bytes_per_token"] < want.metrics["bytes_per_token"]
    with pytest.raises(ValueError, match="does not read kv_dtype='toy-half'"):
        EngineConfig(model_dir, kv_dtype="toy-half", attention="cpu").resolve()


def test_a_toy_switch_with_its_rule(model_dir, monkeypatch):
    "A switch registered from here is a keyword of LLM, a field of the config, and its rule refuses in one line."
    attached = []
    toy = Switch("toy_trace", False, "record that the engine was built", type=bool,
                 rules=(Rule(("toy_trace", "kv"), lambda c: c.toy_trace and c.kv != "paged",
                             lambda c: f"toy_trace=True needs kv='paged' (got kv={c.kv!r})"),),
                 attach=lambda engine, config: attached.append(config.toy_trace))
    monkeypatch.setitem(SWITCHES, "toy_trace", toy)
    llm = LLM(model_dir, toy_trace=True)
    assert llm.toy_trace is True and "toy_trace=True" in repr(llm) and attached == [True]
    with pytest.raises(ValueError, match="toy_trace=True needs kv='paged'"):
        EngineConfig(model_dir, toy_trace=True, kv="contiguous").resolve()


class RepeatGuess(Lookahead):
    """A toy lookahead: every decoding sequence guesses that its last token comes again, one token ahead, and its two
    rows are judged greedily (the guess is kept where it is the model's choice): chapter 06's hook on its own."""
    def __init__(self):
        self.rows_kept = []  # per judged sequence: how many of its rows kept their KV
        self.kv_past_computed = []  # sequences whose block table held KV past their computed tokens at a step's start

    def wanted(self, running):
        self.kv_past_computed += [s.id for s in running if s.block_table.num_tokens != s.num_computed]
        return {s: 1 for s in running if s.num_computed == len(s) - 1}

    def rows(self, seq, n):
        c = seq.num_computed
        return seq.token_ids[c:] + [seq.token_ids[-1]] * (n - 1), range(c, c + n), None

    def tokens(self, seq, logits):
        out = [sample(logits[0], seq.params)]
        if out[0] == seq.token_ids[-1]:  # the guess was the model's token: its row's logits give one more
            out.append(sample(logits[1], seq.params))
        self.rows_kept.append(len(out))
        return [(seq, t, None) for t in out], len(out)


def test_a_toy_lookahead_runs_in_the_engine(model_dir):
    """Set from here as the engine's `lookahead` (chapters 06a/06b's hook): greedy output equals plain decoding's with
    guesses kept and rejected, under a budget that cuts them and a pool that preempts; every block comes back."""
    prompts = ["7 7 7 7 7 7 7 7 7 7", "The capital of France is", "a a a a a a a a", "Once upon a time"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in LLM(model_dir, kv_cache_bytes=2**26).generate(prompts, params, raw=True)]
    pool = 8 * PagedKVCache.block_bytes(ModelConfig.from_folder(model_dir), 4)  # 32 tokens: the four preempt
    toy = LLM(model_dir, block_size=4, kv_cache_bytes=pool, max_num_batched_tokens=6)
    toy.engine.lookahead = hook = RepeatGuess()
    assert toy.engine.scheduler.lookahead is hook and toy.engine.runner.lookahead is hook
    assert [o.token_ids for o in toy.generate(prompts, params, raw=True)] == want
    assert 2 in hook.rows_kept and 1 in hook.rows_kept  # guesses were kept and rejected
    assert hook.kv_past_computed == []  # a rejected guess's KV is given back at once
    assert toy.engine.stats["preemptions"] > 0 and toy.engine.cache.allocator.num_used == 0
    toy.engine.lookahead = None  # back to the default: no tokens ahead
    assert type(toy.engine.scheduler.lookahead) is Lookahead
    assert [o.token_ids for o in toy.generate(prompts[:1], params, raw=True)] == want[:1]


def test_a_toy_subcommand(monkeypatch, capsys):
    monkeypatch.setitem(COMMANDS, "toy-hello", Command(
        "say hello", lambda p: p.add_argument("--name", default="world"),
        lambda args: print(f"hello, {args.name}")))
    assert cli_main(["toy-hello", "--name", "reader"]) == 0
    assert capsys.readouterr().out.strip() == "hello, reader"
