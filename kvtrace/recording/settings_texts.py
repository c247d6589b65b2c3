"""Settings objects as span attributes: JSON text, written once while the same objects repeat.

A record's ``config`` holds settings as dicts (sampling, numerics, cache settings), and most of them
are the same objects on every span of a process: a llama.cpp model's numerics are one dict, its
sampling defaults the same values.  Writing one with ``json.dumps(sort_keys=True)`` costs 4-8 µs;
:class:`SettingsTexts` remembers the text of a dict by its names and the identity of its values and
gives it back while its names are the same text and its values the very same objects.  Identity,
not equality, for the values: ``0.0 == -0.0`` and ``1 == True`` are equal yet written differently.
Only dicts of text names and immutable scalar values are remembered (a list in one could change in
place), and the remembered values are held, so their ids are not taken by others while remembered.
"""

from __future__ import annotations

import json

_SCALARS = frozenset((str, int, float, bool, type(None)))
"""Value types whose objects never change: a text remembered for them stays true."""


def settings_text(settings: dict) -> str:
    """A settings object (``config`` values that are dicts) as the span attribute's JSON text; a patch
    whose settings rarely change may hand the text over itself."""
    return json.dumps(settings, sort_keys=True)


class SettingsTexts:
    """:func:`settings_text`, remembered for up to ``limit`` dicts (forgotten all at once when full).
    One per recorder, used where its spans are built; no lock: each entry is right whoever wrote it."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self._texts: dict[tuple[tuple[str, ...], tuple[int, ...]], tuple[tuple, str]] = {}

    def text(self, settings: dict) -> str:
        names = tuple(settings)
        identity = (names, tuple(map(id, settings.values())))
        remembered = self._texts.get(identity)
        if remembered is not None:
            return remembered[1]
        text = settings_text(settings)
        values = tuple(settings.values())
        if _SCALARS.issuperset(map(type, values)) and all(type(name) is str for name in names):
            if len(self._texts) >= self.limit:
                self._texts.clear()
            self._texts[identity] = (values, text)  # the values held: their ids stay theirs
        return text
