"""Chapter 13: tensor parallelism. The split model (embedding and LM head split by vocabulary, the default) gives the
unsplit model's greedy tokens and prompt log-probabilities (fp32, within 1e-4: only the order of the sums changes) alone
and batched, with the prefix cache, chunked prefill, forks, logprobs and aborts; each rank's slices put back together
are the unsplit weights, the vocabulary's too (padded where N does not divide it); a rank that dies ends the requests
in flight with an error within seconds and leaves no process behind; two "machines" (ranks started separately, from
torchrun's environment, on another loopback address, with the embedding and LM head replicated) give the same
tokens."""
import copy, os, signal, subprocess, sys, textwrap, time
from dataclasses import replace
from pathlib import Path

import pytest, torch
from minfer import LLM, SamplingParams
from minfer.workers import WorkerDied, free_port
from minfer.engine import EngineConfig
from minfer.model import Llama, load_model
from minfer.tp import (VocabParallelEmbedding, VocabParallelLMHead, even_split, head_split, shard_model,
                       tp_bytes_per_token, vocab_split)

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there lived a king",
           "1, 2, 3, 4,"]


def alive(pid):
    try: return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError: return False


def test_heads_are_split_whole_and_by_group():
    assert head_split(9, 3, 1) == [(0, 9, 0, 3)]
    assert head_split(9, 3, 2) == [(0, 6, 0, 2), (6, 3, 2, 1)]  # SmolLM2: groups of 3 query heads, the larger first
    assert head_split(9, 3, 3) == [(0, 3, 0, 1), (3, 3, 1, 1), (6, 3, 2, 1)]
    assert head_split(8, 2, 4) == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]  # KV heads replicated
    for n_q, n_kv, world in ((9, 3, 4), (9, 3, 6), (8, 2, 3)):
        with pytest.raises(ValueError, match="cannot be split in whole heads"): head_split(n_q, n_kv, world)
    assert even_split(1536, 2) == [(0, 768), (768, 768)] and even_split(10, 3) == [(0, 4), (4, 3), (7, 3)]
    with pytest.raises(ValueError, match="tensor_parallel_size=4"): EngineConfig(tensor_parallel_size=4).resolve()


@pytest.mark.parametrize("world", [2, 3])
def test_the_slices_put_together_are_the_unsplit_weights(model_dir, world):
    full = load_model(model_dir)
    shards = [shard_model(copy.deepcopy(full), r, world) for r in range(world)]
    cfg, d = full.cfg, full.cfg.head_dim
    nq, nkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    for i, layer in enumerate(full.layers):
        parts = [s.layers[i] for s in shards]
        qkv = [p.self_attn.qkv_proj.weight for p in parts]
        q = torch.cat([w[:p.self_attn.n_q * d] for w, p in zip(qkv, parts)])
        k = torch.cat([w[p.self_attn.n_q * d:(p.self_attn.n_q + p.self_attn.n_kv) * d] for w, p in zip(qkv, parts)])
        v = torch.cat([w[(p.self_attn.n_q + p.self_attn.n_kv) * d:] for w, p in zip(qkv, parts)])
        assert torch.equal(torch.cat([q, k, v]), layer.self_attn.qkv_proj.weight)
        assert torch.equal(torch.cat([p.self_attn.o_proj.weight for p in parts], 1), layer.self_attn.o_proj.weight)
        gate = torch.cat([p.mlp.gate_up_proj.weight.chunk(2)[0] for p in parts])
        up = torch.cat([p.mlp.gate_up_proj.weight.chunk(2)[1] for p in parts])
        assert torch.equal(torch.cat([gate, up]), layer.mlp.gate_up_proj.weight)
        assert torch.equal(torch.cat([p.mlp.down_proj.weight for p in parts], 1), layer.mlp.down_proj.weight)
    assert sum(s.cfg.num_attention_heads for s in shards) == cfg.num_attention_heads and nq and nkv
    # the vocabulary: 49152 rows, divided by 2 and 3; tied, so each rank's one slice is its embedding and its LM head
    assert torch.equal(torch.cat([s.embed_tokens.weight for s in shards]), full.embed_tokens.weight)
    assert all(s.lm_head.weight is s.embed_tokens.weight and s.cfg.vocab_size == cfg.vocab_size // world
               for s in shards)
    whole = shard_model(copy.deepcopy(full), 0, world, vocab_parallel=False)  # the switch off: replicated
    assert torch.equal(whole.lm_head.weight, full.lm_head.weight) and whole.cfg.vocab_size == cfg.vocab_size


