"""The extension points, used from outside the library as a later chapter (or a user) would: a toy entry of each kind is
registered here, in a test, and the engine runs with it without any library file knowing its name. Registries are
add-only: a different entry under a taken name is refused, the same definition run again (a notebook cell re-run) is
not."""
import dataclasses
import json
import math

import pytest
import torch

from minfer.model import ModelConfig, Registry, AttentionVariant, MLPSpec
from minfer.paged import KV_FORMATS, KV_READERS, PagedAttention, PagedKVCache, PoolFormat
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


class HalfFormat(PoolFormat):
    name = "toy-half"

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


def test_a_toy_model_family(tmp_path, monkeypatch):
    """A model_type registered from here: its checkpoint names tensors its own way (`renames` map them to Llama's) and
    its config spells the RMSNorm epsilon differently (`describe` reads it). Checked against transformers' forward of
    the same weights, loaded by the engine, and refused in one line once unregistered."""
    from safetensors.torch import load_file, save_file
    from minfer.model import MODEL_FAMILIES, Family, ModelConfig, NoCache, describe_llama, load_model
    from minfer.families import tiny_random_model
    ref = tiny_random_model("llama", tmp_path / "llama", rms_norm_eps=1e-2)
    toy = tmp_path / "toy"
    toy.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (toy / f).write_bytes((tmp_path / "llama" / f).read_bytes())
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    config.update(model_type="toy_llama", toy_norm_eps=config.pop("rms_norm_eps"))
    (toy / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "llama" / "model.safetensors")
    save_file({k.replace("model.layers.", "blocks."): v for k, v in tensors.items()}, toy / "model.safetensors")

    def describe_toy(d):
        return dict(describe_llama(d), rms_norm_eps=d["toy_norm_eps"])
    monkeypatch.setitem(MODEL_FAMILIES, "toy_llama", Family(describe_toy, renames=((r"^blocks\.", "model.layers."),)))
    assert ModelConfig.from_folder(toy).rms_norm_eps == 1e-2
    ids = torch.randint(3, 1000, (24,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = torch.log_softmax(load_model(toy)(ids, torch.arange(len(ids)), NoCache()), -1)
        theirs = torch.log_softmax(ref(ids[None]).logits[0].float(), -1)
    assert (ours - theirs).abs().max().item() < 1e-4
    got = LLM(str(toy), kernels="torch").generate("The capital of France is", SamplingParams(max_tokens=6,
                                                  ignore_eos=True), raw=True, use_tqdm=False)[0]
    prompt = torch.tensor([got.prompt_token_ids])
    want = ref.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, prompt.shape[1]:]
    assert got.token_ids == want.tolist()
    monkeypatch.delitem(MODEL_FAMILIES, "toy_llama")
    with pytest.raises(ValueError, match="model_type='toy_llama' is not supported"):
        ModelConfig.from_config(config)
class LastFour(AttentionVariant):
    "A toy attention variant: a query sees itself and the three positions before it (no chapter's class)."

    def first_key(self, position):
        return max(0, position - 3)


class Twice(MLPSpec):
    "A toy MLP kind's spec: the dense MLP under a kind of its own, counted as the dense one is."
    kind = "toy-twice"

    def parameters(self, cfg):
        return 3 * cfg.hidden_size * cfg.intermediate_size


class GrowingBlocks(AttentionVariant):
    """A toy variant that depends on where a query is, not only on how far back a key is: a query sees the keys of its
    own block, the blocks growing (each starts at a square number: 0, 1, 4, 9, 16, ...), so no shift of the positions
    leaves the blocks as they were."""

    def first_key(self, position):
        return math.isqrt(position) ** 2


def toy_family(tmp_path, monkeypatch, variant, mlp_spec=None):
    """A model_type registered from here whose layers all attend with `variant` (and have `mlp_spec`'s MLPs), on the
    weights of a tiny Mistral with a window of 4; -> (its folder, transformers' Mistral)."""
    from minfer.model import MODEL_FAMILIES, Family, describe_llama
    from minfer.families import tiny_random_model
    ref = tiny_random_model("mistral", tmp_path / "mistral", sliding_window=4)
    toy = tmp_path / "toy"
    toy.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (toy / f).write_bytes((tmp_path / "mistral" / f).read_bytes())
    config = json.loads((tmp_path / "mistral" / "config.json").read_text())
    config.update(model_type="toy_variant")
    (toy / "config.json").write_text(json.dumps(config))

    def describe_toy(d):
        n = d["num_hidden_layers"]
        return dict(describe_llama(d), layer_attention=(variant,) * n, layer_mlps=(mlp_spec,) * n)
    monkeypatch.setitem(MODEL_FAMILIES, "toy_variant", Family(describe_toy))
    return toy, ref


LONG_PROMPT = "The capital of France is Paris, the capital of Italy is Rome, and the capital of Spain is"


def engine_prompt_logprobs(folder):
    "The engine's greedy tokens and prompt log-probs, its pool in blocks of 4 and the prompt in chunks of 8."
    with LLM(str(folder), dtype="float32", kernels="torch", max_num_batched_tokens=8, block_size=4) as llm:
        out = llm.generate(LONG_PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=0), raw=True,
                           use_tqdm=False)[0]
        mlps = {type(layer.mlp) for layer in llm.model.layers}
    got = [getattr(g, "logprob", g) for g in (next(iter(d.values())) for d in out.prompt_logprobs[1:])]
    return out, got, mlps


