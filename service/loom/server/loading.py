"""Start-up work between "listening" and "serving": model files, tokenizer, engine, warm-up."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import structlog

from loom.config import ConfigError
from loom.engine.core_process import AsyncEngineClient
from loom.engine.types import EngineInfo, EngineRequest, StoppingParams
from loom.frontend.generation import GenerationPlan, collect_completions, generate_chunks
from loom.frontend.tokenizer import Tokenizer
from loom.process_tuning import freeze_startup_objects
from loom.structured.checks import ConstraintChecker

from .model_info import model_info_response, plugins_in_use
from .servicer import Backend
from .settings import ServerSettings
from .validation import RequestLimits

log = structlog.get_logger(__name__)


def request_limits(settings: ServerSettings, info: EngineInfo) -> RequestLimits:
    max_total = info.max_model_len
    max_input = settings.engine.max_input_tokens or max_total - 1
    if max_input >= max_total:
        raise ConfigError(f"--max-input-tokens ({max_input}) must be below --max-total-tokens ({max_total})")
    return RequestLimits(
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        vocab_size=info.vocab_size,
        max_stop_sequences=settings.max_stop_sequences,
        max_top_n_tokens=settings.max_top_n_tokens,
        max_best_of=settings.max_best_of,
        default_max_new_tokens=settings.default_max_new_tokens,
        max_input_chars=settings.max_input_chars,
    )


def _model_dir(model_id: str | None) -> Path:
    from loom.model_loader import resolve_model_dir

    return Path(resolve_model_dir(model_id))


async def warm_up(engine: AsyncEngineClient, tokenizer: Tokenizer) -> None:
    """One short generation through the whole path, so the first client does not pay for it."""
    ids = tokenizer.encode("Hello") or [0]
    plan = GenerationPlan(EngineRequest("warmup", tuple(ids), stopping=StoppingParams(max_new_tokens=2)))
    started = time.monotonic()
    await collect_completions(generate_chunks(engine, tokenizer, plan), plan)
    log.info("warm-up done", duration_ms=round((time.monotonic() - started) * 1000, 1))


async def load_backend(settings: ServerSettings, engine: AsyncEngineClient) -> Backend:
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    # Resolve (and on first use convert) the model here, before the engine process looks for
    # it, so the two processes never convert the same model at once.
    model_dir = await loop.run_in_executor(None, _model_dir, settings.engine.model_id)
    log.info("loading model", model_dir=str(model_dir))
    tokenizer_task = loop.run_in_executor(None, Tokenizer.from_model_dir, model_dir)
    info = await engine.start()  # on failure the caller shuts the engine down
    tokenizer = await tokenizer_task
    # Whether this vocabulary can be described to xgrammar, decided once (imports xgrammar, ~1 s).
    constraints = await loop.run_in_executor(None, ConstraintChecker.for_tokenizer, tokenizer.hf_tokenizer,
                                             info.vocab_size, info.eos_token_ids)
    if constraints.unavailable is not None:
        log.warning("structured output unavailable: constrained requests get FAILED_PRECONDITION",
                    reason=constraints.unavailable)
    limits = request_limits(settings, info)
    if settings.warmup:
        await warm_up(engine, tokenizer)
    model_info = model_info_response(info, settings, limits, tokenizer.has_chat_template, plugins_in_use(info))
    freeze_startup_objects()  # the tokenizer and protobuf state live as long as the server
    log.info("model loaded", model_id=info.model_id, duration_s=round(time.monotonic() - started, 2),
             max_input_tokens=limits.max_input_tokens, max_total_tokens=limits.max_total_tokens)
    return Backend(engine, tokenizer, limits, info, model_info, constraints)
