"""What crosses the boundary between the front end and the engine core process.

Plain picklable dataclasses: the front end tokenizes and validates, then sends an
:class:`EngineRequest`; the engine streams :class:`EngineOutput` back, one per request per step
that produced tokens. Text (detokenization, stop strings) stays on the front end.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from loom.structured.spec import GrammarSpec


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_new_tokens or the model's max_total_tokens reached
    EOS_TOKEN = "eos_token"  # one of the model's EOS ids
    STOP_SEQUENCE = "stop_sequence"  # a stop_token_id (engine) or stop string (front end)
    TIME_LIMIT = "time_limit"
    ABORTED = "aborted"  # cancelled by the client or the server
    ERROR = "error"  # this request failed; others were not affected


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``do_sample=False`` is greedy and ignores the sampling knobs."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    typical_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    seed: int | None = None  # None: the engine draws one and reports it
    repetition_penalty: float = 1.0  # 1.0 = off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    top_n_tokens: int = 0  # alternatives reported per generated token
    prompt_logprobs: bool = False
    speculate: bool = True  # False: never draft for this request (when the server speculates)
    # structured output: the grammar every completion must follow (see loom.structured)
    constraint: GrammarSpec | None = None


@dataclass(frozen=True)
class StoppingParams:
    max_new_tokens: int = 20
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    priority: int = 0  # lower is served first (as vLLM); 0 is the default
    n: int = 1  # completions sharing the prompt's prefill
    arrival_time: float = field(default_factory=time.monotonic)
    adapter_id: str = ""  # a loaded LoRA adapter's name; "" = the base model


@dataclass(frozen=True)
class Rejection:
    """Why the engine refused a request for a reason that is not a server failure, for the front
    end to answer with this status instead of INTERNAL (e.g. a grammar that does not compile in
    time: INVALID_ARGUMENT naming ``field``)."""

    status: str  # a gRPC status code name: "INVALID_ARGUMENT", "FAILED_PRECONDITION", "INTERNAL"
    field: str  # the request field at fault ("parameters.constraint.json_schema")
    reason: str  # a google.rpc.ErrorInfo reason ("GRAMMAR_COMPILE_TIMEOUT")


@dataclass
class EngineOutput:
    """New tokens of one completion of one request, produced by one engine step."""

    request_id: str
    index: int  # completion index, 0..n-1
    token_ids: list[int]
    logprobs: list[float]
    # per new token: [(token_id, logprob), ...] best first, when top_n_tokens > 0
    top_tokens: list[list[tuple[int, float]]] | None = None
    # on the first output of index 0 when asked: logprob of each prompt token (None for the first)
    prompt_logprobs: list[float | None] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    rejection: Rejection | None = None  # with error: the request was refused, not failed
    seed: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # time.monotonic() when a step first ran this completion's sequence: its wait in the engine
    # ended and its prefill began. CLOCK_MONOTONIC is system-wide, so the front end can compare it
    # with its own timestamps (request metrics and the loom.queue / loom.prefill spans).
    first_scheduled_time: float | None = None
    # speculation: drafts verified in this step for this completion, and how many were accepted
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class AdapterInfo:
    """A loaded LoRA adapter, as GetModelInfo and ListAdapters report it."""

    name: str
    path: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class EngineInfo:
    """What the engine core reports about itself once the model is loaded and the pool sized."""

    model_id: str
    architecture: str  # as Hugging Face names it ("LlamaForCausalLM"); the model plugin serving it is found from it
    dtype: str
    device: str
    attention_backend: str
    block_size: int
    num_blocks: int
    max_batch_total_tokens: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    plugins: tuple[str, ...] = ()
    num_shard: int = 1  # tensor-parallel ranks the model is split over
    adapters: tuple[AdapterInfo, ...] = ()  # loaded at start (--lora-adapters)
    max_loras: int = 0  # adapters resident at once (0: LoRA off)
    max_lora_rank: int = 0


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    num_steps: int
    num_prefill_chunks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which served from it
    # structured output (loom.structured.compiler_pool.CompileStats): compile requests, cache hits
    grammar_cache_queries: int = 0
    grammar_cache_hits: int = 0
    grammar_compile_timeouts: int = 0  # requests refused: their compile ran past the time limit
    # compiles per bucket of COMPILE_TIME_BUCKETS (not cumulative; the last past the largest), and
    # the seconds they took in all
    grammar_compile_buckets: tuple[int, ...] = ()
    grammar_compile_seconds: float = 0.0


# -- Messages over the pipe between the front end and the engine process --------------------------
# One dataclass per message kind (pickled by multiprocessing), so both ends match on types and
# a typo is a type error rather than a silently ignored tag.


@dataclass(frozen=True)
class AddRequest:
    request: EngineRequest


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class AbortCompletion:
    """Stop one completion of a request (n > 1), e.g. ended by a stop string on the front end."""

    request_id: str
    index: int


@dataclass(frozen=True)
class StatsQuery:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class AdapterCommand:
    """Load (``path`` set) or unload (``path`` None) the LoRA adapter ``name``; answered by an
    :class:`AdapterReply` with the same ``op_id`` once done (a load reads its files off the step
    loop)."""

    op_id: int
    name: str
    path: str | None = None


ToEngine = AddRequest | AbortRequest | AbortCompletion | StatsQuery | AdapterCommand | Shutdown


@dataclass(frozen=True)
class EngineReady:
    info: EngineInfo


@dataclass(frozen=True)
class EngineFailed:
    """The engine could not start; ``reason`` is one sentence (configuration, model files) or the
    exception's type and message."""

    reason: str


@dataclass(frozen=True)
class StepOutputs:
    outputs: list[EngineOutput]


@dataclass(frozen=True)
class StatsReply:
    stats: EngineStats


@dataclass(frozen=True)
class AdapterReply:
    """How an :class:`AdapterCommand` ended: ``status`` "OK" or a gRPC status code name, a
    message naming the field or tensor at fault, and the adapters loaded now."""

    op_id: int
    status: str
    message: str = ""
    field: str = ""
    adapter: AdapterInfo | None = None  # the adapter loaded or unloaded
    adapters: tuple[AdapterInfo, ...] = ()


FromEngine = EngineReady | EngineFailed | StepOutputs | StatsReply | AdapterReply