def test_a_toy_attention_variant_and_mlp_kind(tmp_path, monkeypatch):
    """Chapter 00a's `AttentionVariant` and `MLPSpec` filled from here: a toy family whose layers see the last four
    positions (the variant is this file's class, not chapter 12a's) and whose MLPs are a toy kind. Checked against
    transformers' Mistral with a window of 4 on the same weights: prompt log-probs through the engine's paged pool in
    chunks of 8 (keys read from each chunk's first key on), then greedy decoding past the window."""
    from minfer.model import MLP_KINDS, MLP
    from minfer.roofline import param_counts

    class TwiceMLP(MLP):
        def __init__(self, cfg, spec):
            super().__init__(cfg)
    toy, ref = toy_family(tmp_path, monkeypatch, LastFour(), Twice())
    monkeypatch.setitem(MLP_KINDS, "toy-twice", TwiceMLP)
    cfg = ModelConfig.from_folder(toy)
    assert param_counts(cfg)["mlp"] == cfg.num_hidden_layers * Twice().parameters(cfg)
    out, got, mlps = engine_prompt_logprobs(toy)
    assert mlps == {TwiceMLP}
    ids = torch.tensor([out.prompt_token_ids])
    with torch.inference_mode():
        want = torch.log_softmax(ref(ids).logits[0].float(), -1)
    err = max(abs(g - want[i, int(ids[0, i + 1])].item()) for i, g in enumerate(got))
    assert len(got) > 16 and err < 1e-4, err
    greedy = ref.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert out.token_ids == greedy.tolist()


def test_a_variant_that_depends_on_position(tmp_path, monkeypatch):
    """A variant whose first key is not a fixed distance back (each query sees its own block): the engine's
    chunks and decode steps must place the keys they read at their true positions. Checked against the naive decode
    (chapter 00a's `NoCache`: the whole sequence, every key, through `attend`)."""
    from minfer.model import NoCache, load_model
    toy, _ = toy_family(tmp_path, monkeypatch, GrowingBlocks())
    out, got, _ = engine_prompt_logprobs(toy)
    ids = torch.tensor(out.prompt_token_ids + out.token_ids)
    with torch.inference_mode():
        want = torch.log_softmax(load_model(toy)(ids, torch.arange(len(ids)), NoCache()), -1)
    n = len(out.prompt_token_ids)
    err = max(abs(g - want[i, int(ids[i + 1])].item()) for i, g in enumerate(got))
    assert len(got) > 16 and err < 1e-4, err
    assert out.token_ids == want[n - 1:-1].argmax(-1).tolist()


