"""Backward split into B (input gradient) and deferred W (weight gradient) for zero-bubble schedules (Qi et
al., ICLR 2024), as ``torch.distributed.pipelining`` does, on public autograd APIs: B records the gradient
into each *boundary* node (input-dependent, feeding a parameter-only subgraph); W runs
``autograd.backward(inputs=params)`` from those edges, so ``p.grad`` hooks fire as under ``backward()``.
Start at :func:`backward_input`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


class WeightGradWork:
    """The deferred W of one micro-batch; :meth:`run` accumulates into ``p.grad`` via autograd's accumulators."""

    def __init__(self, groups: list, params_by_node: dict, owners: Optional[list] = None):
        self._groups = groups  # [(boundary nodes, {node: grad_outputs}, parameter nodes)]
        self._params = params_by_node
        self._owners = owners or []  # what keeps custom-Function boundary nodes alive (see _owners)

    def run(self, only: Optional[Sequence[torch.nn.Parameter]] = None) -> None:
        """Accumulate the weight gradients of the groups holding ``only`` (None: all left); each group runs once."""
        if only is None:
            groups, self._groups = self._groups, []
        else:
            want = {id(p) for p in only}
            groups = [g for g in self._groups if any(id(self._params[pn]) in want for pn in g[2])]
            self._groups = [g for g in self._groups if not any(g is h for h in groups)]
        for nodes, grads, pnodes in groups:
            roots, root_grads = [], []
            for n in nodes:
                for k, g in enumerate(grads.get(n) or ()):
                    if g is not None:
                        roots.append(GradientEdge(n, k))
                        root_grads.append(g)
            if not roots:
                continue  # no gradient reached these weights (unused output): as backward()
            params = [self._params[pn] for pn in pnodes]
            handles = []
            if len(nodes) > 1:  # clamp: a boundary node below another gets only its recorded grad
                for n in nodes:
                    handles.append(n.register_prehook(lambda _go, g=grads.get(n): g))
            try:
                # retain: a later group may pass through this group's nodes on the input chain
                # (shared parameters); the graph is released when the caller drops it after W.
                # backward(inputs=) rather than grad(): the parameters' own AccumulateGrad nodes add
                # into .grad, so their post-accumulate hooks run as in backward() (the optimizer's
                # fp32 fold of bf16 gradients, the offload's "gradient final" count)
                torch.autograd.backward(roots, grad_tensors=root_grads, retain_graph=True, inputs=params)
            finally:
                for h in handles:
                    h.remove()
        if not self._groups:
            self._params, self._owners = {}, []


def _graph(root) -> dict:
    """{node: [child node or None, ...]} of the autograd graph below ``root``."""
    children: dict = {}
    stack = [root]
    while stack:
        n = stack.pop()
        if n in children:
            continue
        kids = [c for c, _ in n.next_functions]
        children[n] = kids
        stack.extend(c for c in kids if c is not None and c not in children)
    return children


def backward_input(output: torch.Tensor, grad_output: Optional[torch.Tensor], inp: torch.Tensor,
                   params: Sequence[torch.nn.Parameter],
                   cuts: Optional[Sequence[tuple]] = None) -> tuple[torch.Tensor, WeightGradWork]:
    """B: gradient of ``output`` (``[b, S, H]`` with ``grad_output``, or a scalar loss) w.r.t. ``inp`` only.

    ``cuts``: ``(y, leaf)`` pairs of a forward cut per layer, so each W walk is one layer long (uncut, 11
    layers: F + B + W 1.14-1.17x F + backward). Returns ``(d_input, work)``; ``.grad`` is untouched."""
    if cuts:
        groups: list = []
        by_node: dict = {}
        owners: list = []
        g = grad_output
        for y, leaf in reversed(list(cuts)):
            g, w = _backward_input(output, g, leaf, params)
            groups += w._groups
            by_node.update(w._params)
            owners += w._owners
            output = y
        dx, w = _backward_input(output, g, inp, params)
        return dx, WeightGradWork(groups + w._groups, {**by_node, **w._params}, owners + w._owners)
    return _backward_input(output, grad_output, inp, params)


