"""The radix tree as plain data (msgpack-safe), for the scheduler's idle stats (`radix_tree`)
and `radixflow tree`. Nodes are listed breadth first, biggest subtree first, each with its
parent, token count, lock count (ref), last access (the tree's logical clock: larger is more
recent) and the decoded start of its run (and `lora`, the adapter id, for a LoRA adapter's
KV: its keys' namespace). Torch-free."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixflow.runtime.cache.radix_cache import NAMESPACE_SHIFT, TOKEN_MASK, Node, RadixCache

MAX_NODES = 200
LABEL_TOKENS = 12


def dump_tree(
    tree: RadixCache, decode: Callable[[list[int]], str], max_nodes: int = MAX_NODES
) -> dict[str, Any]:
    """The tree as plain data (msgpack-safe): at most `max_nodes` nodes, biggest first."""
    nodes: list[dict[str, Any]] = []
    queue: list[tuple[Node, int]] = [(tree.root, -1)]
    total = 0
    while queue:
        node, parent = queue.pop(0)
        total += 1
        if len(nodes) >= max_nodes:
            continue
        index = len(nodes)
        head = (node.key[:LABEL_TOKENS] & TOKEN_MASK).tolist()  # the ids, less any namespace
        nodes.append(
            {
                "id": index,
                "parent": parent,
                "tokens": len(node.key),
                "ref": node.lock_ref if node is not tree.root else 0,
                "last_access": node.last_access,
                "leaf": not node.children,
                "text": decode(head) if head else "",
            }
        )
        if len(node.key) and node.key[0] >> NAMESPACE_SHIFT:  # a LoRA adapter's KV
            nodes[-1]["lora"] = int(node.key[0] >> NAMESPACE_SHIFT)
        children = sorted(node.children.values(), key=lambda n: -subtree_tokens(n))
        queue += [(child, index) for child in children]
    return {
        "nodes": nodes,
        "total_nodes": total - 1,
        "tokens": tree.total_size,
        "evictable_tokens": tree.evictable_size,
        "truncated": total > max_nodes,
    }


def subtree_tokens(node: Node) -> int:
    stack, count = [node], 0
    while stack:
        n = stack.pop()
        count += len(n.key)
        stack.extend(n.children.values())
    return count