# ---- a request option (chapter 02b's LOGITS_PROCESSORS), its body field (07b's REQUEST_FIELDS) and its flag (07e)
class EvenOnly:
    "A toy output constraint: only even token ids."
    done = False

    def mask(self, logits):
        odd = torch.arange(logits.shape[-1], device=logits.device) % 2 == 1
        return logits.masked_fill(odd, float("-inf"))

    def accept(self, token):
        pass

    def forced(self):
        return []

    def rollback(self, n):
        pass


class Suffix:
    "A toy constraint that forces a fixed suffix after the first token (only it is allowed there), then lets go."
    def __init__(self, suffix):
        self.suffix, self.seen, self.done = suffix, 0, False

    def pending(self):
        return self.suffix[self.seen - 1:] if 1 <= self.seen <= len(self.suffix) else []

    def mask(self, logits):
        if not self.pending():
            return logits
        only = torch.full_like(logits, float("-inf"))
        only[self.pending()[0]] = 0
        return logits + only

    def accept(self, token):
        self.seen += 1

    def forced(self):
        return self.pending()

    def rollback(self, n):
        self.seen -= n


def must_be_true(value):
    if value is not True:
        raise ValueError("use true")


def must_be_text(value):
    if not isinstance(value, str) or not value:
        raise ValueError("use a non-empty string")


@pytest.fixture
def toy_options(monkeypatch):
    from minfer.protocol import REQUEST_FIELDS, RequestField
    from minfer.sampling import LOGITS_PROCESSORS, ProcessorOption
    monkeypatch.setitem(LOGITS_PROCESSORS, "even_only", ProcessorOption(
        must_be_true, lambda value, tokenizer, eos_ids: EvenOnly, "only even token ids (true)"))
    monkeypatch.setitem(LOGITS_PROCESSORS, "toy_suffix", ProcessorOption(
        must_be_text, lambda text, tokenizer, eos_ids: lambda: Suffix(tokenizer.encode(text)), "a suffix to force"))
    monkeypatch.setitem(REQUEST_FIELDS, "even_only", RequestField(("even_only", "onlyEven"),
                                                                  lambda given: next(iter(given.values()))))


def greedy(model, ids, n, allowed=lambda logits: logits):
    "The reference: n greedy tokens after `ids`, each from a full forward pass over everything before it."
    from minfer.model import NoCache
    out = []
    for _ in range(n):
        seq = ids + out
        with torch.inference_mode():
            logits = model(torch.tensor(seq), torch.arange(len(seq)), NoCache(), logits_rows=[-1])[0]
        out.append(int(allowed(logits).argmax()))
    return out


def even_argmax(logits):
    "The largest even-id logit, picked by slicing (not by masking, as the processor does)."
    evens = torch.full_like(logits, float("-inf"))
    evens[0::2] = logits[0::2]
    return evens


def test_a_toy_output_constraint_through_generate(model_dir, model, toy_options):
    llm = LLM(model_dir)
    prompt = "Once upon a time"
    out = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, even_only=True), raw=True)[0]
    assert out.token_ids == greedy(model, out.prompt_token_ids, 8, even_argmax)
    assert all(t % 2 == 0 for t in out.token_ids)
    free = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True), raw=True)[0]
    assert any(t % 2 for t in free.token_ids)  # the constraint changed something
    with pytest.raises(ValueError, match="even_only=3 is invalid; use true"):
        SamplingParams(even_only=3)
    # forced tokens: appended at once without a pass of their own, unless the request reports logprobs
    suffix = llm.tokenizer.encode(" and so on, and so forth")
    params = SamplingParams(max_tokens=len(suffix) + 4, ignore_eos=True, toy_suffix=" and so on, and so forth")
    jumped = llm.generate(prompt, params, raw=True)[0]
    first = greedy(model, jumped.prompt_token_ids, 1)
    want = first + suffix + greedy(model, jumped.prompt_token_ids + first + suffix, 3)
    assert jumped.token_ids == want and jumped.metrics["tokens_per_pass"] > 2
    stepped = llm.generate(prompt, dataclasses.replace(params, logprobs=0), raw=True)[0]
    assert stepped.token_ids == want and stepped.metrics["tokens_per_pass"] == 1
    assert len(stepped.samples[0].logprobs) == len(want)
    with pytest.raises(ValueError, match="one logits processor"):
        llm.generate(prompt, SamplingParams(even_only=True, toy_suffix="x"))
    assert not llm.has_unfinished()


