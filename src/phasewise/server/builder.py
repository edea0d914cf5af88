"""The one build of a server, `phasewise serve`'s and each Ray replica's: the engine on its own thread,
then the FastAPI app over it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from phasewise.config import EngineConfig
from phasewise.engine.llm_engine import LLMEngine
from phasewise.server.app import create_app
from phasewise.server.async_engine import AsyncEngine
from phasewise.server.config import ServeOptions, ServerConfig, model_names
from phasewise.server.dashboard_feed import Roofline


@dataclass(frozen=True)
class ServerParts:
    engine: LLMEngine              # built, warmed up, its grammars' tokenizer view under way
    async_engine: AsyncEngine      # the thread that owns `engine`
    app: FastAPI
    config: ServerConfig
    roofline: Roofline | None      # the dashboard's roofs (None: the machine was never measured)


def build_server(config: EngineConfig, options: ServeOptions,
                 roofline: Callable[[LLMEngine], Roofline | None] | None = None) -> ServerParts:
    """`options`: serve's server flags (names, keys, limits, thinking);
    `roofline`: the dashboard's roofs for the built engine (the lab's, which the server cannot import)."""

    def build() -> LLMEngine:           # on the engine thread, which then owns the OpenMP pool
        engine = LLMEngine(config)
        engine.warmup()
        engine.grammars.prepare()       # structured outputs' tokenizer view, in the background
        return engine

    async_engine = AsyncEngine(build)
    engine = async_engine.engine
    assert isinstance(engine, LLMEngine)        # build's (AsyncEngine holds it as any EngineClient)
    path = Path(engine.model_path)
    name, aliases = model_names(options.served_model_name or None, options.model, path)
    server_config = ServerConfig(
        served_model_name=name, model_aliases=aliases, api_keys=options.api_keys,
        max_waiting=options.max_waiting, max_body_bytes=options.max_body_bytes, model_root=str(path),
        role=config.kv_role, reasoning_parser=options.reasoning_parser,
        reasoning_budget=options.reasoning_budget)
    roofs = roofline(engine) if roofline else None
    app = create_app(async_engine, server_config, roofs)
    return ServerParts(engine, async_engine, app, server_config, roofs)
