"""Learn and use the techniques behind fast LLM inference: a literate, step-by-step inference engine."""

__version__ = "0.1.0"
"minfer: learn and use the techniques behind fast LLM inference. The public API is `LLM` and `SamplingParams`."
# Every chapter that fills a registry, in course order, so that `import minfer` sees every entry: weight formats (00a,
# 08), attention backends and KV formats (03, 05a, 05b, 09), speculative methods (10a, 10b), worker engines (11, 13),
# model families and RoPE scalings (12a), mixtures of experts (12b), output constraints (14) and the command line's
# subcommands (07c, 08, 10b). `minfer.serve` (07b) registers nothing and loads the web framework: it is imported where
# it is used.
from . import (model, paged, flash, cpu_kernels, cpu_step, engine, llm, cli, awq, kvquant, speculative, eagle,
               disagg, families, moe, tp, structured)
from .sampling import SamplingParams
from .llm import LLM, RequestOutput, Completion
