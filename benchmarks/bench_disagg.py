"""Chapter 11b's measurement: co-located (no chunking), co-located (chunked prefill) and prefill/decode split, on the
same Poisson workload of short requests with long prompts mixed in, the same total cores; TTFT/TPOT p50/p99, goodput
against request rate, KV bytes and time per transfer, both workers' step timelines.

    OMP_WAIT_POLICY=PASSIVE flock /tmp/minfer-bench.lock .venv/bin/python benchmarks/bench_disagg.py --out benchmarks/disagg.json

Rates are run in order, the three systems alternating at each rate. Writes a JSON file the chapter plots."""
import argparse, json, os, random, sys, time
from pathlib import Path

import torch
from minfer.engine import EngineConfig, build_model, build_engine, usable_cores
from minfer.sequential import run_workload
from minfer.disagg import DisaggEngine
from minfer.gguf import data_dir
from minfer.tokenizer import Tokenizer


def workload(tok, n, rate, seed, long_every=4, long_len=(384, 512), short_median=32, out=(32, 64)):
    """n requests, Poisson arrivals at `rate`/s; every `long_every`-th prompt is long (uniform in `long_len` tokens),
    the rest lognormal (median `short_median`, sigma 0.6, 8..128 tokens); outputs uniform in `out` tokens."""
    rng, ids = random.Random(seed), tok.encode((data_dir() / "text" / "course.txt").read_text())
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        plen = rng.randint(*long_len) if i % long_every == long_every - 1 else \
            int(min(max(rng.lognormvariate(__import__("math").log(short_median), 0.6), 8), 128))
        start = rng.randrange(0, len(ids) - plen)
        reqs.append((t, ids[start:start + plen], rng.randint(*out)))
    return reqs


def record(seqs, elapsed):
    return dict(elapsed=elapsed, requests=[dict(prompt=len(s.prompt_ids), out=len(s.output_ids), ttft=s.metrics.ttft,
                                                tpot=s.metrics.tpot) for s in seqs])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="0.25,0.5,1.0,1.5")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/disagg.json")
    a = ap.parse_args(argv)
    cores = usable_cores()
    base = EngineConfig(max_num_batched_tokens=512).resolve()
    tok = Tokenizer(base.model)
    torch.set_num_threads(len(cores))
    model = build_model(base)
    systems = {"co-located": build_engine(EngineConfig(max_num_batched_tokens=512, chunked_prefill=False).resolve(), model),
               "co-located, chunked": None}
    chunked_cfg = EngineConfig(max_num_batched_tokens=64, chunked_prefill=True).resolve()
    split = DisaggEngine(EngineConfig(pd_split=True, max_num_batched_tokens=512, prefix_cache=False).resolve())
    res = dict(machine=f"{os.cpu_count()}-core {open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].split(chr(10))[0].strip()}",
               cores=len(cores), split_cores=[split.config.prefill_cores, split.config.decode_cores],
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), n=a.n, runs=[])
    run_workload(systems["co-located"], workload(tok, 2, 5.0, 99), tok)  # warm-up
    for rate in map(float, a.rates.split(",")):
        work = workload(tok, a.n, rate, seed=int(rate * 100))
        for name in ("co-located", "co-located, chunked", "split"):
            eng = split if name == "split" else build_engine(chunked_cfg, model) if name.endswith("chunked") \
                else systems["co-located"]
            if name == "split": split.worker_stats()  # drain
            t0 = time.perf_counter()
            seqs, elapsed = run_workload(eng, work, tok)
            run = dict(system=name, rate=rate, t0=t0, **record(seqs, elapsed))
            if name == "split":
                st = split.worker_stats()
                run["workers"] = {r: dict(spans=[s for s in st[r]["spans"] if s[0] >= t0], transfers=[
                    x for x in st[r]["transfers"] if x["start"] >= t0]) for r in st}
            else:
                hist = [h for h in eng.history if eng.t0 + h[0] >= t0]
                run["steps"] = [(eng.t0 + h[0], sum(n for _, n, _ in h[1]), len(h[1])) for h in hist]
            res["runs"].append(run)
            ok = [r for r in run["requests"] if r["tpot"] is not None]
            print(f"rate {rate:4.2f} {name:20s} ttft p50 {sorted(r['ttft'] for r in run['requests'])[len(ok)//2]:.2f} s "
                  f"tpot p50 {sorted(r['tpot'] for r in ok)[len(ok)//2]*1e3:.0f} ms  elapsed {elapsed:.1f} s", flush=True)
            Path(a.out).write_text(json.dumps(res))
    split.close()


if __name__ == "__main__":
    sys.exit(main())