class SimulatedRanks:
    """The collectives of `world` ranks run one after another in one process, rank 0 last: `all_reduce` returns the
    rank's own partial sum (the caller adds them up), `gather` keeps each piece and hands rank 0 them all."""
    def __init__(self, world): self.world, self.pieces = world, {}
    def at(self, rank):
        ranks = self
        class Group:
            def all_reduce(self, t): return t
            def gather(self, t):
                ranks.pieces[rank] = t
                return [ranks.pieces[r] for r in range(ranks.world)] if rank == 0 else None
        return Group()


@pytest.mark.parametrize("vocab, world", [(11, 2), (11, 3), (10, 3)])
def test_a_vocabulary_that_the_ranks_do_not_divide(model_dir, vocab, world):
    """Padded to a multiple of N: every rank the same ceil(V / N) rows, the last ones zeros. A one-layer model with a
    vocabulary of 10 or 11 (random weights): the ranks' embedding rows add up to the whole lookup, their logits put
    side by side, padding dropped, are the whole head's, for tied and untied tables."""
    rows = -(-vocab // world)
    split = vocab_split(vocab, world)
    assert [first for first, _, _ in split] == [min(r * rows, vocab) for r in range(world)]
    assert sum(n for _, n, _ in split) == vocab and all(n + pad == rows for _, n, pad in split)
    assert vocab_split(11, 4) == [(0, 3, 0), (3, 3, 0), (6, 3, 0), (9, 2, 1)] and vocab_split(13, 5)[-1] == (12, 1, 2)
    assert vocab_split(49152, 2) == [(0, 24576, 0), (24576, 24576, 0)]
    for tied in (True, False):
        cfg = replace(load_model(model_dir, device="meta").cfg, vocab_size=vocab, num_hidden_layers=1,
                      tie_word_embeddings=tied)
        torch.manual_seed(0)
        full = Llama(cfg).eval().requires_grad_(False)
        for p in full.parameters(): p.normal_()
        shards = [shard_model(copy.deepcopy(full), r, world) for r in range(world)]
        assert all(s.embed_tokens.weight.shape[0] == rows for s in shards)
        assert torch.equal(torch.cat([s.embed_tokens.weight for s in shards])[:vocab], full.embed_tokens.weight)
        assert torch.equal(torch.cat([s.lm_head.weight for s in shards])[:vocab], full.lm_head.weight)
        assert not torch.cat([s.embed_tokens.weight for s in shards])[vocab:].any()  # padding: zeros
        assert all((s.lm_head.weight is s.embed_tokens.weight) == tied for s in shards)
        ids, x = torch.arange(vocab).flip(0), torch.randn(3, cfg.hidden_size)
        ranks = SimulatedRanks(world)
        parts = [(VocabParallelEmbedding(s.embed_tokens, split[r][0], ranks.at(r))(ids),
                  VocabParallelLMHead(s.lm_head, vocab, ranks.at(r))(x)) for r, s in reversed(list(enumerate(shards)))]
        assert torch.equal(sum(e for e, _ in parts), full.embed_tokens(ids))  # one rank gives each id its row
        logits = parts[-1][1]  # rank 0's: every rank's piece, padding dropped
        assert logits.shape == (3, vocab) and all(h.shape == (3, 0) for _, h in parts[:-1])
        assert torch.allclose(logits, full.lm_head(x), atol=1e-5)


def test_bytes_per_token_count_the_split_head(model_dir):
    cfg = load_model(model_dir, device="meta").cfg
    split, whole = tp_bytes_per_token(cfg, 2, "float32"), tp_bytes_per_token(cfg, 2, "float32", vocab_parallel=False)
    head = cfg.vocab_size * cfg.hidden_size * 4  # 113 MB of fp32: half of it leaves each rank
    assert whole["weights"] - split["weights"] == head / 2
    assert split["collectives"] == whole["collectives"] + 2 == 2 * cfg.num_hidden_layers + 2
    assert split["wire"] - whole["wire"] == cfg.hidden_size * 4 + cfg.vocab_size // 2 * 4  # one all-reduce, a gather


@pytest.fixture(scope="module")
def reference(model_dir):
    "The unsplit model, the same switches the split one resolves to."
    return LLM(model_dir, kernels="cpu", max_num_batched_tokens=32, prefix_cache=True)


@pytest.fixture(scope="module")
def split(model_dir):
    llm = LLM(model_dir, tensor_parallel_size=2, max_num_batched_tokens=32, prefix_cache=True,
              kv_cache_bytes=2**27)
    pids = [p.pid for p in llm.engine.procs.values()]
    yield llm
    llm.close()
    assert not any(alive(p) for p in pids)


def max_logprob_difference(want, got):
    return max(abs(a[t] - b[t]) for a, b in zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:]) for t in a)


