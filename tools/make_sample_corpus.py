"""Regenerate ``fsdp_bridge/data/sample_corpus.txt``, the corpus of the built-in default job.

    python tools/make_sample_corpus.py

The text is composed here from small word lists and sentence patterns (seeded, so the
output is identical every time): short village stories in plain English, with enough
regularity for a tiny model to learn within a minute and enough variety that the
held-out loss is meaningful.  Nothing is downloaded.
"""

from __future__ import annotations

import random
from pathlib import Path

PEOPLE = ["Anna", "Ben", "Clara", "David", "Ella", "Finn", "Grace", "Hugo", "Iris", "Jonah", "Kate", "Leo",
          "Maya", "Noah", "Olive", "Peter", "Rosa", "Sam", "Tessa", "Victor"]
ROLES = ["baker", "farmer", "teacher", "fisher", "painter", "doctor", "miller", "weaver", "carpenter", "gardener"]
PLACES = ["the market", "the river", "the old mill", "the school", "the harbour", "the hill", "the forest",
          "the library", "the bakery", "the bridge", "the garden", "the station"]
THINGS = ["a basket of apples", "a blue kite", "an old map", "a loaf of bread", "a wooden box", "a small boat",
          "a red umbrella", "a jar of honey", "a letter", "a lantern", "a book of songs", "a pair of boots"]
ANIMALS = ["a grey cat", "a brown dog", "a white goat", "a young fox", "a pair of ducks", "an old horse", "a crow"]
WEATHER = ["The sun was warm", "A cold wind blew from the north", "Rain fell all morning", "The sky was clear",
           "Fog lay over the fields", "Snow covered the roofs", "The air smelled of spring"]
TIMES = ["In the morning", "At noon", "In the afternoon", "In the evening", "Late at night", "Before dawn",
         "On Sunday", "The next day", "After lunch"]
FEELINGS = ["happy", "tired", "curious", "worried", "proud", "calm", "surprised", "hungry", "glad"]
VERBS_GO = ["walked to", "ran to", "went to", "hurried to", "wandered to", "rode to"]
VERBS_FIND = ["found", "saw", "carried", "lost", "bought", "painted", "fixed", "gave away"]
SAYINGS = ["We should go home before dark", "I have never seen anything like it", "Let us share what we have",
           "The river is higher than last year", "Tomorrow will be a better day", "Can you help me with this",
           "It is time to start the work", "Look at the colour of the sky"]


def _person(rng: random.Random) -> str:
    return rng.choice(PEOPLE)


def sentence(rng: random.Random, hero: str, friend: str) -> str:
    pattern = rng.randrange(10)
    if pattern == 0:
        return f"{rng.choice(TIMES)}, {hero} {rng.choice(VERBS_GO)} {rng.choice(PLACES)}."
    if pattern == 1:
        return f"There {hero} {rng.choice(VERBS_FIND)} {rng.choice(THINGS)}."
    if pattern == 2:
        return f"{rng.choice(WEATHER)}, and {hero} felt {rng.choice(FEELINGS)}."
    if pattern == 3:
        return f'"{rng.choice(SAYINGS)}," said {hero} to {friend}.'
    if pattern == 4:
        return f"{friend} the {rng.choice(ROLES)} was waiting near {rng.choice(PLACES)}."
    if pattern == 5:
        return f"On the way they met {rng.choice(ANIMALS)}, and it followed them for a while."
    if pattern == 6:
        n = rng.randint(2, 9)
        return f"{hero} counted {n} {'boats' if n > 5 else 'birds'} and told {friend} the number."
    if pattern == 7:
        return f"{friend} asked why {hero} looked so {rng.choice(FEELINGS)}, and {hero} only smiled."
    if pattern == 8:
        return f"Together they {rng.choice(VERBS_FIND)} {rng.choice(THINGS)} and took it to {rng.choice(PLACES)}."
    return f"{rng.choice(WEATHER)} when {hero} and {friend} came back from {rng.choice(PLACES)}."


def story(rng: random.Random, index: int) -> str:
    hero, friend = rng.sample(PEOPLE, 2)
    role = rng.choice(ROLES)
    lines = [f"Story {index}. {hero} and {friend}.", "",
             f"Once there was a {role} called {hero} who lived near {rng.choice(PLACES)}."]
    for _ in range(rng.randint(2, 4)):
        paragraph = [sentence(rng, hero, friend) for _ in range(rng.randint(3, 6))]
        lines.append(" ".join(paragraph))
    lines.append(f"In the end {hero} went home {rng.choice(FEELINGS)}, and {friend} promised to come again.")
    return "\n".join(lines)


def main(target_bytes: int = 240_000) -> None:
    rng = random.Random(20240601)
    stories: list[str] = []
    size = 0
    while size < target_bytes:
        text = story(rng, len(stories) + 1)
        stories.append(text)
        size += len(text) + 2
    out = Path(__file__).resolve().parents[1] / "fsdp_bridge" / "data" / "sample_corpus.txt"
    out.write_text("\n\n".join(stories) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(stories)} stories)")


if __name__ == "__main__":
    main()
