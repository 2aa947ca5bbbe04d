"""Procedural filler text and person names for the long-context retrieval family.

Sentences are built from small hand-written word lists with a seeded `random.Random`, so every example gets
different filler and nothing is downloaded. The filler never contains a digit or the word "code", so a fact
`The code of <name> is <number>.` cannot be imitated by it.
"""

from __future__ import annotations

import random

_NOUNS = (
    "river", "garden", "window", "teacher", "market", "lantern", "village", "harbor", "meadow", "kettle",
    "bridge", "orchard", "painter", "library", "forest", "basket", "wagon", "valley", "candle", "farmer",
    "castle", "mirror", "island", "ladder", "sailor", "pillow", "tower", "blanket", "station", "baker",
    "letter", "journey", "cottage", "engine", "shadow", "pebble", "feather", "meeting", "hill", "fountain",
    "scholar", "carpet", "harvest", "notebook", "workshop", "student", "chimney", "canal", "tailor", "storm",
    "compass", "festival", "kitchen", "fisherman", "bakery", "courtyard", "violin", "traveler", "clock", "field",
)  # fmt: skip
_ADJECTIVES = (
    "quiet", "bright", "old", "narrow", "gentle", "busy", "distant", "golden", "small", "heavy",
    "cold", "warm", "patient", "crowded", "green", "silent", "careful", "wooden", "curious", "tall",
    "early", "muddy", "friendly", "empty", "ancient", "steady", "pale", "cheerful", "tired", "hidden",
    "sunny", "windy", "humble", "broad", "simple", "lively", "dusty", "calm", "clever", "rusty",
)  # fmt: skip
_VERBS = (
    "watched", "crossed", "painted", "visited", "carried", "repaired", "followed", "described", "cleaned",
    "opened", "passed", "measured", "remembered", "collected", "greeted", "noticed", "built", "moved",
    "found", "admired", "guarded", "studied", "reached", "covered", "lifted", "shared", "counted", "planted",
)  # fmt: skip
_INTRANSITIVE = (
    "rested", "waited", "slept", "wandered", "listened", "laughed", "worked", "paused", "lingered",
    "returned", "sang", "shivered", "hurried", "stayed", "drifted", "glowed",
)  # fmt: skip
_PREPOSITIONS = ("near", "behind", "beside", "under", "above", "across", "around", "beyond", "inside")
_ADVERBS = (
    "slowly", "quietly", "often", "rarely", "gladly", "softly", "early", "later", "briefly", "again",
    "carefully", "happily", "calmly", "suddenly", "patiently",
)  # fmt: skip
_TIMES = (
    "In the morning", "At dusk", "Every spring", "Long ago", "On most days", "After the rain",
    "During the winter", "Before noon", "Late at night", "Each autumn", "Once in a while", "By evening",
)  # fmt: skip

# Names: a first name and a two-syllable family name, about 60 * 14 * 14 * 10 distinct people.
_FIRST_NAMES = (
    "Anna", "Boris", "Clara", "Dmitri", "Elena", "Felix", "Greta", "Hugo", "Ines", "Jonas",
    "Katya", "Lukas", "Marta", "Nikolai", "Olga", "Pavel", "Rosa", "Stefan", "Tamara", "Viktor",
    "Wanda", "Yuri", "Zofia", "Anton", "Bianca", "Carlos", "Dora", "Emil", "Freya", "Gustav",
    "Hanna", "Igor", "Julia", "Karl", "Lena", "Milan", "Nora", "Oskar", "Petra", "Rafael",
    "Sara", "Tomas", "Ulla", "Vera", "Walter", "Xenia", "Yara", "Zeno", "Alma", "Bruno",
    "Celia", "Dario", "Edith", "Fabian", "Gloria", "Henrik", "Irene", "Jakob", "Karin", "Leon",
)  # fmt: skip
_ONSETS = ("B", "D", "F", "G", "K", "L", "M", "N", "P", "R", "S", "T", "V", "Z")
_MIDDLES = ("al", "er", "in", "or", "ul", "an", "es", "ov", "ar", "il", "en", "ur", "ol", "ek")
_ENDINGS = ("ski", "ner", "vic", "berg", "sen", "ley", "dor", "mann", "ton", "rik")


def person_name(rng: random.Random) -> tuple[str, str]:
    """(first name, family name), e.g. ("Marta", "Kolberg")."""
    return rng.choice(_FIRST_NAMES), rng.choice(_ONSETS) + rng.choice(_MIDDLES) + rng.choice(_ENDINGS)


def _with_article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def sentence(rng: random.Random) -> str:
    """One plain sentence, e.g. "The quiet baker repaired the old wagon near the canal."."""
    a, n = lambda: rng.choice(_ADJECTIVES), lambda: rng.choice(_NOUNS)
    form = rng.randrange(6)
    if form == 0:
        return f"The {a()} {n()} {rng.choice(_VERBS)} the {a()} {n()} {rng.choice(_PREPOSITIONS)} the {n()}."
    if form == 1:
        return f"{rng.choice(_TIMES)}, the {n()} {rng.choice(_INTRANSITIVE)} {rng.choice(_ADVERBS)}."
    if form == 2:
        subject = _with_article(a()).capitalize()
        return f"{subject} {n()} {rng.choice(_INTRANSITIVE)} {rng.choice(_PREPOSITIONS)} the {a()} {n()}."
    if form == 3:
        return f"Nobody {rng.choice(_VERBS)} the {n()} {rng.choice(_ADVERBS)}, as it was {a()} and {a()}."
    if form == 4:
        return f"The {n()} {rng.choice(_PREPOSITIONS)} the {n()} was {a()}, and the {n()} was {a()}."
    return f"{rng.choice(_TIMES)}, {_with_article(a())} {n()} {rng.choice(_VERBS)} the {n()} {rng.choice(_ADVERBS)}."


class FillerStream:
    """A seeded, lazily extended list of sentences, each followed by a space or a paragraph break.

    `text(n)` is always a prefix of `text(n + 1)`'s sentence list, so a caller can search for the sentence
    count that reaches a length without changing the sentences it already has."""

    def __init__(self, rng: random.Random):
        self._rng = rng
        self._sentences: list[str] = []
        self._breaks: list[str] = []
        self.chars: list[int] = []  # cumulative characters of the first i+1 sentences with their separators

    def extend_to(self, n: int) -> None:
        while len(self._sentences) < n:
            s, sep = sentence(self._rng), "\n\n" if self._rng.random() < 0.15 else " "
            self._sentences.append(s)
            self._breaks.append(sep)
            self.chars.append((self.chars[-1] if self.chars else 0) + len(s) + len(sep))

    def sentences(self, n: int) -> list[tuple[str, str]]:
        """The first `n` (sentence, separator) pairs."""
        self.extend_to(n)
        return list(zip(self._sentences[:n], self._breaks[:n]))

    def count_for_chars(self, num_chars: int) -> int:
        """The fewest sentences whose text reaches `num_chars` characters."""
        while not self.chars or self.chars[-1] < num_chars:
            self.extend_to(len(self._sentences) + 64)
        lo, hi = 0, len(self.chars) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if self.chars[mid] < num_chars else (lo, mid)
        return lo + 1
