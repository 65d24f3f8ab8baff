"""GetModelInfoResponse: what the engine reported, the front end's limits and the plugins in use."""

from __future__ import annotations

from typing import Any

import structlog

import loom
from loom.engine.types import EngineInfo
from loom_client.v1 import generation_pb2 as pb

from .settings import ServerSettings
from .validation import MAX_STOP_TOKEN_IDS, RequestLimits

log = structlog.get_logger(__name__)


def plugins_in_use(info: EngineInfo) -> list[pb.PluginInUse]:
    """The attention backend and model architecture serving, plus any the engine listed.

    ``EngineInfo.plugins`` entries are "kind:name", optionally followed by "?key=value&..." (its
    settings, URL-encoded). Distribution and version come from the plugin registry; a plugin it
    cannot place (no entry points installed) is reported as "unknown".
    """
    from urllib.parse import parse_qsl

    wanted: list[tuple[str, str | None]] = [("attention", info.attention_backend), ("model", None)]
    settings: dict[tuple[str, str | None], dict[str, str]] = {}
    for entry in info.plugins:
        kind, _, rest = entry.partition(":")
        name, _, query = rest.partition("?")
        if not name:
            continue
        if (kind, name) not in wanted:
            wanted.append((kind, name))
        # the attention backend's entry carries settings only (e.g. an FP8 KV cache)
        settings.setdefault((kind, name), {}).update(parse_qsl(query))
    try:
        from loom.plugin_api import default_registry

        registry = default_registry()
    except Exception as exc:  # a broken plugin must not break GetModelInfo
        log.warning("plugin registry unavailable", error=repr(exc))
        registry = None
    plugins = [_plugin(registry, kind, name, info.architecture) for kind, name in wanted]
    for plugin, key in zip(plugins, wanted, strict=True):
        plugin.settings.update(settings.get(key, {}))
    return plugins


def _plugin(registry: Any, kind: str, name: str | None, architecture: str) -> pb.PluginInUse:
    dist, version = "unknown", "unknown"
    if kind == "lora":  # built into the server, not a registered plugin (docs/lora.md)
        return pb.PluginInUse(kind=kind, name=name or "", distribution="loom-server", version=loom.__version__)
    try:
        if kind == "model":
            # The engine names either the plugin ("llama") or the HF class ("LlamaForCausalLM").
            known = {i.spec.name for i in registry.infos("model")}
            name = architecture if architecture in known else registry.model_for_architecture([architecture]).name
        found = registry.get(kind, name)
        dist, version = found.distribution, found.version
    except Exception:  # no registry, or a plugin it does not know: report what we know
        pass
    return pb.PluginInUse(kind=kind, name=name or architecture, distribution=dist, version=version)


def model_info_response(info: EngineInfo, settings: ServerSettings, limits: RequestLimits,
                        has_chat_template: bool, plugins: list[pb.PluginInUse]) -> pb.GetModelInfoResponse:
    return pb.GetModelInfoResponse(
        model_id=info.model_id,
        architecture=info.architecture,
        dtype=info.dtype,
        device=info.device,
        limits=pb.ModelLimits(
            max_input_tokens=limits.max_input_tokens,
            max_total_tokens=limits.max_total_tokens,
            max_batch_total_tokens=info.max_batch_total_tokens,
            max_batch_prefill_tokens=settings.engine.max_batch_prefill_tokens,
            max_concurrent_requests=settings.max_concurrent_requests,
            default_max_new_tokens=settings.default_max_new_tokens,
            max_stop_sequences=limits.max_stop_sequences,
            max_top_n_tokens=limits.max_top_n_tokens,
            max_best_of=limits.max_best_of,
            max_queue=settings.max_queue,
            max_stop_token_ids=MAX_STOP_TOKEN_IDS,
        ),
        block_size=info.block_size,
        plugins=plugins,
        server_version=loom.__version__,
        eos_token_ids=list(info.eos_token_ids),
        vocab_size=info.vocab_size,
        num_shard=info.num_shard,
        has_chat_template=has_chat_template,
        max_loras=info.max_loras,
        max_lora_rank=info.max_lora_rank,
    )
