"""Runners that measure one peer of queueserve each (``python -m bench.peers`` starts them).

Each runner is a module run with ``.venv-peers``'s python (the peers' pinned dependencies clash
with queueserve's venv: see bench/peers-requirements.txt), against the private redis-server whose
URL it is given. It starts the peer's worker, measures with :mod:`bench.peers_runners._measure`
(the code that measures queueserve and the hand-written loop too), stops the worker with its
whole process group, and prints one JSON line. Nothing here imports queueserve.
"""
