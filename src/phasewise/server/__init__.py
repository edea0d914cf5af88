"""The OpenAI-compatible HTTP server: `phasewise serve`."""

from phasewise.server.config import ServerConfig
from phasewise.server.app import create_app
from phasewise.server.async_engine import AsyncEngine, SubRequest
from phasewise.server.request_stream import RequestStream
from phasewise.server.errors import EngineError

__all__ = ["AsyncEngine", "EngineError", "RequestStream", "ServerConfig", "SubRequest", "create_app"]
