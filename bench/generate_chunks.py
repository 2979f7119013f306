"""How many prompt characters charlm should read per decode step (``prompt_chunk``).

    python -m bench.generate_chunks [--repeat 2]

One worker process (one partition) serves charlm four times, prefix cache off (the loads
repeat, and would find their prompts cached), reading prompts in chunks of 4, 8, 16 and 64
characters per step while others in the step emit and slots are free (one per step once the
running set is full: ``CharLM.reading_chunk``); bench/generate.py's mixed load goes to each
in turn, at 30 arrivals/s (time to first character, time per output character) and saturating
(160 requests at 300/s: characters per second), ``--repeat`` times interleaved, so a busy
machine moves all four alike. Longer chunks mean fewer steps before the first character; but
a step in which a sequence reads a chunk is as long as its chunk for every sequence in it,
which the others see as time per output character.
"""

from __future__ import annotations

import argparse

from bench.generate import charlm_worker, run_load, summarize, workload
from tasks.charlm import CharLM

CHUNKS = (4, 8, 16, 64)
chunk4 = CharLM(name="charlm_chunk4", prompt_chunk=4, prefix_cache_bytes=0)
chunk8 = CharLM(name="charlm_chunk8", prompt_chunk=8, prefix_cache_bytes=0)
chunk16 = CharLM(name="charlm_chunk16", prompt_chunk=16, prefix_cache_bytes=0)
chunk64 = CharLM(name="charlm_chunk64", prompt_chunk=64, prefix_cache_bytes=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    names = [f"charlm_chunk{c}" for c in CHUNKS]
    specs = [f"bench.generate_chunks:chunk{c}" for c in CHUNKS]
    with charlm_worker(specs, names) as (client, _, _):
        for count, rate in ((80, 30.0), (160, 300.0)):
            print(f"{count} requests at {rate:g}/s")
            for _ in range(args.repeat):
                for name in names:
                    summarize(
                        name.removeprefix("charlm_"),
                        *run_load(client, name, workload(count, rate, 0)),
                    )


if __name__ == "__main__":
    main()
