"""Chapter 13b's measurement: the multi-tenant workload (`data/workloads/multi_tenant.json`: several system prompts,
conversations whose turns arrive over time, mixed reply lengths) replayed against one server on every core and
against two replicas (half the cores each) behind `smg` under round_robin, cache_aware, prefix_hash and least_load;
per system: each replica's prefix-cache hit rate (from the replicas' own counters), TTFT p50/p99, TPOT p50 and
throughput. The systems run one after another in each round (`--rounds`, A B C ... A B C ...; medians over rounds);
every run tags its system prompts, so no run finds another's prefixes in the caches.

    flock /tmp/minfer-bench.lock .venv/bin/python benchmarks/bench_cluster.py --record

Needs the gateway: pip install 'minfer[cluster]'."""
import argparse, json, os, statistics, sys, threading, time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from minfer.cluster import Cluster, gateway_missing, scrape  # noqa: E402

MODEL = "smollm2-135m-instruct"
POLICIES = ("round_robin", "cache_aware", "prefix_hash", "least_load")
SERVE_FLAGS = ["--kv-cache-bytes", "400000000", "--max-num-seqs", "16"]
GATEWAY_ARGS = {"prefix_hash": ["--prefix-token-count", "32"]}  # chapter 13b: hash what a conversation's turns share


def one_turn(url, messages, max_tokens):
    "Stream one chat turn; -> dict(ttft, tpot, tokens, text, cached, ok)."
    body = dict(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
    start, first, pieces, usage = time.perf_counter(), None, [], None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        pieces.append(piece)
    except httpx.HTTPError:
        return dict(ok=False)
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else len(pieces)
    tpot = (end - first) / (tokens - 1) if first and tokens > 1 else None
    return dict(ok=usage is not None, ttft=(first or end) - start, tpot=tpot, tokens=tokens, text="".join(pieces),
                cached=usage["prompt_tokens_details"]["cached_tokens"] if usage else 0)


def replay(url, workload, tag, time_scale):
    "Every conversation on a thread of its own, from its arrival time, each turn after the last answer; -> turns."
    results, lock, start = [], threading.Lock(), time.perf_counter()

    def conversation(conv):
        time.sleep(max(0.0, conv["arrival"] * time_scale - (time.perf_counter() - start)))
        messages = [{"role": "system", "content": f"[{tag}] " + workload["tenants"][conv["tenant"]]}]
        for turn in conv["turns"]:
            messages.append({"role": "user", "content": turn["user"]})
            out = one_turn(url, messages, turn["max_tokens"])
            with lock:
                results.append(out)
            if not out["ok"]:
                return
            messages.append({"role": "assistant", "content": out["text"]})
            time.sleep(turn["after"] * time_scale)

    threads = [threading.Thread(target=conversation, args=(c,)) for c in workload["conversations"]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def counters(urls):
    return [(s["minfer_prompt_tokens_total"], s["minfer_prefix_cache_hits_total"]) for s in map(scrape, urls)]


def run(name, url, replica_urls, workload, tag, time_scale):
    before = counters(replica_urls)
    turns, elapsed = replay(url, workload, tag, time_scale)
    after = counters(replica_urls)
    hit_rates = [(h1 - h0) / max(p1 - p0, 1) for (p0, h0), (p1, h1) in zip(before, after)]
    ok = [t for t in turns if t["ok"]]
    ttfts = sorted(t["ttft"] for t in ok)
    tpots = [t["tpot"] for t in ok if t["tpot"] is not None]
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None
    return dict(system=name, hit_rates=hit_rates, ttft_p50=statistics.median(ttfts) if ttfts else None,
                ttft_p99=p99, tpot_p50=statistics.median(tpots) if tpots else None,
                tokens_per_s=sum(t["tokens"] for t in ok) / elapsed, turns=len(turns), failed=len(turns) - len(ok))


def table(rows):
    fmt = lambda v, unit="": "-" if v is None else f"{v * 1000:.0f} ms" if unit == "ms" else f"{v:.1f}"
    header = ("| system | prefix-cache hit rate per replica | TTFT p50 | TTFT p99 | TPOT p50 | tokens/s "
              "| turns (failed) |")
    lines = [header, "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        hits = ", ".join(f"{h:.0%}" for h in r["hit_rates"])
        lines.append(f"| {r['system']} | {hits} | {fmt(r['ttft_p50'], 'ms')} | {fmt(r['ttft_p99'], 'ms')} | "
                     f"{fmt(r['tpot_p50'], 'ms')} | {fmt(r['tokens_per_s'])} | {r['turns']} ({r['failed']}) |")
    return "\n".join(lines)


def median_rows(rounds):
    "Per system, the median of each number over the rounds."
    out = []
    for runs in zip(*rounds):
        med = lambda key: statistics.median(r[key] for r in runs) if all(r[key] is not None for r in runs) else None
        row = {k: med(k) for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tokens_per_s")}
        row["hit_rates"] = [statistics.median(h) for h in zip(*(r["hit_rates"] for r in runs))]
        row.update(system=runs[0]["system"], turns=runs[0]["turns"], failed=max(r["failed"] for r in runs))
        out.append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival and think times by this")
    ap.add_argument("--record", action="store_true", help="write benchmarks/cluster-DATE.md")
    a = ap.parse_args(argv)
    if gateway_missing() is not None:
        print(f"bench_cluster: {gateway_missing()}")
        return 1
    workload = json.loads((ROOT / "data" / "workloads" / "multi_tenant.json").read_text())
    rounds = []
    with Cluster(1, serve_args=SERVE_FLAGS) as one, Cluster(2, serve_args=SERVE_FLAGS) as two:
        for k in range(a.rounds):
            rows = [run("one server, every core", one.replica_urls[0], one.replica_urls, workload, f"one {k}",
                        a.time_scale)]
            for policy in POLICIES:
                with Cluster(policy=policy, worker_urls=two.replica_urls,
                             gateway_args=GATEWAY_ARGS.get(policy, [])) as gateway:
                    rows.append(run(f"2 replicas, {policy}", gateway.url, two.replica_urls, workload,
                                    f"{policy} {k}", a.time_scale))
            rounds.append(rows)
            print(f"round {k + 1}:\n{table(rows)}\n", flush=True)
    result = table(median_rows(rounds))
    cpu = open("/proc/cpuinfo").read().split("model name")[1].split(":")[1].split("\n")[0].strip()
    head = (f"# Replicas behind smg (chapter 13b), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
            f"machine: {os.cpu_count()}-core {cpu}; command: python benchmarks/bench_cluster.py "
            f"{' '.join(argv or sys.argv[1:])}; workload: data/workloads/multi_tenant.json "
            f"({sum(len(c['turns']) for c in workload['conversations'])} turns), time scale {a.time_scale}; "
            f"medians of {a.rounds} rounds; replicas: {' '.join(SERVE_FLAGS)}, half the cores each\n")
    print(head + "\n" + result)
    if a.record:
        out = ROOT / "benchmarks" / f"cluster-{time.strftime('%Y-%m-%d-%H%M', time.gmtime())}.md"
        out.write_text(head + "\n" + result + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
