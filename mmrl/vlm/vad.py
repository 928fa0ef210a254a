"""Valence-arousal-dominance (VAD) values of the eight EmoSet / Mikels emotion categories.

Source: the NRC Valence, Arousal, and Dominance Lexicon, version 1.0 (4 May 2018),
S. M. Mohammad, "Obtaining Reliable Human Ratings of Valence, Arousal, and Dominance for
20,000 English Words", ACL 2018 (http://saifmohammad.com/WebPages/nrc-vad.html). Each value
is the word's score in [0, 1] (0 = lowest valence / arousal / dominance), copied from the
file `NRC-VAD-Lexicon.txt` (tab-separated "Word Valence Arousal Dominance", 19,971 entries).

Verified: every value below was read from the lexicon rows of two independent public
copies of that file (GitHub KristinHuangg/gpt-writing-prompts @ ea0220d, NRC-VAD-Lexicon.txt;
alexander-schott/LyricGenerator @ 08de2d2, NRC-VAD-Lexicon.txt), which agree on all eight.
Not from v2 (2025), which rescales the scores to [-1, 1] and revises them.

The scores are the lexicon's, surprises included: "awe" has low dominance (0.300) and
"contentment" a moderate arousal (0.610). The NRC terms of use allow free non-commercial
research use with citation; eight rows are reproduced here.
"""

from __future__ import annotations

__all__ = ["EMOTIONS", "VAD", "vad"]

# The Mikels categories in EmoSet's order: four positive, then four negative.
EMOTIONS: tuple[str, ...] = (
    "amusement", "awe", "contentment", "excitement", "anger", "disgust", "fear", "sadness",
)

# word -> (valence, arousal, dominance), NRC VAD Lexicon v1.0
VAD: dict[str, tuple[float, float, float]] = {
    "amusement": (0.929, 0.837, 0.803),
    "awe": (0.469, 0.740, 0.300),
    "contentment": (0.875, 0.610, 0.782),
    "excitement": (0.896, 0.684, 0.731),
    "anger": (0.167, 0.865, 0.657),
    "disgust": (0.052, 0.775, 0.317),
    "fear": (0.073, 0.840, 0.293),
    "sadness": (0.052, 0.288, 0.164),
}


def vad(word: str) -> tuple[float, float, float] | None:
    """The (valence, arousal, dominance) of `word` (lower-cased, stripped); None if the
    word is not one of EMOTIONS (or not a string)."""
    if not isinstance(word, str):
        return None
    return VAD.get(word.strip().lower())
