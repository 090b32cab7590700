"""Load test for `minfer serve` on loopback, printed in the layout of `vllm bench serve`.

1. Concurrency sweep. For each N in --concurrency (default 1 8 32 64), --prompts-per-client x N streaming completions
   (at least 4) with at most N in flight. Workload: prompts cut from data/text/course.txt with log-normal word counts
   (median --prompt-median words, clipped to [8, --prompt-max]), outputs uniform in [--out-min, --out-max] tokens
   (`ignore_eos`, vLLM's extension, fixes each request's length), seed 0. Per N: TTFT, TPOT, inter-token latency and
   per-request output tokens/s (mean, median, P99; for throughput the bad tail is the low one, so P1 too), and the
   aggregate request and token throughput.
2. Soak (--soak requests, at most --soak-concurrency in flight): 80% good greedy requests drawn from --soak-distinct
   (prompt, max_tokens) pairs, 10% that disconnect after a few tokens, 10% malformed. Checks: every good request
   completes with the greedy text the same request gets alone (measured first, one at a time), every malformed one
   gets a 400 with OpenAI's error object, and afterwards the server reports zero KV blocks in use and no requests
   running, and it is still alive.

3. With --overhead N: the server's cost. N requests (all in flight) through the server, and the same requests run in
   this process through `LLM.add_request`/`step` with the server idle, alternating A B A B; medians of output tok/s.

The server is started here as `python -m minfer.serve --port 0 --max-num-seqs 64` unless --url points at one.

    python benchmarks/bench_serve.py [--concurrency 1 8 32 64] [--overhead 32] [--soak 300] [--record]
"""
import argparse, asyncio, datetime, json, math, os, platform, random, re, statistics, subprocess, sys, threading, time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- workload
def make_prompts(n, seed, median_words, max_words, out_min, out_max):
    "n (prompt text, max_tokens) pairs: log-normal prompt lengths in words, uniform output lengths."
    words = (ROOT / "data" / "text" / "course.txt").read_text().split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(min(max(rng.lognormvariate(math.log(median_words), 0.6), 8), max_words, len(words) - 1))
        start = rng.randrange(0, len(words) - length)
        out.append((" ".join(words[start:start + length]), rng.randint(out_min, out_max)))
    return out


# ---------------------------------------------------------------- one streaming request, timed
async def stream_completion(client, model, prompt, max_tokens, *, ignore_eos=True, disconnect_after=None):
    "-> dict(ok, text, ttft, itl list, latency, prompt_tokens, output_tokens); disconnect_after: close after k chunks."
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    text, chunk_times, usage, finish = [], [], None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return dict(ok=False, status=r.status_code, body=await r.aread())
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]": continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"): usage = chunk["usage"]
            for choice in chunk["choices"]:
                if choice["text"]:
                    text.append(choice["text"])
                    chunk_times.append(time.perf_counter())
                finish = choice["finish_reason"] or finish
            if disconnect_after is not None and len(text) >= disconnect_after:
                return dict(ok=True, disconnected=True)
    end = time.perf_counter()
    ttft = chunk_times[0] - start if chunk_times else float("nan")
    out_tokens = usage["completion_tokens"] if usage else 0
    return dict(ok=True, text="".join(text), ttft=ttft, latency=end - start, itl=list(map(
        lambda a, b: b - a, chunk_times[:-1], chunk_times[1:])), prompt_tokens=usage["prompt_tokens"] if usage else 0,
        output_tokens=out_tokens, finish=finish,
        tpot=(end - chunk_times[0]) / (out_tokens - 1) if out_tokens > 1 and chunk_times else None)


# ---------------------------------------------------------------- statistics and the vllm-style report
def pct(xs, q):
    "The q-quantile (0..100) by linear interpolation, as numpy's default."
    xs = sorted(xs)
    if not xs: return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

def report(title, rows):
    "Print rows of (label, value) / ('-', section name) in `vllm bench serve`'s layout; -> the text."
    lines = [f"{' ' + title + ' ':=^50}"]
    for label, value in rows:
        if label == "-": lines.append(f"{value:-^50}")
        elif isinstance(value, float): lines.append(f"{label + ':':<40}{value:<10.2f}")
        else: lines.append(f"{label + ':':<40}{value}")
    lines.append("=" * 50)
    text = "\n".join(lines)
    print(text, flush=True)
    return text

def latency_rows(name, unit_label, xs, scale=1000.0):
    xs = [x * scale for x in xs if x is not None and not math.isnan(x)]
    return [("Mean " + name + unit_label, statistics.fmean(xs) if xs else float("nan")),
            ("Median " + name + unit_label, pct(xs, 50)), ("P99 " + name + unit_label, pct(xs, 99))]

