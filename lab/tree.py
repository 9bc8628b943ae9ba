"""A picture of the radix tree: which prefixes requests share, and what eviction would drop.

The scheduler's idle stats carry the tree as plain data (`radix_tree`, made by
`radixflow.runtime.cache.tree_dump`). `render_text` prints it as an indented tree; `render_png`
draws it (matplotlib, imported only there). Unlocked
leaves are what `evict` takes, least recently used first: both renderings mark them.

    radixflow tree --url tcp://127.0.0.1:30001 --png tree.png
"""

from __future__ import annotations

import json
from typing import Any

from radixflow.lab.diagnose import read_stats
from radixflow.runtime.cache.tree_dump import LABEL_TOKENS


def eviction_order(dump: dict[str, Any]) -> list[int]:
    """Ids of the unlocked leaves in the order `evict` would take them (LRU first)."""
    leaves = [n for n in dump["nodes"] if n["leaf"] and n["parent"] >= 0 and n["ref"] == 0]
    return [n["id"] for n in sorted(leaves, key=lambda n: n["last_access"])]


def _children(dump: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    kids: dict[int, list[dict[str, Any]]] = {}
    for n in dump["nodes"]:
        kids.setdefault(n["parent"], []).append(n)
    return kids


def _label(n: dict[str, Any], limit: int = 28) -> str:
    text = n["text"]
    return repr(text[:limit] + ("…" if len(text) > limit or n["tokens"] > LABEL_TOKENS else ""))


def render_text(dump: dict[str, Any]) -> str:
    """An indented tree: run start, tokens, ref count, last access; `evict#k` marks the k-th
    leaf eviction would take."""
    kids, order = _children(dump), eviction_order(dump)
    rank = {node_id: k + 1 for k, node_id in enumerate(order)}
    lines = [
        f"radix tree: {dump['tokens']} tokens in {dump['total_nodes']} nodes "
        f"({dump['evictable_tokens']} evictable)" + (" [truncated]" if dump["truncated"] else "")
    ]

    def walk(node_id: int, indent: str) -> None:
        children = kids.get(node_id, [])
        for i, n in enumerate(children):
            last = i == len(children) - 1
            mark = f"  evict#{rank[n['id']]}" if n["id"] in rank else ""
            lines.append(
                f"{indent}{'└─' if last else '├─'} {_label(n)}  {n['tokens']} tok, "
                f"ref {n['ref']}, last access {n['last_access']}{mark}"
            )
            walk(n["id"], indent + ("   " if last else "│  "))

    walk(0, "")
    return "\n".join(lines)


def collapse(dump: dict[str, Any]) -> dict[str, Any]:
    """The dump with every chain of single-child nodes drawn as one run (for the picture):
    tokens summed, the text from its start, the ref of its first (largest) node, the id of
    its last (eviction takes leaves)."""
    kids = _children(dump)
    nodes: list[dict[str, Any]] = [dict(dump["nodes"][0])]

    def walk(node: dict[str, Any], parent: int) -> None:
        first, tokens, text = node, node["tokens"], node["text"]
        while len(kids.get(node["id"], [])) == 1 and len(text) < 40:
            node = kids[node["id"]][0]
            tokens, text = tokens + node["tokens"], text + node["text"]
        while len(kids.get(node["id"], [])) == 1:
            node = kids[node["id"]][0]
            tokens += node["tokens"]
        run = {"parent": parent, "tokens": tokens, "text": text, "ref": first["ref"]}
        nodes.append({**node, **run})
        for child in kids.get(node["id"], []):
            walk(child, node["id"])

    for child in kids.get(0, []):
        walk(child, 0)
    return {**dump, "nodes": nodes}


def layout(dump: dict[str, Any]) -> dict[int, tuple[float, float]]:
    """(x, y) per node: x = depth (edges from the root), leaves on consecutive rows, a
    parent at the middle of its children."""
    kids = _children(dump)
    pos: dict[int, tuple[float, float]] = {}
    row = [0]

    def place(node: dict[str, Any], depth: float) -> float:
        x = depth + (1.0 if node["parent"] >= 0 else 0.0)
        children = kids.get(node["id"], [])
        if not children:
            y = float(row[0])
            row[0] += 1
        else:
            y = sum(place(c, x) for c in children) / len(children)
        pos[node["id"]] = (x, y)
        return y

    place(dump["nodes"][0], 0.0)
    return pos


def render_png(dump: dict[str, Any], path: str, title: str = "") -> None:
    """Draw the tree to `path`: edges as long as their runs (tokens), width by sharing,
    locked runs blue, evictable grey, the next leaves to evict red (numbered)."""
    import matplotlib  # noqa: PLC0415 (optional, heavy)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional, heavy)

    order = eviction_order(dump)  # ranks of the real leaves; chains end on them
    dump = collapse(dump)

    pos = layout(dump)
    rank = {node_id: k + 1 for k, node_id in enumerate(order)}
    leaves = sum(1 for n in dump["nodes"] if n["leaf"])
    depth = max((x for x, _ in pos.values()), default=1.0)
    fig, ax = plt.subplots(figsize=(max(8.0, 2.6 * depth + 3), max(3.0, 0.55 * leaves + 1.2)))
    for n in dump["nodes"][1:]:
        (x0, y0), (x1, y1) = pos[n["parent"]], pos[n["id"]]
        color = "tab:blue" if n["ref"] else ("tab:red" if rank.get(n["id"], 99) <= 3 else "0.55")
        width = 1.0 + min(4.0, n["tokens"] / 16)  # thicker: longer runs
        ax.plot([x0, x0, x1], [y0, y1, y1], color=color, lw=width, solid_capstyle="butt")
        ax.plot([x1], [y1], "o", color=color, ms=4)
        note = f"{_label(n, 20)}\n{n['tokens']} tok" + (f", ref {n['ref']}" if n["ref"] else "")
        if n["id"] in rank:
            note += f", evict #{rank[n['id']]}"
        ax.annotate(note, (x0, y1), xytext=(6, 3), textcoords="offset points", fontsize=7)
    ax.plot([0], [pos[0][1]], "ks", ms=6)
    ax.set_xlabel("depth in the tree (each edge a run of tokens; thicker = longer run)")
    ax.set_yticks([])
    ax.set_xlim(-0.1, depth + 0.9)
    ax.margins(y=0.12)
    ax.invert_yaxis()
    ax.set_title(
        title
        or f"radix tree: {dump['tokens']} tokens, {dump['total_nodes']} nodes "
        f"(blue locked, grey evictable, red next to evict)"
    )
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- `radixflow tree` -----------------------------------------------------------------------


def tree_parser(commands: Any) -> None:
    p = commands.add_parser("tree", help="print (and draw) a live server's radix tree")
    p.add_argument("--url", required=True, help="tcp://HOST:PORT or http://HOST:PORT")
    p.add_argument("--api-key", default="", help="the server's API key")
    p.add_argument("--png", metavar="PATH", help="also draw the tree to PATH (matplotlib)")
    p.add_argument("--json", metavar="PATH", help="also write the dump as JSON")


def tree_main(args: Any) -> int:
    """Print the tree from the server's stats (present once the scheduler is idle)."""

    dump = read_stats(args.url, args.api_key).get("radix_tree")
    if dump is None:
        print("radixflow tree: the server is busy (the tree comes with its idle stats); retry")
        return 1
    print(render_text(dump))
    if args.png:
        render_png(dump, args.png)
        print(f"wrote {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dump, f, indent=1)
    return 0
