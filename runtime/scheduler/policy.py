"""Waiting-queue order (lpm with aging, dfs-weight, fcfs) and in-step prefix dedup.

Torch-free. The cache-aware policies match every waiting request against the radix tree; with
more than LPM_FALLBACK_QUEUE_LEN waiting requests that costs too much and fcfs is used.
"""

from __future__ import annotations

import numpy as np

from radixflow.runtime.cache.radix_cache import Node, RadixCache, common_prefix_len
from radixflow.runtime.scheduler.request import Req

LPM_FALLBACK_QUEUE_LEN = 128
AGING_TOKENS_PER_STEP = 16  # lpm: each step waited counts as this many cached tokens
DEDUP_MIN_SHARED = 32  # in-step dedup: defer a request sharing this many uncached tokens


def _match(tree: RadixCache, req: Req) -> tuple[int, Node]:
    prefix, node = tree.match_prefix(req.cache_key(req.max_prefix_len))
    return len(prefix), node


def order_waiting(
    waiting: list[Req], tree: RadixCache, policy: str, step: int, by_priority: bool = False
) -> list[Req]:
    """Admission order. lpm: longest cached prefix first, each waited step worth
    AGING_TOKENS_PER_STEP cached tokens so a cold request cannot starve; ties by arrival.
    `by_priority`: larger `priority` first, the policy's order within one priority."""
    ordered = policy_order(waiting, tree, policy, step)
    if by_priority:
        ordered.sort(key=lambda r: -r.priority)  # stable: the policy's order within a level
    return ordered


def policy_order(waiting: list[Req], tree: RadixCache, policy: str, step: int) -> list[Req]:
    if policy == "fcfs" or len(waiting) > LPM_FALLBACK_QUEUE_LEN or tree.disabled:
        return sorted(waiting, key=lambda r: r.arrival)
    if policy == "lpm":

        def priority(req: Req) -> tuple[float, float]:
            waited = step - req.arrival_step
            return (-(_match(tree, req)[0] + AGING_TOKENS_PER_STEP * waited), req.arrival)

        return sorted(waiting, key=priority)
    return dfs_weight_order(waiting, tree)


def dfs_weight_order(waiting: list[Req], tree: RadixCache) -> list[Req]:
    """Requests grouped by subtree, heaviest subtrees (most waiting requests) first, deepest
    requests before their ancestors' (post-order), so a hot branch runs together."""
    by_node: dict[int, list[Req]] = {}
    for req in sorted(waiting, key=lambda r: r.arrival):
        by_node.setdefault(id(_match(tree, req)[1]), []).append(req)
    weight: dict[int, int] = {}

    def compute(node: Node) -> int:
        w = len(by_node.get(id(node), [])) + sum(compute(c) for c in node.children.values())
        weight[id(node)] = w
        return w

    compute(tree.root)
    order: list[Req] = []

    def visit(node: Node) -> None:
        for child in sorted(node.children.values(), key=lambda c: -weight[id(c)]):
            if weight[id(child)]:
                visit(child)
        order.extend(by_node.get(id(node), []))

    visit(tree.root)
    return order


def shares_uncached(ids: np.ndarray, cached: int, in_step: list[np.ndarray]) -> bool:
    """Whether a request admitted this step already computes this request's uncached prefix
    (DEDUP_MIN_SHARED tokens, or all but the last token of a short remainder)."""
    need = min(DEDUP_MIN_SHARED, len(ids) - cached - 1)
    return need > 0 and any(common_prefix_len(ids, other) - cached >= need for other in in_step)