async def sweep_level(url, model, work, concurrency, quiet=False):
    "-> (the report's text, output tokens/s)."
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        async def one(prompt, n):
            async with limit: return await stream_completion(c, model, prompt, n)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(p, n) for p, n in work))
        duration = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    assert len(ok) == len(work), [r for r in results if not r["ok"]][:3]
    assert all(r["output_tokens"] == n for r, (_, n) in zip(ok, work)), "ignore_eos: every request its full length"
    tokens_in, tokens_out = sum(r["prompt_tokens"] for r in ok), sum(r["output_tokens"] for r in ok)
    per_request = [r["output_tokens"] / r["latency"] for r in ok]
    rows = [("Successful requests", len(ok)), ("Maximum request concurrency", concurrency),
            ("Benchmark duration (s)", duration), ("Total input tokens", tokens_in),
            ("Total generated tokens", tokens_out), ("Request throughput (req/s)", len(ok) / duration),
            ("Output token throughput (tok/s)", tokens_out / duration),
            ("Total Token throughput (tok/s)", (tokens_in + tokens_out) / duration),
            ("-", "Time to First Token"), *latency_rows("TTFT", " (ms)", [r["ttft"] for r in ok]),
            ("-", "Time per Output Token (excl. 1st token)"), *latency_rows("TPOT", " (ms)", [r["tpot"] for r in ok]),
            ("-", "Inter-token Latency"), *latency_rows("ITL", " (ms)", [x for r in ok for x in r["itl"]]),
            ("-", "Per-request Output Throughput"),
            ("Mean per-request output (tok/s)", statistics.fmean(per_request)),
            ("Median per-request output (tok/s)", pct(per_request, 50)),
            ("P99 per-request output (tok/s)", pct(per_request, 99)),
            ("P1 per-request output (tok/s)", pct(per_request, 1))]
    return (None if quiet else report("Serving Benchmark Result", rows)), tokens_out / duration


# ---------------------------------------------------------------- the server's overhead: the same work, no HTTP
def offline_throughput(llm, work):
    """Output tokens/s of `work` run in this process through LLM's stepping API: the engine alone, no HTTP.
    It steps on a worker thread, as the server's engine does: on the 2-core machine of 2026-11-22 the same loop ran
    4-5x slower on the main thread (8.7 vs 34.2 and 5.2 vs 27.2 tok/s, alternating), which is not the server's cost."""
    from minfer.sampling import SamplingParams
    result = []

    def run():
        start, seqs = time.perf_counter(), []
        for prompt, n in work:
            seqs += llm.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), raw=True)
        while llm.has_unfinished(): llm.step()
        result.append(sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - start))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return result[0]

def overhead(url, model, args, concurrency, repeats=2):
    "Server vs engine alone on the same requests, alternating (A B A B, the server idle during A); medians."
    from minfer import LLM
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs)
    work = make_prompts(concurrency, args.seed, args.prompt_median, args.prompt_max, args.out_min, args.out_max)
    offline_throughput(llm, work[:2])  # warm-up
    alone, served = [], []
    for _ in range(repeats):
        alone.append(offline_throughput(llm, work))
        served.append(asyncio.run(sweep_level(url, model, work, concurrency, quiet=True))[1])
    rows = [("Requests (all in flight at once)", concurrency), ("Repeats (alternating)", repeats),
            ("Engine alone, in-process (tok/s)", statistics.median(alone)),
            ("Through the server (tok/s)", statistics.median(served)),
            ("Server / engine alone", statistics.median(served) / statistics.median(alone))]
    return report("Server Overhead", rows)


# ---------------------------------------------------------------- soak: disconnects and malformed requests mixed in
MALFORMED = [b"{not json", b"[1, 2]", {"prompt": "Hi", "temperature": "hot"}, {"prompt": "Hi", "max_tokens": 0},
             {"prompt": "Hi", "top_p": 1.5}, {"prompt": ""}, {"prompt": "   "}, {"prompt": "Hi", "n": True},
             {"prompt": "Hi", "stop": 5}, {"prompt": "hello " * 9000}, {"max_tokens": 4}, {"prompt": [1, 2]}]

