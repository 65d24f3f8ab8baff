"""GenerateRequest / GenerateStreamRequest -> GenerationPlan, or a ValidationError naming fields.

Every rule documented in generation.proto is enforced here, and all violations of a request are
reported together. Nothing is silently clamped: a value out of range is an error. Checks that
need the prompt's length (max_input_tokens, the total budget) run after tokenization.
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass, replace

from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
from loom.frontend.completion import TextOptions
from loom.frontend.generation import GenerationPlan
from loom.frontend.tokenizer import Tokenizer
from loom.structured.checks import ConstraintChecker
from loom_client.v1 import generation_pb2 as pb

from .adapters import check_adapter_name
from .constraint import check_constraint, read_constraint
from .errors import FieldViolation, ValidationError, in_all
from .prompt_input import check_input, check_size, check_special_token_parsing, tokenize_prompt

MAX_REQUEST_ID_BYTES = 256
MAX_STOP_SEQUENCE_BYTES = 256
# Stop ids are checked against every sampled token on the engine's hot path; a bound keeps a
# request from sending the whole vocabulary.
MAX_STOP_TOKEN_IDS = 64
# Bounds that keep the processed logits finite. Temperature divides a logit and the repetition
# penalty divides or multiplies it, so together they scale it by at most 100 / 1e-4 = 1e6 (and the
# frequency and presence penalties add at most 2 x max_total_tokens each): any model's logits stay
# far from float32's 3.4e38. Outside these ranges a request gains nothing: a temperature below
# 1e-4 picks the most likely token (use 0), and a repetition penalty of 100 (or 0.01) already
# moves a seen token's logit a hundredfold.
MIN_TEMPERATURE = 1e-4
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


def as_float32(x: float) -> float:
    """``x`` rounded to float32, as a request carries it: a bound such as 0.01 is not exact in
    float32, and a client that sends the bound itself must be inside it."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


@dataclass(frozen=True)
class RequestLimits:
    max_input_tokens: int
    max_total_tokens: int
    vocab_size: int
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_best_of: int = 2
    default_max_new_tokens: int = 256
    max_input_chars: int = 262_144


class _Checker:
    def __init__(self) -> None:
        self.violations: list[FieldViolation] = []

    def add(self, field: str, description: str) -> None:
        self.violations.append(FieldViolation(field, description))

    def range(self, field: str, value: float, low: float, high: float, low_open: bool, high_open: bool) -> None:
        lo_ok = value > low if low_open else value >= low
        hi_ok = value < high if high_open else value <= high
        if not (math.isfinite(value) and lo_ok and hi_ok):
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            self.add(field, f"must be in {interval}, got {value:g}")


def _check_sampling(c: _Checker, s: pb.SamplingParameters) -> SamplingParams:
    f = "parameters.sampling."
    if s.HasField("temperature") and s.temperature != 0 and not (
            math.isfinite(s.temperature) and s.temperature >= as_float32(MIN_TEMPERATURE)):
        c.add(f + "temperature", f"must be 0 (greedy) or finite and at least {MIN_TEMPERATURE:g}, got {s.temperature:g}")
    if s.HasField("top_p"):
        c.range(f + "top_p", s.top_p, 0, 1, low_open=True, high_open=False)
    if s.HasField("typical_p"):
        c.range(f + "typical_p", s.typical_p, 0, 1, low_open=True, high_open=False)
    if s.HasField("min_p"):
        c.range(f + "min_p", s.min_p, 0, 1, low_open=False, high_open=True)
    # Setting a sampling knob turns sampling on; temperature 0 is greedy whatever else is set.
    do_sample = s.do_sample or any(s.HasField(k) for k in ("top_k", "top_p", "typical_p", "min_p"))
    if s.HasField("temperature"):
        do_sample = s.temperature > 0
    return SamplingParams(
        do_sample=do_sample,
        temperature=s.temperature if s.HasField("temperature") and s.temperature > 0 else 1.0,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        typical_p=s.typical_p if s.HasField("typical_p") else 1.0,
        min_p=s.min_p if s.HasField("min_p") else 0.0,
        seed=s.seed if s.HasField("seed") else None,
    )