def test_a_toy_option_over_http_and_on_the_command_line(model_dir, model, toy_options, capsys):
    "The body field registered for it (either spelling) reaches SamplingParams; a bad value is a 400 naming the field."
    import httpx
    from minfer.serve import serve_in_thread
    llm = LLM(model_dir)
    prompt = "Once upon a time"
    want = greedy(model, llm.tokenizer.encode(prompt), 6, even_argmax)
    with serve_in_thread(llm) as srv:
        for spelling in ("even_only", "onlyEven"):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                             "ignore_eos": True, spelling: True}, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == llm.tokenizer.decode(want), r.text
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "onlyEven": 3}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "onlyEven", r.text
        assert "use true" in r.json()["error"]["message"]
    assert cli_main(["generate", prompt, "--raw", "--max-tokens", "6", "--even-only", "true"]) == 0
    text = capsys.readouterr().out.strip()
    assert llm.tokenizer.decode(want).strip().startswith(text)  # ends at EOS if an even EOS came first


# ---- a server route (chapter 07d's SERVER_ROUTES): open without the key or behind it, named on the start-up line
def test_a_toy_route_open_or_behind_the_key(model_dir, monkeypatch):
    """Two GET routes registered from here: a plain-text page open without the API key and named on the start-up
    line, and a JSON answer read from the server, behind the key."""
    import httpx
    from fastapi.responses import PlainTextResponse
    from minfer.serve import SERVER_ROUTES, ServerRoute, open_paths, ready_line, serve_in_thread
    monkeypatch.setitem(SERVER_ROUTES, "/toy-page", ServerRoute(lambda server: "hello, reader", PlainTextResponse,
                                                                open=True, title="toy page"))
    monkeypatch.setitem(SERVER_ROUTES, "/toy-seats", ServerRoute(lambda server: {"seats": server.llm.max_num_seqs}))
    assert "/toy-page" in open_paths() and "/toy-seats" not in open_paths()
    assert "toy page at /toy-page" in ready_line("127.0.0.1", 8000) and "/toy-seats" not in ready_line("h", 1)
    with serve_in_thread(LLM(model_dir, max_num_seqs=3), api_key="toy-key") as srv:
        page = httpx.get(srv.url + "/toy-page", timeout=60)
        assert page.status_code == 200 and page.text == "hello, reader", page.text
        assert page.headers["content-type"].startswith("text/plain")
        refused = httpx.get(srv.url + "/toy-seats", timeout=60)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        seats = httpx.get(srv.url + "/toy-seats", headers={"Authorization": "Bearer toy-key"}, timeout=60)
        assert seats.status_code == 200 and seats.json() == {"seats": 3}


def test_an_entry_must_be_what_its_registry_holds():
    "A registry states what an entry provides (its kind): anything else is refused when it is registered."
    from minfer.speculative import SPECULATORS
    with pytest.raises(TypeError, match="must be a PoolFormat"):
        KV_FORMATS.register("toy-bare", object())
    with pytest.raises(TypeError, match="must be a Command"):
        COMMANDS.register("toy-bare", lambda args: None)
    with pytest.raises(TypeError, match="must be a Speculator"):
        SPECULATORS.register("toy-bare", object)

    class NoPool(PoolFormat):  # says its block size, makes no pool
        def block_bytes(self, cfg, block_size):
            return 0
    with pytest.raises(TypeError, match="abstract"):
        NoPool()
