"""Process entry points for the store tests (spawned, so each elector or claimer is a real process)."""

from __future__ import annotations

import random
import time

from include.config import StoreConfig
from include.store import Store
from include.store.lease import LeaderElector


def compete(
    config: StoreConfig, name: str, seconds: float, seed: int, ttl: float, fence: float, start, results
) -> None:
    """Step an elector for `seconds` after all competitors are ready; as leader, sometimes release
    and sometimes 'crash' (go silent). Puts [(node_id, outcome, epoch)] for every step on `results`.
    """
    rnd = random.Random(seed)
    store = Store(config)
    start.wait()
    deadline = time.monotonic() + seconds
    generation = 0
    elector = LeaderElector(store, node_id=f"{name}:{generation}", ttl_seconds=ttl, fence_timeout_seconds=fence)
    log = []
    while time.monotonic() < deadline:
        result = elector.step()
        log.append((elector.node_id, result.outcome.value, result.epoch))
        if result.is_leader:
            dice = rnd.random()
            if dice < 0.35:
                elector.release()
            elif dice < 0.40:  # crash: a new incarnation with a new node id; the old lease must age out
                generation += 1
                elector = LeaderElector(
                    store, node_id=f"{name}:{generation}", ttl_seconds=ttl, fence_timeout_seconds=fence
                )
        time.sleep(rnd.uniform(0.0, 0.004))
    store.close()
    results.put(log)


def claim_until_empty(config: StoreConfig, owner: str, epoch: int, batch: int, start, results) -> None:
    """Claim and finish batches until nothing is left; puts the ids this claimer finished."""
    from include.store import INBOUND
    from include.store import rowlease as rl

    store = Store(config)
    mine: list[int] = []
    start.wait()
    try:
        while True:
            with store.transaction() as tx:
                ids = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner=owner, epoch=epoch, limit=batch)]
            if not ids:
                break
            with store.transaction() as tx:
                if rl.finish_batch(tx, INBOUND, ids, owner=owner, epoch=epoch) != ids:
                    raise AssertionError(f"{owner}: finish did not land all of its own claims")
            mine.extend(ids)
            time.sleep(0)
        results.put((owner, mine, None))
    except Exception as exc:
        results.put((owner, mine, repr(exc)))
    finally:
        store.close()