def _check_penalties(c: _Checker, p: pb.PenaltyParameters, sampling: SamplingParams) -> SamplingParams:
    f = "parameters.penalties."
    if p.HasField("repetition_penalty"):
        c.range(f + "repetition_penalty", p.repetition_penalty, as_float32(MIN_REPETITION_PENALTY),
                as_float32(MAX_REPETITION_PENALTY), low_open=False, high_open=False)
    for name in ("frequency_penalty", "presence_penalty"):
        if p.HasField(name):
            c.range(f + name, getattr(p, name), -2, 2, low_open=False, high_open=False)
    return replace(
        sampling,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
    )


def _check_stopping(c: _Checker, s: pb.StoppingParameters, limits: RequestLimits) -> None:
    f = "parameters.stopping."
    if s.HasField("max_new_tokens") and s.max_new_tokens < 1:
        c.add(f + "max_new_tokens", "must be at least 1")
    if s.HasField("max_new_tokens") and s.min_new_tokens > s.max_new_tokens:
        c.add(f + "min_new_tokens", f"must be at most max_new_tokens ({s.max_new_tokens}), got {s.min_new_tokens}")
    if len(s.stop_sequences) > limits.max_stop_sequences:
        c.add(f + "stop_sequences", f"at most {limits.max_stop_sequences} stop sequences "
              f"(--max-stop-sequences), got {len(s.stop_sequences)}")
    empty = [i for i, seq in enumerate(s.stop_sequences) if not seq]
    if empty:
        c.add(f"{f}stop_sequences[{empty[0]}]", "must not be empty" + in_all(len(empty), "empty ones"))
    too_long = [i for i, seq in enumerate(s.stop_sequences) if len(seq.encode()) > MAX_STOP_SEQUENCE_BYTES]
    if too_long:
        c.add(f"{f}stop_sequences[{too_long[0]}]",
              f"must be at most {MAX_STOP_SEQUENCE_BYTES} bytes" + in_all(len(too_long), f"over {MAX_STOP_SEQUENCE_BYTES} bytes"))
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        c.add(f + "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(s.stop_token_ids)}")
    bad = [(i, t) for i, t in enumerate(s.stop_token_ids) if t >= limits.vocab_size]
    if bad:
        i, t = bad[0]
        c.add(f"{f}stop_token_ids[{i}]",
              f"token id {t} is not below the vocabulary size {limits.vocab_size}" + in_all(len(bad), "such ids"))
    if s.HasField("time_limit_ms") and s.time_limit_ms < 1:
        c.add(f + "time_limit_ms", "must be at least 1")


def _check_counts(c: _Checker, p: pb.Parameters, limits: RequestLimits, do_sample: bool, streaming: bool) -> tuple[int, int]:
    n = p.n if p.HasField("n") else 1
    best_of = p.best_of if p.HasField("best_of") else n
    if not 1 <= n <= limits.max_best_of:
        c.add("parameters.n", f"must be in [1, {limits.max_best_of}] (--max-best-of), got {n}")
    if p.HasField("best_of"):
        if not n <= best_of <= limits.max_best_of:
            c.add("parameters.best_of", f"must be in [n={n}, {limits.max_best_of}] (--max-best-of), got {best_of}")
        elif best_of > n and not do_sample:
            c.add("parameters.best_of", "above n needs sampling: greedy candidates would all be identical")
        elif best_of > n and streaming:
            c.add("parameters.best_of", "above n is not supported by GenerateStream; use Generate")
    if p.response.top_n_tokens > limits.max_top_n_tokens:
        c.add("parameters.response.top_n_tokens",
              f"must be at most {limits.max_top_n_tokens} (--max-top-n-tokens), got {p.response.top_n_tokens}")
    if p.HasField("truncate_input_tokens") and not 1 <= p.truncate_input_tokens <= limits.max_input_tokens:
        c.add("parameters.truncate_input_tokens",
              f"must be in [1, {limits.max_input_tokens}] (limits.max_input_tokens), got {p.truncate_input_tokens}")
    return n, best_of