def _backward_input(output: torch.Tensor, grad_output: Optional[torch.Tensor], inp: torch.Tensor,
                    params: Sequence[torch.nn.Parameter]) -> tuple[torch.Tensor, WeightGradWork]:
    """:func:`backward_input` of one uncut graph."""
    root = output.grad_fn
    if root is None:  # the output is the input itself (a stage without layers)
        g = grad_output if grad_output is not None else torch.ones_like(output)
        return g, WeightGradWork([], {})
    children = _graph(root)
    x_node = get_gradient_edge(inp).node
    params_by_node = {}
    for p in params:
        if p.requires_grad:
            params_by_node[get_gradient_edge(p).node] = p

    x_dep = _input_dependent(children, x_node)
    groups = _boundary_groups(children, x_dep, params_by_node)
    if root not in x_dep:  # the output does not depend on the input: nothing to split
        output.backward(grad_output)
        return torch.zeros_like(inp), WeightGradWork([], {})
    recorded: dict = {}
    handles = []
    for n in [n for nodes, _ in groups.values() for n in nodes]:  # the boundary nodes
        handles.append(n.register_prehook(lambda go, n=n: recorded.__setitem__(n, go)))
    try:
        (dx,) = torch.autograd.grad(output, [inp], grad_output, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    if dx is None:
        dx = torch.zeros_like(inp)
    boundary = [n for nodes, _ in groups.values() for n in nodes]
    work = WeightGradWork([(nodes, {n: recorded.get(n) for n in nodes}, list(ps)) for nodes, ps in groups.values()],
                          params_by_node, _owners(children, boundary, root, output))
    return dx, work


def _parents(children: dict) -> dict:
    """{node: [parent nodes]}: the inverse of :func:`_graph`'s children."""
    parents: dict = {}
    for n, kids in children.items():
        for c in kids:
            if c is not None:
                parents.setdefault(c, []).append(n)
    return parents


def _owners(children: dict, boundary: list, root, output: torch.Tensor) -> list:
    """What W must hold so the custom ``autograd.Function`` nodes among ``boundary`` are still alive when it
    runs: their nearest ancestors that are built-in nodes (whose Python handles own the nodes below them),
    or ``output`` where only custom nodes lead up to ``root``.

    A custom Function's node belongs to its output tensors and to the nodes that consume them; before torch
    2.13 its Python handle does not keep it alive, and W from a freed one fails (``element 0 of tensors does
    not require grad``, or ``Attribute '_input_metadata' is invalid``; pytorch/pytorch#166577). The last
    stage's fused head joins at such a node (:class:`npu_train.model.headops.JoinGrad`); its ancestors are the
    cross-entropy node, whose saved log-probabilities became the gradient B recorded (the same memory),
    and the loss's scalar nodes, so holding them costs no memory the plan does not already count."""
    custom = torch.autograd.function.BackwardCFunction
    stack = [n for n in boundary if isinstance(n, custom)]
    if not stack:
        return []
    parents, seen, held = _parents(children), set(), []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n is root:
            held.append(output)
        for p in parents.get(n, ()):
            if isinstance(p, custom):
                stack.append(p)
            elif not any(p is h for h in held):
                held.append(p)
    return held


def _input_dependent(children: dict, x_node) -> set:
    """The nodes from which the input's accumulator ``x_node`` is reachable."""
    parents = _parents(children)
    x_dep = set()
    stack = [x_node] if x_node in parents else []
    while stack:  # ancestors of the input's accumulator = input-dependent nodes
        n = stack.pop()
        if n in x_dep:
            continue
        x_dep.add(n)
        stack.extend(parents.get(n, ()))
    return x_dep


def _boundary_groups(children: dict, x_dep: set, params_by_node: dict) -> dict:
    """``{group id: (boundary nodes, parameter nodes)}``; nodes sharing a parameter share a group."""
    reach: dict = {}

    def params_below(n) -> frozenset:  # parameters reachable from a non-input-dependent node
        hit = reach.get(n)
        if hit is None:
            found, seen, st = set(), {n}, [n]
            while st:
                m = st.pop()
                if m in params_by_node:
                    found.add(m)
                for c in children.get(m, ()):
                    if c is not None and c not in seen:
                        seen.add(c)
                        st.append(c)
            hit = reach[n] = frozenset(found)
        return hit

    boundary: dict = {}  # node -> parameter nodes it feeds
    for n in x_dep:
        ps = set()
        for c in children.get(n, ()):
            if c is not None and c not in x_dep:
                ps |= params_below(c)
        if ps:
            boundary[n] = ps
    # group boundary nodes that share parameters (merging groups as shared parameters appear)
    owner: dict = {}   # parameter node -> group id
    groups: dict = {}  # group id -> (boundary nodes, parameter nodes)
    for gid, (n, ps) in enumerate(boundary.items()):
        nodes, pset = [n], set(ps)
        for old in {owner[p] for p in ps if p in owner}:
            old_nodes, old_ps = groups.pop(old)
            nodes += old_nodes
            pset |= old_ps
        groups[gid] = (nodes, pset)
        for p in pset:
            owner[p] = gid
    return groups