async def soak(url, model, requests, concurrency, distinct, seed):
    rng = random.Random(seed + 1)
    pool = make_prompts(distinct, seed + 1, 40, 200, 8, 48)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        # the reference: each distinct greedy request alone (nothing else in flight), until EOS or max_tokens
        alone = [(await stream_completion(c, model, p, n, ignore_eos=False))["text"] for p, n in pool]
        plan = ["good"] * requests
        picks = rng.sample(range(requests), requests // 5)
        for i in picks[:requests // 10]: plan[i] = "disconnect"
        for i in picks[requests // 10:]: plan[i] = "malformed"
        limit = asyncio.Semaphore(concurrency)

        async def one(kind):
            async with limit:
                if kind == "malformed":
                    body = rng.choice(MALFORMED)
                    if isinstance(body, bytes):
                        r = await c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
                    else:
                        r = await c.post("/v1/completions", json={"model": model, **body})
                    try:
                        err = r.json()["error"]
                    except (ValueError, KeyError, TypeError):
                        return kind, False
                    return kind, r.status_code == 400 and set(err) == {"message", "type", "param", "code"}
                k = rng.randrange(len(pool))
                prompt, n = pool[k]
                if kind == "disconnect":
                    await stream_completion(c, model, prompt, 400, ignore_eos=True, disconnect_after=rng.randint(1, 4))
                    return kind, True
                r = await stream_completion(c, model, prompt, n, ignore_eos=False)
                return kind, r["ok"] and r["text"] == alone[k]

        start = time.perf_counter()
        results = await asyncio.gather(*(one(k) for k in plan))
        duration = time.perf_counter() - start
        # aborts land between engine steps: give the last ones a moment
        for _ in range(100):
            health = (await c.get("/health")).json()
            if health["blocks_in_use"] == 0 and health["requests_running"] == 0: break
            await asyncio.sleep(0.05)
        metrics = (await c.get("/metrics")).text
    count = lambda kind: sum(1 for k, _ in results if k == kind)
    passed = lambda kind: sum(1 for k, good in results if k == kind and good)
    aborted = sum(float(v) for v in re.findall(r'minfer_requests_total\{[^}]*outcome="aborted"[^}]*\} (\S+)', metrics))
    rows = [("Requests sent", len(plan)), ("Duration (s)", duration), ("Maximum request concurrency", concurrency),
            ("Good requests, same text as alone", f"{passed('good')}/{count('good')}"),
            ("Malformed requests answered 400", f"{passed('malformed')}/{count('malformed')}"),
            ("Disconnected early", count("disconnect")),
            ("Requests aborted on the server", int(aborted)),
            ("KV blocks in use afterwards", health["blocks_in_use"]),
            ("Requests running afterwards", health["requests_running"]),
            ("Preemptions", health.get("preemptions", 0))]
    text = report("Soak Result", rows)
    ok = (passed("good") == count("good") and passed("malformed") == count("malformed")
          and health["blocks_in_use"] == 0 and health["requests_running"] == 0)
    return text, ok


# ---------------------------------------------------------------- the server and the run
def start_server(args):
    cmd = [sys.executable, "-m", "minfer.serve", "--port", "0", "--max-num-seqs", str(args.max_num_seqs)]
    if args.model: cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:
        if m := re.search(r"ready on (http://\S+)", line): return proc, m.group(1)
    raise SystemExit("the server did not start")

def machine():
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()}"

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32, 64])
    ap.add_argument("--prompts-per-client", type=float, default=1.0, help="requests per level = max(4, this x N)")
    ap.add_argument("--prompt-median", type=int, default=48, help="median prompt length in words")
    ap.add_argument("--prompt-max", type=int, default=400)
    ap.add_argument("--out-min", type=int, default=16)
    ap.add_argument("--out-max", type=int, default=64)
    ap.add_argument("--overhead", type=int, default=0, help="N: compare N requests through the server with the "
                    "engine alone in this process (0: skip)")
    ap.add_argument("--soak", type=int, default=300, help="soak requests (0: no soak)")
    ap.add_argument("--soak-concurrency", type=int, default=32)
    ap.add_argument("--soak-distinct", type=int, default=12, help="distinct good requests in the soak")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true", help="write benchmarks/serve-<date>.md")
    args = ap.parse_args()
    proc, url = (None, args.url) if args.url else start_server(args)
    try:
        for _ in range(200):
            try:
                health = httpx.get(url + "/health").json()
                break
            except httpx.TransportError:
                time.sleep(0.05)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        print(f"server: {health['engine']}\nmachine: {machine()}", flush=True)
        httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Warm up", "max_tokens": 4}, timeout=600)
        texts = []
        for n in args.concurrency:
            work = make_prompts(max(4, round(args.prompts_per_client * n)), args.seed, args.prompt_median,
                                args.prompt_max, args.out_min, args.out_max)
            texts.append(asyncio.run(sweep_level(url, model, work, n))[0])
        if args.overhead: texts.append(overhead(url, model, args, args.overhead))
        soak_ok = True
        if args.soak:
            text, soak_ok = asyncio.run(soak(url, model, args.soak, args.soak_concurrency, args.soak_distinct,
                                             args.seed))
            texts.append(text)
        alive = proc is None or proc.poll() is None
        print(f"server alive afterwards: {alive}")
    finally:
        if proc: proc.terminate()
    if args.record:
        now = datetime.datetime.now(datetime.timezone.utc)
        path = ROOT / "benchmarks" / f"serve-{now:%Y-%m-%d-%H%M}.md"
        command = "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:])
        body = "\n\n".join(f"```\n{t}\n```" for t in texts)
        path.write_text(f"# `minfer serve` under load\n\n- date: {now:%Y-%m-%d %H:%M} UTC\n- machine: {machine()}\n"
                        f"- server: `{health['engine']}`, max_num_seqs={args.max_num_seqs}\n- command: `{command}`\n"
                        f"- server alive afterwards: {alive}; soak checks passed: {soak_ok}\n\n{body}\n")
        print(f"recorded {path.relative_to(ROOT)}")
    return 0 if soak_ok and alive else 1


if __name__ == "__main__":
    sys.exit(main())