def test_split_equals_unsplit_batched_and_alone(reference, split):
    """Greedy tokens equal, prompt log-probs within 1e-4; prompts longer than the 32-token budget are chunked. The
    embedding and LM head are split by vocabulary (the default): every step's embedding is summed by an all-reduce
    and its logits gathered from both ranks."""
    assert split.config.tensor_parallel_size == 2 and split.config.kernels != "step"
    head = split.engine.model.lm_head
    assert isinstance(head, VocabParallelLMHead) and head.weight.shape[0] == head.vocab // 2
    assert isinstance(split.engine.model.embed_tokens, VocabParallelEmbedding)
    p = SamplingParams(max_tokens=16, ignore_eos=True, prompt_logprobs=0, logprobs=2)
    long = PROMPTS[2] + " " + " ".join(PROMPTS) * 3
    want = reference.generate(PROMPTS + [long], p, raw=True)
    for prompts in (PROMPTS + [long], [PROMPTS[0]]):
        got = split.generate(prompts, p, raw=True)
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids
            assert max_logprob_difference(w, g) <= 1e-4
            assert all(abs(a[t] - b[t]) <= 1e-4 for a, b in zip(w.samples[0].logprobs, g.samples[0].logprobs) for t in a)
    # its prefix is cached on every rank's pool (a request for prompt log-probs computes its whole prompt: not this one)
    again = split.generate(long, SamplingParams(max_tokens=16, ignore_eos=True), raw=True)[0]
    assert again.token_ids == want[-1].token_ids and again.metrics["num_cached_tokens"] > 0


def test_forks_and_aborts(reference, split):
    p = SamplingParams(max_tokens=8, n=3, temperature=0.8, seed=7)
    want = reference.generate(PROMPTS[1], p, raw=True)[0]
    got = split.generate(PROMPTS[1], p, raw=True)[0]
    assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples]
    seqs = split.add_request(PROMPTS[3], SamplingParams(max_tokens=50, ignore_eos=True), raw=True)
    for _ in range(3): split.step()
    split.abort(seqs)
    assert seqs[0].status == "aborted" and not split.has_unfinished()
    assert split.engine.cache.allocator.num_used == split.engine.scheduler.radix.num_blocks  # only the cache holds any


