"""The MiniLM serving as ``python -m bench.embed_peers`` serves it: tasks.embed's ``Embed``
(length-bucket batch keys computed in the caller, tokenizing in the preparation stage) with
the peers' batch limit and wait: at most 32 texts a batch, 10 ms for a batch to fill. The
worker runs it with ``--torch-threads 1`` and one partition, as each peer runs one replica
with one torch thread.
"""

from __future__ import annotations

from tasks.embed import Embed

BATCH = 32
WAIT_S = 0.010

embed = Embed(batch_size=BATCH, batch_timeout=WAIT_S)
# The same serving set as Infinity runs (its batch handler takes what is queued, no wait): not
# judged, it shows what of a gap to Infinity is the 10 ms wait and what is queueserve.
embed_nowait = Embed(batch_size=BATCH, batch_timeout=0)
