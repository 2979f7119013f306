"""Continuous batching for step servings (``qs.StepServing``; docs/generation.md): requests join
and leave a running set between decode steps.

- ``joins``: who waits, who joins the running set and when (pure logic: the scheduler);
- ``executor``: the executor thread of a step serving, a cycle per step;
- ``calls``: what the executor calls of the serving (measure, prefill, decode, answer);
- ``callers``: streaming callers that went away;
- ``key_loads``: with ``load_key``, the keys' states the running set holds, and their loads;
- ``prefix_cache``: prompt-prefix states, resumed by later prompts (pure logic).

The batch pipeline (worker/pipeline/) reads, decodes and replies for both kinds of serving; a
step serving's runner hands its reads to ``joins.StepQueue`` and runs ``executor.StepExecutor``
instead of batch executors.
"""