def test_a_dead_rank_ends_requests_with_an_error(model_dir):
    llm = LLM(model_dir, tensor_parallel_size=2, kv_cache_bytes=2**27)
    pids = [p.pid for p in llm.engine.procs.values()]
    try:
        seq, = llm.add_request("Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True), raw=True)
        while not seq.output_ids: llm.step()
        os.kill(pids[0], signal.SIGKILL)
        t = time.perf_counter()
        with pytest.raises(WorkerDied, match="tensor-parallel rank failed.*1 request"):
            while llm.has_unfinished(): llm.step()
        assert time.perf_counter() - t < 10 and seq.finished and seq.finish_reason == "error"
        with pytest.raises(WorkerDied, match="create a new engine"): llm.generate("hi")
    finally:
        llm.close()
    assert not any(alive(p) for p in pids)


def test_two_machines_from_torchrun_environment(reference):
    """Rank 1 started on its own (`minfer worker`, as torchrun would on another machine), rank 0 from a script with the
    same environment (the launch's secret too), both on 127.0.0.2 (another loopback address than the engine's own
    default)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.2", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "MINFER_WORKER_SECRET": os.urandom(32).hex()}
    script = textwrap.dedent("""
        import minfer.tp
        from minfer import LLM, SamplingParams
        minfer.tp.VOCAB_PARALLEL = False  # the switch off: rank 0 tells the worker, whose embedding and head stay whole
        llm = LLM(tensor_parallel_size=2, kv_cache_bytes=2**27)
        assert "LM head replicated" in repr(llm.engine)
        print(llm.generate("The capital of France is", SamplingParams(max_tokens=12, ignore_eos=True), raw=True)[0].token_ids)
        llm.close()
    """)
    worker = subprocess.Popen([sys.executable, "-m", "minfer", "worker"], env={**env, "RANK": "1"},
                              stderr=subprocess.PIPE, text=True)
    try:
        front = subprocess.run([sys.executable, "-c", script], env={**env, "RANK": "0"}, capture_output=True, text=True,
                               timeout=300)
        assert front.returncode == 0, front.stderr[-2000:]
        assert worker.wait(timeout=30) == 0, worker.stderr.read()[-2000:]
    finally:
        if worker.poll() is None: worker.kill()
    want = reference.generate("The capital of France is", SamplingParams(max_tokens=12, ignore_eos=True), raw=True)
    assert front.stdout.strip() == str(want[0].token_ids)


def test_no_rank_outlives_the_program(tmp_path):
    "A script that never calls close(): the ranks it started are gone once it exits."
    script = tmp_path / "leave.py"
    script.write_text(textwrap.dedent("""
        from minfer import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM(tensor_parallel_size=2, kv_cache_bytes=2**27)
            print(*[p.pid for p in llm.engine.procs.values()], flush=True)
            print(llm.generate("Hi", SamplingParams(max_tokens=2), raw=True)[0].token_ids, flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    pids = [int(p) for p in out.stdout.split("\n")[0].split()]
    time.sleep(0.5)
    assert len(pids) == 1 and not any(alive(p) for p in pids)


@pytest.mark.parametrize("switches, words", [
    (dict(pd_split=True), "pd_split=True"), (dict(kernels="step"), "kernels='step'"),
    (dict(kv="contiguous"), "paged engine"), (dict(tensor_parallel_size=4), "whole heads")])
def test_what_cannot_split_is_refused_in_one_line(switches, words):
    with pytest.raises(ValueError) as e: EngineConfig(**{"tensor_parallel_size": 2, **switches}).resolve()
    assert words in str(e.value) and "\n" not in str(e.value) and "'auto'" not in str(e.value)


def test_serve_tensor_parallel_and_sigterm_leave_no_rank():
    "`minfer serve --tensor-parallel-size 2` answers over HTTP; SIGTERM to the server leaves no rank behind."
    import httpx, psutil, re, threading
    cmd = [sys.executable, "-m", "minfer", "serve", "--host", "127.0.0.1", "--port", "0",
           "--tensor-parallel-size", "2", "--kv-cache-bytes", str(2**27)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        log, url, deadline = [], None, time.time() + 300
        while url is None:
            line = proc.stderr.readline()
            assert line and time.time() < deadline, "the server did not start:\n" + "".join(log)
            log.append(line)
            if m := re.search(r"ready on (http://\S+)", line): url = m.group(1)
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
        ranks = [c.pid for c in psutil.Process(proc.pid).children(recursive=True) if "spawn" in " ".join(c.cmdline())]
        assert len(ranks) == 1, ranks  # rank 0 is the server's own process
        r = httpx.post(url + "/v1/completions", timeout=120, json=dict(model="smollm2-135m-instruct",
                       prompt="The capital of France is", max_tokens=6, temperature=0))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    deadline = time.time() + 10
    while any(alive(p) for p in ranks) and time.time() < deadline: time.sleep(0.2)
    assert not any(alive(p) for p in ranks), "a rank outlived the server"
