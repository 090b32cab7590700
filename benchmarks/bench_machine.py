"""This machine's two roofs for the scoreboard (benchmarks/scoreboard.json): copy bandwidth and fp32/bf16 matmul rates,
measured with chapter 00b's `measure_bandwidth` and `measure_matmul_flops`, 3 rounds, medians; prints a record.

    python benchmarks/bench_machine.py > benchmarks/machine-$(date -u +%Y-%m-%d-%H%M).md
"""
import datetime, os, subprocess
import torch
from minfer.roofline import measure_bandwidth, measure_matmul_flops

lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
flags = next(line.split(":", 1)[1].split() for line in lscpu.splitlines() if line.startswith("Flags"))
isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
load_before = os.getloadavg()[0]
rounds = [(measure_bandwidth(), measure_matmul_flops(dtype="float32"), measure_matmul_flops(dtype="bfloat16"))
          for _ in range(3)]
load_after = os.getloadavg()[0]

print("# This machine's roofs (chapter 00b's measure_bandwidth and measure_matmul_flops)\n")
print(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
print(f"- machine: {model}, {os.cpu_count()} cores, {', '.join(isa)}; torch {torch.__version__}, "
      f"{torch.get_num_threads()} threads")
print(f"- load average (1 min): {load_before:.2f} before, {load_after:.2f} after "
      f"({os.cpu_count()} cores: above that, other jobs shared them)")
print("- command: `python benchmarks/bench_machine.py` (3 rounds of: copy bandwidth, fp32 and bf16 1024^3 matmul)\n")
print("| measure | round 1 | round 2 | round 3 | median |\n|---|---|---|---|---|")
for i, name in enumerate(("copy bandwidth (GB/s)", "fp32 matmul (GFLOP/s)", "bf16 matmul (GFLOP/s)")):
    values = [r[i] / 1e9 for r in rounds]
    print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {sorted(values)[1]:.1f} |")
