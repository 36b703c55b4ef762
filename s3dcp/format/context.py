"""Where in stored metadata a check is: text built only when an error names it.

A decode checks every field of every entry, and each check is told where it is
(``state_dict_metadata['model.w'].chunks[17].offsets``) so that a refusal can name the field. Built
as text for every check, that context costs a copy of the tensor's name per chunk: a crafted
object holding one name of a few MB and many chunks made a decode copy terabytes (a 224 KB
format-3 object took 46 s). :class:`At` keeps the parts instead (a parent and a suffix) and joins
them only in ``str()``, which only an error message calls; a name is quoted and cut to
:data:`NAME_CHARS` characters there (:func:`quoted`), so no message carries a name of megabytes.

    At("state_dict_metadata", "[", quoted(fqn), "]")          # one object, no copy of fqn
    At(where, ".chunks[", j, "]")                               # per chunk: one small object
    raise MetadataFormatError(f"{where}: expected ...")         # the text, only here
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = ["At", "quoted", "shown", "NAME_CHARS"]

NAME_CHARS = 200  # of a name quoted in an error message; the rest is elided


class At:
    """A place: ``parent`` (text or another :class:`At`) followed by ``parts``, joined on ``str()``."""

    __slots__ = ("parent", "parts")

    def __init__(self, parent: Any, *parts: Any) -> None:
        self.parent, self.parts = parent, parts

    def __str__(self) -> str:
        chain = []
        node: Any = self
        while isinstance(node, At):  # a loop, not recursion: JSON nests up to the parser's depth
            chain.append(node.parts)
            node = node.parent
        out = [str(node)]
        for parts in reversed(chain):
            out.extend(map(str, parts))
        return "".join(out)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __repr__(self) -> str:
        return f"At({str(self)!r})"


class quoted:
    """``repr(name)`` for a message, cut to :data:`NAME_CHARS` characters; made when printed."""

    __slots__ = ("name",)

    def __init__(self, name: Any) -> None:
        self.name = name

    def __str__(self) -> str:
        name = self.name
        if type(name) is str and len(name) > NAME_CHARS:
            return f"{name[:NAME_CHARS]!r}... ({len(name)} characters)"
        text = repr(name)
        return text if len(text) <= NAME_CHARS + 2 else text[:NAME_CHARS] + "..."

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxtuple, _REPR.maxstring, _REPR.maxother = 3, 8, 4, 8, 60, 60


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, made in bounded time: a list of a million
    values or a string of megabytes is not printed whole first."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
