"""Synthetic text for the bundled demo corpus: a small English-like grammar, deterministic.

Generated rather than copied, so the project may ship it; structured enough (agreement,
repeated entities, simple arithmetic, lists) that a tiny model's loss falls visibly.
"""

from __future__ import annotations

import random

_NOUNS = (
    "river",
    "garden",
    "engine",
    "teacher",
    "village",
    "signal",
    "mountain",
    "library",
    "sailor",
    "window",
    "forest",
    "market",
    "compiler",
    "planet",
    "lantern",
    "bridge",
    "farmer",
    "painter",
    "kettle",
    "harbor",
    "tower",
    "student",
    "castle",
    "meadow",
)
_ADJS = (
    "quiet",
    "bright",
    "old",
    "narrow",
    "patient",
    "golden",
    "broken",
    "gentle",
    "heavy",
    "curious",
    "distant",
    "careful",
    "silver",
    "crowded",
    "simple",
    "ancient",
)
_VERBS = (
    ("watches", "watched"),
    ("builds", "built"),
    ("follows", "followed"),
    ("repairs", "repaired"),
    ("finds", "found"),
    ("carries", "carried"),
    ("paints", "painted"),
    ("visits", "visited"),
    ("measures", "measured"),
)
_PLACES = (
    "near the sea",
    "behind the hill",
    "in the north",
    "under the old bridge",
    "at the edge of town",
    "beside the station",
    "across the valley",
)
_TIMES = ("Every morning", "At night", "In winter", "On Sundays", "After the storm", "Today")
_NAMES = ("Ada", "Bruno", "Chen", "Dara", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas")


def _sentence(rng: random.Random, subject: str) -> str:
    verb = rng.choice(_VERBS)
    kind = rng.randrange(5)
    obj = f"the {rng.choice(_ADJS)} {rng.choice(_NOUNS)}"
    if kind == 0:
        return f"{rng.choice(_TIMES)}, {subject} {verb[0]} {obj} {rng.choice(_PLACES)}."
    if kind == 1:
        return f"Yesterday {subject} {verb[1]} {obj}, and then {verb[1]} it again."
    if kind == 2:
        a, b = rng.randrange(2, 50), rng.randrange(2, 50)
        return f"{subject.capitalize()} counted {a} plus {b} and wrote {a + b}."
    if kind == 3:
        start = rng.randrange(1, 20)
        seq = ", ".join(str(start + i) for i in range(rng.randrange(3, 7)))
        return f"The numbers on the wall read {seq}."
    return f"{subject.capitalize()} said that {obj} is {rng.choice(_ADJS)}."


def document(rng: random.Random) -> str:
    """One paragraph-sized document about a named character."""
    name = rng.choice(_NAMES)
    noun = rng.choice(_NOUNS)
    title = f"{name} and the {rng.choice(_ADJS)} {noun}"
    subjects = [name, f"the {noun}", "she" if rng.random() < 0.5 else "he"]
    body = " ".join(_sentence(rng, rng.choice(subjects)) for _ in range(rng.randrange(3, 12)))
    return f"{title}\n\n{body}"


def corpus(n_docs: int, seed: int = 0) -> list[str]:
    """`n_docs` documents, the same for the same seed."""
    rng = random.Random(seed)
    return [document(rng) for _ in range(n_docs)]


def conversation(rng: random.Random) -> dict:
    """A ShareGPT-style record: a user asks about sums or a character, the assistant answers."""
    turns = []
    if rng.random() < 0.3:
        turns.append({"from": "system", "value": "You are a careful assistant who counts."})
    for _ in range(rng.randrange(1, 4)):
        a, b = rng.randrange(2, 60), rng.randrange(2, 60)
        name = rng.choice(_NAMES)
        turns.append(
            {
                "from": "human",
                "value": f"{name} has {a} apples and finds {b} more. How many apples now?",
            }
        )
        turns.append(
            {"from": "gpt", "value": f"{name} now has {a} plus {b}, which is {a + b} apples."}
        )
    return {"conversations": turns}


def conversations(n: int, seed: int = 0) -> list[dict]:
    """`n` ShareGPT-style records, the same for the same seed."""
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(n)]
