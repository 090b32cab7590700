"""Learn and use the techniques behind fast LLM inference: a literate, step-by-step inference engine.

Modules:

- `minfer.serve`: One engine thread stepping continuously; requests from many connections join it between steps and stream their tokens back through a queue each. `minfer serve` speaks OpenAI's API, so the `openai` package, `curl` and the chat page at `/` all talk to it."""

__version__ = "0.1.0"
"minfer: learn and use the techniques behind fast LLM inference. The public API is `LLM` and `SamplingParams`."
from .sampling import SamplingParams
from .llm import LLM, RequestOutput, Completion
