"""The OpenAI-compatible REST/SSE layer: request validation, tokenization and
block hashing, streaming, API keys and OpenAI-style errors, in front of a
``pdcluster.services.backend.Backend``."""

from pdcluster.services.openai.routes import configure_app, create_app, install_openai_api
from pdcluster.services.openai.settings import OpenAISettings

__all__ = ["OpenAISettings", "configure_app", "create_app", "install_openai_api"]
