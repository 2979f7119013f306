"""The embedding peers' servers, as ``python -m bench.embed_peers`` starts them.

Each module here runs with the python of its peer's own virtualenv (``.venv-embed/<peer>``,
made by scripts/bench-embed-peers from bench/embed-peers-<peer>-requirements.txt: their pins
clash with queueserve's venv and with each other) and serves all-MiniLM-L6-v2 from the model
directory it is given, over HTTP on 127.0.0.1, with the body and answer of OpenAI's
``POST /v1/embeddings``. Infinity needs no module: its own CLI serves that route. Nothing here
imports queueserve or the rest of bench/.
"""
