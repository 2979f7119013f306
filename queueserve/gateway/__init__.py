"""An HTTP gateway to queueserve servings, for producers in any language: JSON endpoints,
Server-Sent Events, and the OpenAI embeddings and completions API (docs/gateway.md).

Needs the ``gateway`` extra (``pip install queueserve[gateway]``): Starlette, uvicorn and
prometheus-client. ``queueserve gateway --port 8000`` runs it; ``create_app`` gives the ASGI
app to run or mount yourself.
"""

from queueserve.gateway.app import create_app
from queueserve.gateway.openai_api import DEFAULT_MODELS

__all__ = ["DEFAULT_MODELS", "create_app"]
