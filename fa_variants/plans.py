"""The one launch-plan cache: call signature -> plan, for every layer that replays launches.

``attention()`` keeps the plan of each call signature it validated (its warm path: a key, a dict lookup, an
allocation and one cuLaunchKernel); the launchers keep the plans of what ``attention()`` does not (padded or
copied inputs, fp8 quantization, the attention on pre-quantized operands). All of them live in ``PLANS`` under
keys whose first element is their owner (an ``Owner``, or for ``attention()`` its own signature tuple's tag),
so one bound, one lock and one ``clear`` serve them all. Nothing here imports an array library.
"""
from __future__ import annotations

import threading

MAX_PLANS = 4096        # entries kept before the cache starts over (a plan is a few hundred bytes)
PLANS: dict = {}        # key -> plan; read without the lock (a dict lookup is atomic), written under it
_lock = threading.Lock()


class Owner:
    """The first element of the keys of one user of the cache (a launcher, ``attention()``): keys of different
    owners never compare equal, whatever the rest of them holds."""
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"plans.Owner({self.name!r})"


def put(key, plan):
    """Keep ``plan`` under ``key`` (the cache starts over once it holds MAX_PLANS entries); returns ``plan``."""
    with _lock:
        if len(PLANS) >= MAX_PLANS:
            PLANS.clear()
        PLANS[key] = plan
    return plan


def cached(key, make):
    """``PLANS[key]``, made by ``make()`` and kept on a miss."""
    plan = PLANS.get(key)
    return put(key, make()) if plan is None else plan


def of(owner) -> list:
    """The plans kept under ``owner`` (what tests and diagnostics look at)."""
    return [plan for key, plan in list(PLANS.items()) if key[0] is owner]


def clear() -> None:
    """Forget every plan (``fa_variants.clear_plans``)."""
    with _lock:
        PLANS.clear()