def validate_generate(
    request: pb.GenerateRequest | pb.GenerateStreamRequest,
    request_id: str,
    tokenizer: Tokenizer,
    limits: RequestLimits,
    streaming: bool,
    arrival: float | None = None,
    constraints: ConstraintChecker | None = None,
) -> GenerationPlan:
    """``constraints``: the server's structured-output checks (None: constrained requests are
    answered FAILED_PRECONDITION)."""
    arrival = time.monotonic() if arrival is None else arrival
    c = _Checker()
    if len(request.request_id.encode()) > MAX_REQUEST_ID_BYTES:
        c.add("request_id", f"must be at most {MAX_REQUEST_ID_BYTES} bytes")
    c.violations.extend(check_size(request, limits.max_input_chars) or check_input(request, limits.vocab_size))
    c.violations.extend(check_special_token_parsing(request))
    p = request.parameters
    sampling = _check_sampling(c, p.sampling)
    sampling = _check_penalties(c, p.penalties, sampling)
    _check_stopping(c, p.stopping, limits)
    n, best_of = _check_counts(c, p, limits, sampling.do_sample, streaming)
    constraint, shape_violations = read_constraint(p)
    c.violations.extend(shape_violations)
    if request.adapter_id:
        c.violations.extend(check_adapter_name(request.adapter_id))
    if c.violations:
        raise ValidationError(c.violations)
    if constraint is not None:
        violations = check_constraint(constraint, constraints)
        if violations:
            raise ValidationError(violations)

    prompt = tokenize_prompt(request, tokenizer)
    ids = prompt.token_ids
    prompt_text = prompt.text
    if p.HasField("truncate_input_tokens") and len(ids) > p.truncate_input_tokens:
        ids = ids[-p.truncate_input_tokens :]
        prompt_text = tokenizer.decode(ids, skip_special_tokens=False)
    if not ids:
        raise ValidationError([FieldViolation(prompt.field, "the prompt tokenizes to no tokens")])
    if len(ids) > limits.max_input_tokens:
        raise ValidationError([FieldViolation(prompt.field, (
            f"the prompt has {len(ids)} tokens, more than limits.max_input_tokens={limits.max_input_tokens}; "
            "shorten it or set parameters.truncate_input_tokens"))])
    st = p.stopping
    budget = limits.max_total_tokens - len(ids)
    if st.HasField("max_new_tokens"):
        max_new = st.max_new_tokens
        if max_new > budget:
            raise ValidationError([FieldViolation("parameters.stopping.max_new_tokens", (
                f"the prompt's {len(ids)} tokens plus max_new_tokens={max_new} exceed "
                f"limits.max_total_tokens={limits.max_total_tokens}; at most {budget} are left"))])
    else:
        max_new = min(limits.default_max_new_tokens, budget)
        if st.min_new_tokens > max_new:
            raise ValidationError([FieldViolation("parameters.stopping.min_new_tokens", (
                f"must be at most the default max_new_tokens ({max_new} for this prompt), got {st.min_new_tokens}"))])

    resp = p.response
    engine_request = EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(ids),
        sampling=replace(sampling, top_n_tokens=resp.top_n_tokens, prompt_logprobs=resp.prompt_logprobs,
                         speculate=not p.HasField("speculation") or p.speculation,
                         constraint=constraint),
        stopping=StoppingParams(max_new_tokens=max_new, min_new_tokens=st.min_new_tokens,
                                stop_token_ids=tuple(st.stop_token_ids), ignore_eos=st.ignore_eos),
        priority=p.priority,
        n=best_of,
        arrival_time=arrival,
        adapter_id=request.adapter_id,
    )
    return GenerationPlan(
        engine_request=engine_request,
        n=n,
        text=TextOptions(
            stop_sequences=tuple(st.stop_sequences),
            include_stop_sequence=st.include_stop_sequence,
            min_new_tokens=st.min_new_tokens,
            want_tokens=resp.tokens or resp.logprobs or resp.top_n_tokens > 0,
            want_logprobs=resp.logprobs,
        ),
        prompt_text=prompt_text,
        return_full_text=resp.return_full_text,
        prompt_logprobs=resp.prompt_logprobs,
        time_limit_s=st.time_limit_ms / 1000 if st.HasField("time_limit_ms") else None,
        arrival=arrival,
    )

