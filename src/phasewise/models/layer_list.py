"""LayerList: an nn.ModuleList of one kind of layer, typed by what it holds.

torch's ModuleList is not generic (its items read as `Module`, their attributes as `Tensor | Module`);
for the type checker LayerList[L] is a ModuleList whose items are L. At run time it is nn.ModuleList
itself: nothing changes in the model (its modules, names, repr).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar, overload

from torch import nn

L = TypeVar("L", bound=nn.Module, covariant=True)

if TYPE_CHECKING:
    class LayerList(nn.ModuleList, Generic[L]):
        def __init__(self, modules: Iterable[L]) -> None: ...

        def __iter__(self) -> Iterator[L]: ...

        @overload
        def __getitem__(self, idx: slice) -> LayerList[L]: ...

        @overload
        def __getitem__(self, idx: int) -> L: ...

        def __getitem__(self, idx: int | slice) -> L | LayerList[L]: ...
else:
    LayerList = nn.ModuleList
