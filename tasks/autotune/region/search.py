"""Region discovery: a hierarchical partition of any ONNX graph, from its structure alone.

The autotuner profiles one region at a time and shares the best scheme among structurally equal
regions, so the partition must cut repeated blocks (every ResNet block, every transformer layer)
the same way. Node names are never used; only the data-flow graph and op types are.

Algorithm
---------
1. **Structural DAG.** Nodes whose outputs are all constant-foldable (``GraphIndex.constants``:
   Constant nodes, shape arithmetic on initializers) carry no activations; they are left out of the
   analysis and later *hosted* by the region of their first consumer. Edges of the DAG are the
   remaining (activation, or runtime shape) tensors. A graph input read by several nodes acts as a
   virtual divergence node.
2. **Convergence.** Immediate post-dominators are computed on the DAG with a virtual exit (graph
   outputs and dead ends lead to it). For every *divergent* node ``d`` (its outputs reach two or
   more consumers) the convergence node is ``c = ipdom(d)``: the first node every path from ``d``
   passes through. The candidate region is every node reachable from ``d`` before ``c``, plus ``c``,
   plus the *tail* of ``c``. ``d`` itself is not included: it belongs to whatever precedes it (the
   tail of the previous block), so the first block after a stem looks like all the others.
3. **Tails.** A residual block is finished by what follows its join (Add -> Relu in a ResNet,
   Add -> LayerNormalization in a post-LN transformer). The tail is the single-producer,
   single-consumer chain after ``c`` up to and including the next divergent node, never through a
   weighted op (Conv, Gemm, MatMul: that starts the next block) and at most
   ``maximum_sequence_region_size`` nodes. Where the chain does not end in a divergence (the last
   block, feeding the head), the tail is the longest prefix of the chain that equals a complete
   tail of another join of the same op type; so the last block keeps its Relu/LayerNorm and matches
   its siblings.
4. **Hierarchy.** Candidates are kept greedily from the smallest up when they nest in or are
   disjoint from every region kept so far (a laminar family); one that straddles a kept region (an
   attention mask or a shape tensor read by every layer) is dropped. A kept region with at most
   ``minimum_topdown_search_size`` structural nodes becomes a LEAF; a larger one is refined top-down
   into a COMPOSITE whose children are its nested regions plus sequences of its remaining nodes.
5. **Sequences.** Nodes outside every region of a scope (the stem, the head, a flat graph) are split
   into linear chains (each link: the only consumer of the previous node, whose only producer in
   the scope is that node) and each chain into LEAF sequences of at most
   ``maximum_sequence_region_size`` structural nodes, front first, so periodic chains repeat.

Conventions: sizes count structural nodes (hosted constants ride along uncounted); LEAF regions
partition all nodes of the graph; COMPOSITE and ROOT regions own no nodes directly. Region ids are
assigned in pre-order (ROOT = 0); children are in topological order (ties: first node in graph
order). ``Region.inputs`` lists non-constant tensors read inside and produced outside, in order of
first use; ``Region.outputs`` lists non-constant tensors produced inside and read outside or
returned by the graph, in order of production (node order, then output slot).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import onnx

from pipeline.errors import InputError
from pipeline.graph.index import GraphIndex
from pipeline.graph.model import WEIGHTED_OPS, topological_order
from tasks.autotune.region.region import Region, RegionType

_EXIT = -1  # virtual exit node of the post-dominator analysis


class CombinedRegionSearch:
    """Convergence regions refined top-down, with bounded sequences for everything else."""

    def __init__(self, model: onnx.ModelProto, maximum_sequence_region_size: int = 10,
                 minimum_topdown_search_size: int = 10):
        if maximum_sequence_region_size < 1 or minimum_topdown_search_size < 1:
            raise ValueError(f"maximum_sequence_region_size={maximum_sequence_region_size} and "
                             f"minimum_topdown_search_size={minimum_topdown_search_size} must be >= 1")
        self.model = model
        self.max_seq = maximum_sequence_region_size
        self.min_topdown = minimum_topdown_search_size
        self.index = GraphIndex(model)
        self._nodes = list(model.graph.node)
        self._analyse()

    # ------------------------------------------------------------------ graph analysis
    def _analyse(self) -> None:
        g, nodes = self.index, self._nodes
        n = len(nodes)
        # GraphIndex hands out NodeProto objects; regions need graph indices. The index keeps those
        # objects alive, so their identities are stable for the lifetime of this search.
        ident = {id(node): i for i, node in enumerate(nodes)}

        def idx(node: onnx.NodeProto) -> int:
            return ident[id(node)]

        self.order = self._topological_order(idx)
        self.pos = [0] * n
        for p, i in enumerate(self.order):
            self.pos[i] = p
        self.producer_of: dict[str, int] = {t: idx(p) for t, p in g.producer.items()}
        self.readers: dict[str, list[int]] = {t: [idx(c) for c, _ in cs] for t, cs in g.consumers.items()}

        def live(t: str) -> bool:
            return bool(t) and t not in g.constants

        const = [bool(node.output) and not any(live(o) for o in node.output) for node in nodes]
        # constant nodes go to the region of their first non-constant consumer; those without one
        # (feeding only graph outputs, or dead) stay structural so they still land in some region
        self.host: dict[int, int] = {}
        self.structural = [not c for c in const]
        for i in reversed(self.order):
            if not const[i]:
                continue
            cands = [j if self.structural[j] else self.host[j]
                     for o in nodes[i].output if o for j in self.readers.get(o, ())]
            if cands:
                self.host[i] = min(cands, key=self.pos.__getitem__)
            else:
                self.structural[i] = True
        self.hosted: dict[int, list[int]] = defaultdict(list)
        for i, h in self.host.items():
            self.hosted[h].append(i)

        self.succ: list[list[int]] = [[] for _ in range(n)]
        self.pred: list[list[int]] = [[] for _ in range(n)]
        self.to_exit = [False] * n
        for i, node in enumerate(nodes):
            if not self.structural[i]:
                continue
            outs = {j for o in node.output if live(o) for j in self.readers.get(o, ())}
            self.succ[i] = sorted(outs, key=self.pos.__getitem__)
            self.pred[i] = sorted({self.producer_of[t] for t in node.input if live(t) and t in self.producer_of},
                                  key=self.pos.__getitem__)
            self.to_exit[i] = any(o in g.graph_outputs for o in node.output) or not outs
        self.targets = [[*self.succ[i], *([_EXIT] if self.to_exit[i] else [])] for i in range(n)]
        self._postdominators()

    def _topological_order(self, idx: Callable[[onnx.NodeProto], int]) -> list[int]:
        """Graph order when it is topological (exporters emit it so); else Kahn's algorithm with the
        smallest graph index first, which keeps repeated blocks in the same relative order."""
        nodes, g = self._nodes, self.index
        deps = [{idx(g.producer[t]) for t in node.input if t in g.producer} - {i} for i, node in enumerate(nodes)]
        if all(all(d < i for d in ds) for i, ds in enumerate(deps)):
            return list(range(len(nodes)))
        order = topological_order(range(len(nodes)), deps.__getitem__)
        if len(order) != len(nodes):
            done = set(order)
            stuck = [nodes[i].name or nodes[i].op_type for i in range(len(nodes)) if i not in done][:5]
            raise InputError(f"model graph has a cycle (nodes {stuck} depend on each other); "
                             f"region search needs an acyclic graph")
        return order

    def _postdominators(self) -> None:
        self.ipdom: dict[int, int] = {}
        depth = {_EXIT: 0}
        for i in reversed(self.order):
            if not self.structural[i]:
                continue
            p = self._meet(self.targets[i], depth)
            self.ipdom[i] = p
            depth[i] = depth[p] + 1
        self._depth = depth

    def _meet(self, targets: list[int], depth: dict[int, int]) -> int:
        """Nearest common post-dominator of ``targets`` (walk the post-dominator tree upwards)."""
        it = iter(targets)
        a = next(it)
        for b in it:
            while a != b:
                if depth[a] >= depth[b]:
                    a = self.ipdom[a]
                else:
                    b = self.ipdom[b]
        return a

    # ------------------------------------------------------------------ candidates
    def _candidates(self) -> list[frozenset[int]]:
        g = self.index
        starts: list[list[int]] = []  # where each divergence's paths go (consumers, maybe the exit)
        for i in self.order:
            if self.structural[i] and len(self.targets[i]) >= 2:
                starts.append(self.targets[i])
        for t in sorted(g.graph_inputs):
            readers = sorted({j for j in self.readers.get(t, ()) if self.structural[j]}, key=self.pos.__getitem__)
            targets = readers + ([_EXIT] if t in g.graph_outputs else [])
            if len(targets) >= 2:
                starts.append(targets)
        joins: list[tuple[list[int], int]] = []
        for targets in starts:
            c = self._meet(targets, self._depth)
            if c != _EXIT:  # branches that never meet again (separate graph outputs) make no region
                joins.append((targets, c))
        tails = self._tails({c for _, c in joins})
        seen: set[frozenset[int]] = set()
        out: list[frozenset[int]] = []
        for targets, c in joins:
            body: set[int] = set()
            stack = [s for s in targets if s != c]
            while stack:
                u = stack.pop()
                if u in body:
                    continue
                body.add(u)
                stack.extend(v for v in self.succ[u] if v != c and v not in body)
            region = frozenset(body | {c} | set(tails[c]))
            if region not in seen:
                seen.add(region)
                out.append(region)
        return out

    def _tails(self, joins: Iterable[int]) -> dict[int, list[int]]:
        nodes = self._nodes
        raw: dict[int, tuple[list[int], bool]] = {}
        for c in joins:
            chain: list[int] = []
            done = len(self.targets[c]) >= 2
            cur = c
            while not done and len(chain) < self.max_seq:
                if self.to_exit[cur] or len(self.succ[cur]) != 1:
                    break
                v = self.succ[cur][0]
                if self.pred[v] != [cur] or nodes[v].op_type in WEIGHTED_OPS:
                    break
                chain.append(v)
                done = len(self.targets[v]) >= 2
                cur = v
            raw[c] = (chain, done)
        complete: dict[str, set[tuple[str, ...]]] = defaultdict(set)
        for c, (chain, done) in raw.items():
            if done:
                complete[nodes[c].op_type].add(tuple(nodes[v].op_type for v in chain))
        tails: dict[int, list[int]] = {}
        for c, (chain, done) in raw.items():
            if done:
                tails[c] = chain
                continue
            ops = tuple(nodes[v].op_type for v in chain)
            fits = [len(t) for t in complete[nodes[c].op_type] if ops[:len(t)] == t]
            tails[c] = chain[:max(fits)] if fits else []
        return tails

    def _laminar(self, candidates: list[frozenset[int]]) -> dict[frozenset[int], list[frozenset[int]]]:
        """Keep candidates that nest or are disjoint, smallest first; map each kept region (and the
        whole graph, key ``frozenset()``) to its maximal kept sub-regions."""
        order = sorted(candidates, key=lambda s: (len(s), min(self.pos[i] for i in s)))
        owner: dict[int, frozenset[int]] = {}  # node -> largest kept region holding it
        children: dict[frozenset[int], list[frozenset[int]]] = {}
        for cand in order:
            inner = {owner[i] for i in cand if i in owner}
            if any(not r <= cand for r in inner):
                continue
            children[cand] = sorted(inner, key=lambda s: min(self.pos[i] for i in s))
            for i in cand:
                owner[i] = cand
        top = {owner[i] for i in owner}
        children[frozenset()] = sorted(top, key=lambda s: min(self.pos[i] for i in s))
        return children

    # ------------------------------------------------------------------ regions
    def search(self) -> Region:
        """The ROOT region; its children are what the autotuner profiles, one after another."""
        tree = self._laminar(self._candidates())
        everything = frozenset(i for i in range(len(self._nodes)) if self.structural[i])
        root = Region(id=0, type=RegionType.ROOT, level=0)
        root.children = self._refine(everything, tree[frozenset()], tree, 1)
        for c in root.children:
            c.parent = root
        next_id = 0
        for r in [root, *root.descendants()]:
            r.id = next_id
            next_id += 1
        self._boundaries(root)
        return root

    def _refine(self, scope: frozenset[int], kept: list[frozenset[int]],
                tree: dict[frozenset[int], list[frozenset[int]]], level: int) -> list[Region]:
        """Children of a region covering ``scope``: its kept sub-regions and sequences of the rest."""
        regions: list[Region] = []
        rest = set(scope)
        for sub in kept:
            rest -= sub
            if len(sub) <= self.min_topdown:
                regions.append(self._leaf(sub, level))
            else:
                r = Region(id=0, type=RegionType.COMPOSITE, level=level)
                r.children = self._refine(sub, tree[sub], tree, level + 1)
                for c in r.children:
                    c.parent = r
                regions.append(r)
        for chain in self._chains(rest):
            for k in range(0, len(chain), self.max_seq):
                regions.append(self._leaf(chain[k:k + self.max_seq], level))
        return self._sorted(regions)

    def _leaf(self, members: Iterable[int], level: int) -> Region:
        nodes = set(members)
        for i in list(nodes):
            nodes.update(self.hosted.get(i, ()))
        return Region(id=0, type=RegionType.LEAF, level=level, nodes=sorted(nodes, key=self.pos.__getitem__))

    def _chains(self, scope: set[int]) -> list[list[int]]:
        nxt: dict[int, int] = {}
        for u in scope:
            if len(self.targets[u]) != 1 or self.targets[u][0] == _EXIT:
                continue
            v = self.targets[u][0]
            if v in scope and [p for p in self.pred[v] if p in scope] == [u]:
                nxt[u] = v
        linked = set(nxt.values())
        chains = []
        for u in sorted(scope, key=self.pos.__getitem__):
            if u in linked:
                continue
            chain = [u]
            while chain[-1] in nxt:
                chain.append(nxt[chain[-1]])
            chains.append(chain)
        return chains

    def _sorted(self, regions: list[Region]) -> list[Region]:
        """Regions in topological order of the data flow between them; ties by first node."""
        where = {i: k for k, r in enumerate(regions) for i in r.all_nodes()}
        first = [min(self.pos[i] for i in r.all_nodes()) for r in regions]
        feeders: list[set[int]] = [set() for _ in regions]  # regions whose outputs region k reads
        for k, r in enumerate(regions):
            for i in r.all_nodes():
                for j in self.succ[i]:
                    if j in where:
                        feeders[where[j]].add(k)
        out = [regions[k] for k in topological_order(range(len(regions)), feeders.__getitem__, first.__getitem__)]
        if len(out) != len(regions):  # cannot happen for convex regions; keep every region anyway
            out += [r for r in regions if r not in out]
        return out

    def _boundaries(self, region: Region) -> set[int]:
        """Fill inputs/outputs of ``region`` and its descendants; return its node set."""
        members: set[int] = set(region.nodes)
        for c in region.children:
            members |= self._boundaries(c)
        g, nodes = self.index, self._nodes
        ins: dict[str, None] = {}
        outs: dict[str, None] = {}
        for i in sorted(members, key=self.pos.__getitem__):
            for t in nodes[i].input:
                if t and t not in g.constants and self.producer_of.get(t) not in members:
                    ins.setdefault(t)
            for t in nodes[i].output:
                if t and t not in g.constants and (
                        t in g.graph_outputs or any(j not in members for j in self.readers.get(t, ()))):
                    outs.setdefault(t)
        region.inputs, region.outputs = list(ins), list(outs)
        return members


def discover_regions(model: onnx.ModelProto, maximum_sequence_region_size: int = 10,
                     minimum_topdown_search_size: int = 10) -> list[Region]:
    """The regions the autotuner profiles: the ROOT's children, in topological order."""
    return CombinedRegionSearch(model, maximum_sequence_region_size, minimum_topdown_search_size).search().children
