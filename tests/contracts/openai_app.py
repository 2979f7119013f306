"""A serving for tests/integration/test_openai_contract.py beside tests/support/gateway_app.py's:
``faltering``, ``spell`` (a completion item spells its prompt) whose prompts that start with
``fail`` raise at their third step, after two were streamed: an error in mid-stream."""

from __future__ import annotations

from typing import Any

from tests.support.gateway_app import Spell

FAIL_AT = 2  # steps streamed before the error


class Faltering(Spell):
    name = "faltering"

    def decode(self, states: list[dict[str, Any]]) -> list[Any]:
        for s in states:  # the whole step is checked before any state changes
            if s["text"].startswith("fail") and s["at"] == FAIL_AT:
                raise ValueError(f"faltering failed at step {FAIL_AT}")
        return super().decode(states)


faltering = Faltering()
