"""Chapter 13: tensor parallelism. The split model gives the unsplit model's greedy tokens and prompt log-probabilities
(fp32, within 1e-4: only the order of the sums changes) alone and batched, with the prefix cache, chunked prefill, forks,
logprobs and aborts; each rank's slices put back together are the unsplit weights; a rank that dies ends the requests
in flight with an error within seconds and leaves no process behind; two "machines" (ranks started separately, from
torchrun's environment, on another loopback address) give the same tokens."""
import copy, os, signal, subprocess, sys, textwrap, time
from pathlib import Path

import pytest, torch
from minfer import LLM, SamplingParams
from minfer.disagg import WorkerDied, free_port
from minfer.engine import EngineConfig
from minfer.model import load_model
from minfer.tp import head_split, even_split, shard_model

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
    assert all(torch.equal(s.lm_head.weight, full.lm_head.weight) for s in shards)  # replicated


@pytest.fixture(scope="module")
def reference(model_dir):
    "The unsplit model, the same switches the split one resolves to."
    return LLM(model_dir, kernels="cpu", max_num_batched_tokens=32, prefix_cache=True)


@pytest.fixture(scope="module")
def split(model_dir):
    llm = LLM(model_dir, tensor_parallel_size=2, max_num_batched_tokens=32, prefix_cache=True)
    pids = [p.pid for p in llm.engine.procs.values()]
    yield llm
    llm.close()
    assert not any(alive(p) for p in pids)


def max_logprob_difference(want, got):
    return max(abs(a[t] - b[t]) for a, b in zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:]) for t in a)


def test_split_equals_unsplit_batched_and_alone(reference, split):
    "Greedy tokens equal, prompt log-probs within 1e-4; prompts longer than the 32-token budget are chunked."
    assert split.config.tensor_parallel_size == 2 and split.config.kernels != "step"
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
    llm = LLM(model_dir, tensor_parallel_size=2)
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
    same environment, both on 127.0.0.2 (another loopback address than the engine's own default)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.2", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    script = textwrap.dedent("""
        from minfer import LLM, SamplingParams
        llm = LLM(tensor_parallel_size=2)
        print(llm.generate("The capital of France is", SamplingParams(max_tokens=12, ignore_eos=True), raw=True)[0].token_ids)
        llm.close()
    """)
    worker = subprocess.Popen([sys.executable, "-c", "import sys, minfer.cli; sys.exit(minfer.cli.main(['worker']))"],
                              env={**env, "RANK": "1"}, stderr=subprocess.PIPE, text=True)
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
            llm = LLM(tensor_parallel_size=2)
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
    cmd = [sys.executable, "-m", "minfer.serve", "--host", "127.0.0.1", "--port", "0", "--tensor-parallel-size", "2"]
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
