"""`phasewise cache list|prune`: the packed-weight cache's packs shown and cleared (loading/pack_store.py)."""

from __future__ import annotations

import argparse
import time
from typing import TypeVar

from phasewise.loading import packed_cache
from phasewise.loading.pack_store import ENV, Pack, parse_size

ParserT = TypeVar("ParserT", bound=argparse.ArgumentParser)


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub: argparse._SubParsersAction[ParserT]) -> None:
    cache = sub.add_parser("cache", help="show or clear the packed-weight cache (<cache>/packed; its limit: "
                                         f"${ENV}, default 16G)")
    verbs = cache.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="every pack: its model file, size, last use, "
                                            "whether a source is present")
    listing.set_defaults(func=cmd_list)
    prune = verbs.add_parser("prune", help="remove packs whose model files are all gone, "
                                           "then the least recently used ones past the limit")
    which = prune.add_mutually_exclusive_group()
    which.add_argument("--max-size", type=_size_arg, default=None, metavar="SIZE",
                       help=f"keep at most SIZE (e.g. 4G; default: ${ENV} or 16G)")
    which.add_argument("--all", action="store_true", help="remove every pack")
    prune.set_defaults(func=cmd_prune)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= span:
            return f"{s / span:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def cmd_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    store = packed_cache.store()
    packs = store.packs() if store.folder.is_dir() else []
    table = Table(title=f"packed-weight cache {store.folder}: {_gib(sum(p.size for p in packs))} "
                        f"of {_gib(store.limit)}")
    for column in ("pack", "model file", "size", "last used", "source present"):
        table.add_column(column, justify="right" if column in ("size", "last used") else "left")
    for p in packs:
        table.add_row(p.path.name, p.model, _gib(p.size), _ago(p.last_used), "yes" if p.present else "no")
    Console().print(table)
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    store = packed_cache.store()
    removed: list[Pack] = store.prune(args.max_size, everything=args.all) if store.folder.is_dir() else []
    for p in removed:
        print(f"removed {p.path.name} ({_gib(p.size)}, {p.model})")
    left = store.packs() if store.folder.is_dir() else []
    print(f"{len(removed)} packs removed ({_gib(sum(p.size for p in removed))}); {len(left)} left "
          f"({_gib(sum(p.size for p in left))})")
    return 0
