"""The one plan cache (fa_variants/plans.py): owners' keys never meet, the bound holds, clear_plans empties it
for attention() and every launcher (CPU: plans are opaque objects here)."""
from __future__ import annotations

import fa_variants as fav
from fa_variants import forward, plans
from fa_variants.kernels import common, fa2_fp8, fa3_fp8


def test_launcher_caches_and_attention_share_one_cache_that_clear_plans_empties():
    made = []

    def make(tag):
        made.append(tag)
        return object()

    owners = (common._FWD_PLANS, fa2_fp8._PLANS, fa2_fp8._QUANT_PLANS, fa3_fp8._PLANS)
    kept = [common.cached_plan(o, ("same", "key"), lambda o=o: make(o)) for o in owners]
    assert len(made) == len(owners), "one key under different owners must give different plans"
    assert [common.cached_plan(o, ("same", "key"), lambda: make("again")) for o in owners] == kept
    plans.put((forward.OWNER, "signature"), kept[0])
    assert plans.of(forward.OWNER) == [kept[0]] and plans.of(fa3_fp8._PLANS) == [kept[3]]
    fav.clear_plans()
    assert not plans.PLANS and not plans.of(forward.OWNER)
    common.cached_plan(fa3_fp8._PLANS, ("same", "key"), lambda: make("after clear"))
    assert made[-1] == "after clear"


def test_the_cache_starts_over_at_its_bound(monkeypatch):
    monkeypatch.setattr(plans, "MAX_PLANS", 3)
    fav.clear_plans()
    owner = plans.Owner("test")
    for i in range(3):
        plans.put((owner, i), i + 1)
    assert len(plans.PLANS) == 3
    plans.put((owner, 3), 4)
    assert plans.PLANS == {(owner, 3): 4}
    fav.clear_plans()
