"""One small registry for every pluggable kind (attacks, defences, models, datasets).

>>> MODELS = Registry("model")
>>> @MODELS.register("my_net")
... class MyNet(nn.Module): ...
>>> MODELS.create("my_net", num_classes=10)     # unknown names: an error with "did you mean"
"""
from __future__ import annotations

import difflib
import inspect
from typing import Callable, Generic, Iterator, TypeVar

from pbe.utils import PBEError

T = TypeVar("T")


def unknown_name(kind: str, name: object, names: list[str]) -> PBEError:
    """The one error for a name that is not there: close matches first, then every valid name."""
    near = difflib.get_close_matches(str(name), names, n=3)
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    return PBEError(f"unknown {kind} {name!r}{hint}; available: {', '.join(names)}")


class Registry(Generic[T]):
    """Names -> factories (classes or functions), listed sorted; a user registers their own the same way."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, obj: T | None = None, *, replace: bool = False):
        """Register `obj` under `name` (or use as a decorator: ``@registry.register("name")``).
        A name already taken is an error unless `replace`."""
        def add(item: T) -> T:
            if not isinstance(name, str) or not name:
                raise PBEError(f"a {self.kind} name must be a non-empty string, got {name!r}")
            if name in self._items and not replace and self._items[name] is not item:
                raise PBEError(f"{self.kind} {name!r} is already registered; pass replace=True to override it")
            self._items[name] = item
            return item
        return add if obj is None else add(obj)

    def get(self, name: str) -> T:
        if name not in self._items:
            raise unknown_name(self.kind, name, self.available())
        return self._items[name]

    def create(self, name: str, *args, **kwargs):
        """Call the factory registered as `name`; wrong arguments are one clear error."""
        factory: Callable = self.get(name)  # type: ignore[assignment]
        try:
            params = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            params = {}
        if params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            known = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            unknown = sorted(set(kwargs) - set(known))
            if unknown:
                hint = difflib.get_close_matches(unknown[0], known, n=1)
                raise PBEError(f"{self.kind} {name!r}: unknown parameter(s) {unknown}"
                               + (f" (did you mean {hint[0]!r}?)" if hint else "") + f"; known: {', '.join(known)}")
        try:
            return factory(*args, **kwargs)
        except TypeError as err:
            raise PBEError(f"bad parameters for {self.kind} {name!r}: {err}") from err

    def available(self) -> list[str]:
        return sorted(self._items)

    # dict-like reading
    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.available())

    def __len__(self) -> int:
        return len(self._items)

    def items(self):
        return [(n, self._items[n]) for n in self.available()]
