"""The zero-bubble split of one stage's backward: I (input gradient) now, W (weight gradients) later.

The autograd graph of a stage's forward has two kinds of nodes:

* the *input path*: nodes from which the stage's input can be reached (dX = dY W^T through the
  linears, attention, norms and tensor-parallel collectives). The stage upstream waits for them.
* *weight branches*: nodes from which only parameters can be reached (the transpose and
  AccumulateGrad behind a weight). Nobody waits for them.

A node on the input path with an edge into a weight branch is a *junction*: a linear's
``MmBackward`` (dX on one edge, dW = X^T dY on the other), a norm's ``MulBackward``. I runs
``autograd.backward`` from the outputs to the input only, keeping the graph and, through a pre-hook
on every junction, the gradient flowing into it (dY). W runs ``autograd.backward`` from the junctions,
with those gradients, to the parameters behind them. Autograd computes a node's output only for the
edges that lead to a requested input, so a junction re-entered in W computes its weight output and
not its input output, and no node of the input path beyond the junctions runs again. (This is what
``torch.distributed.pipelining``'s ``stage_backward_input`` / ``stage_backward_weight`` do.)

W makes one ``autograd.backward`` call per *group*: the junctions and parameters joined by weight
branches (usually one linear: its junction and its weight). One call for all groups would not do:
the input-path edge of a junction leads, through the layers below, to other requested parameters,
so autograd would compute dX again. Each parameter belongs to one group, so its gradient is
accumulated once per W and the engines' post-accumulate hooks fire once per micro-batch, as after a
plain backward.

Checkpointed blocks (the ``Checkpointed`` wrapper), and every wrapper marked ``WholeBackward``
(the fused loss head, a compiled region whose one backward computes dX and dW together), are not
split: their parameters are *eager*, I accumulates their gradients itself. Checkpointing recomputes a block's forward in every backward
call that unpacks one of its saved tensors, so deferring their dW would recompute the block again
in W: one more forward per micro-batch, against a bubble that only p - 1 of them fill (with dW
about a forward, that pays below m = 3(p - 1) micro-batches and costs above); and under ZeRO-3
the block's weights, gathered for I by the block's backward hook, have been released by the next
forward before that W.

Edge cases, all exact: a stage whose input needs no gradient (the first) has no input path, and
its W is the whole backward (its I computes nothing; ZB-H1 runs that W right after I anyway). A
parameter used by two junctions one above the other (weights shared across layers) would make
the upper junction's call reach the lower junction through the input path; a pre-hook then
replaces what arrives there with the gradient captured in I, so nothing is counted twice (the
dX between them is computed again, the only redone work; our models share no weights in a
stage).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from bigtrain.wrappers import WholeBackward


@dataclass
class _Group:
    """Junctions and the parameters their weight branches reach, differentiated in one call."""

    junctions: list[Node] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)


@dataclass
class WeightGrads:
    """What I leaves for W: per group, the junctions' captured output gradients; on a stage whose
    input needs no gradient, ``whole``: (its outputs, their gradients, every parameter)."""

    groups: list[_Group]
    captured: dict[Node, tuple[torch.Tensor | None, ...]]
    whole: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor | None], list[torch.Tensor]] | None = None

    def held_bytes(self) -> int:
        """Bytes of the gradients kept for W (distinct storages): the junctions' output gradients (a
        linear's dY, the head's d logits), or the whole backward's output gradients. Held from I to
        W on top of the forward's saved tensors, which the retained graph keeps as well."""
        kept = [g for grads in self.captured.values() for g in grads if g is not None]
        if self.whole is not None:
            kept += [g for g in self.whole[1] if g is not None]
        return sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in kept}.values())

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad`` (hooks fire as in a plain backward)."""
        if self.whole is not None and self.whole[2]:
            outputs, grads, params = self.whole
            torch.autograd.backward(outputs, grads, inputs=params)
        for group in self.groups:
            _run_group(group, self.captured)
        self.groups, self.captured, self.whole = [], {}, None  # the graph goes with them


def backward_input(outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Iterable[torch.Tensor],
                   eager: Iterable[torch.Tensor] = ()) -> tuple[list[torch.Tensor | None], WeightGrads]:
    """I: the gradients of ``inputs`` (None where an input needs none), and the deferred W.

    ``outputs`` are the stage's outputs (or its loss) with ``output_grads`` (None for a scalar
    loss); W accumulates the gradients of ``params``, I those of ``eager`` (the parameters of
    checkpointed blocks: see the module docstring)."""
    needed = [x for x in inputs if x.requires_grad]
    consumers = _consumers([get_gradient_edge(t).node for t in outputs])
    on_input_path = _reaching({get_gradient_edge(x).node for x in needed}, consumers)
    leaf_nodes = _leaf_nodes(consumers)
    deferred, eager = _used(params, leaf_nodes), _used(eager, leaf_nodes)
    if not on_input_path:  # the first stage: nothing for I, and W is the whole backward
        return [None] * len(inputs), WeightGrads([], {}, (list(outputs), list(output_grads), deferred + eager))
    captured = _root_grads(outputs, output_grads, on_input_path)
    groups = _groups(deferred, leaf_nodes, consumers, on_input_path)
    if not python_node_edges():  # such groups' weight gradients are computed by I, with the eager ones
        whole = [g for g in groups if any(isinstance(j, torch._C._FunctionBase) for j in g.junctions)]
        groups = [g for g in groups if not any(g is w for w in whole)]
        eager = eager + [p for g in whole for p in g.params]
    handles = [j.register_prehook(_capture(j, captured)) for g in groups for j in g.junctions
               if j in on_input_path]
    try:
        # backward, not grad: the eager parameters' post-accumulate hooks must fire.
        torch.autograd.backward(outputs, output_grads, retain_graph=True, inputs=needed + eager)
    finally:
        for handle in handles:
            handle.remove()
    return [_take_grad(x) for x in inputs], WeightGrads(groups, captured)


def split_parameters(module: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters whose gradients W computes, eager ones that I computes): the parameters of
    the modules in a ``WholeBackward`` wrapper (a checkpointed block, the fused head, a compiled
    region) are eager (see the module docstring)."""
    blocks = [m for m in module.modules() if isinstance(m, WholeBackward)]
    eager = {id(p): p for block in blocks for p in block.parameters()}
    return [p for p in module.parameters() if id(p) not in eager], list(eager.values())


def _leaf_nodes(consumers: dict[Node, list[Node]]) -> dict[int, Node]:
    """id(leaf tensor) -> its AccumulateGrad node, for the leaves this graph reaches."""
    return {id(node.variable): node for node in consumers if hasattr(node, "variable")}


def _used(params: Iterable[torch.Tensor], leaf_nodes: dict[int, Node]) -> list[torch.Tensor]:
    """The parameters this forward used: the others get no gradient, as in a plain backward."""
    return [p for p in params if p.requires_grad and id(p) in leaf_nodes]


def _take_grad(x: torch.Tensor) -> torch.Tensor | None:
    grad, x.grad = x.grad, None
    return grad


@functools.cache
def python_node_edges() -> bool:
    """Whether this torch's autograd keeps the node of a Python ``autograd.Function`` (a compiled
    region's, float8's, int8 compression's) alive for a ``GradientEdge`` when nothing else holds its
    graph. torch 2.13 does; 2.11 (the GPU image's) frees it with the tensor it made, and a W from
    it fails (``'_input_metadata' is invalid for this instance of _C._FunctionBase``). There a
    group whose junction is such a node is differentiated in I, whole."""
    x = torch.ones(2, requires_grad=True)
    node = _Scale.apply(x, 2.0).grad_fn  # the output is gone at once, as a stage's after I
    try:
        torch.autograd.backward([GradientEdge(node, 0)], [torch.ones(2)], inputs=[x])
    except RuntimeError:
        return False
    return x.grad is not None


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x * factor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


# ---------------------------------------------------------------------- the graph walk

def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots`` -> the nodes whose gradient flows into it (its users
    in the forward), in a deterministic order (tensor-parallel ranks must run W alike)."""
    consumers: dict[Node, list[Node]] = {}
    queue = deque()
    for root in roots:
        if root is not None and root not in consumers:
            consumers[root] = []
            queue.append(root)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in consumers:
                consumers[child] = []
                queue.append(child)
            consumers[child].append(node)
    return consumers


def _reaching(targets: set[Node], consumers: dict[Node, list[Node]]) -> set[Node]:
    """The nodes from which one of ``targets`` can be reached (targets included)."""
    found = {t for t in targets if t in consumers}
    queue = deque(found)
    while queue:
        for user in consumers[queue.popleft()]:
            if user not in found:
                found.add(user)
                queue.append(user)
    return found


def _junctions_of(param_node: Node, consumers: dict[Node, list[Node]], on_input_path: set[Node]) -> list[Node]:
    """Walk up from a parameter through its weight branch to where it meets the input path (or a
    root of the graph that is not on it)."""
    seen, queue, junctions = {param_node}, deque([param_node]), []
    while queue:
        node = queue.popleft()
        users = consumers.get(node, [])
        if node is not param_node and (node in on_input_path or not users):
            junctions.append(node)
            continue
        for user in users:
            if user not in seen:
                seen.add(user)
                queue.append(user)
    return junctions


def _groups(params: list[torch.Tensor], param_nodes: dict[int, Node], consumers: dict[Node, list[Node]],
            on_input_path: set[Node]) -> list[_Group]:
    """Parameters joined by shared junctions; the last parameters first, as a plain backward
    produces them (so gradient reductions start in the same order)."""
    group_of: dict[Node, _Group] = {}  # junction -> its group
    for param in reversed(params):
        junctions = _junctions_of(param_nodes[id(param)], consumers, on_input_path)
        group = _Group(params=[param])
        for other in {id(g): g for g in (group_of[j] for j in junctions if j in group_of)}.values():
            group.junctions += other.junctions
            group.params += other.params
        group.junctions += [j for j in junctions if j not in group.junctions]
        for j in group.junctions:
            group_of[j] = group
    return list({id(g): g for g in group_of.values()}.values())


# ---------------------------------------------------------------------- I and W

def _capture(node: Node, captured: dict[Node, tuple]):
    def hook(grad_outputs):
        captured[node] = tuple(grad_outputs)
    return hook


def _root_grads(outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor | None],
                on_input_path: set[Node]) -> dict[Node, tuple[torch.Tensor | None, ...]]:
    """The outputs off the input path (all of them on a stage whose input needs no gradient): W
    starts there, with the output gradient (ones for a scalar loss, as autograd does)."""
    starts: dict[Node, dict[int, torch.Tensor]] = {}
    for out, grad in zip(outputs, output_grads):
        node, index = get_gradient_edge(out)[:2]
        if node not in on_input_path:
            starts.setdefault(node, {})[index] = torch.ones_like(out) if grad is None else grad
    return {node: tuple(by_index.get(i) for i in range(max(by_index) + 1)) for node, by_index in starts.items()}


def _run_group(group: _Group, captured: dict[Node, tuple]) -> None:
    edges, grads = [], []
    for junction in group.junctions:
        for i, grad in enumerate(captured.get(junction, ())):
            if grad is not None:
                edges.append(GradientEdge(junction, i))
                grads.append(grad)
    if not edges or not group.params:
        return  # no gradient reached this group's junctions: none reaches its parameters either
    # A junction reached again from another one of the group (shared weights) takes the gradient
    # captured in I, not the sum with what W recomputed down the input path.
    handles = [j.register_prehook(lambda _, g=captured[j]: g) for j in group.junctions
               if len(group.junctions) > 1 and j in captured]
    try:
        torch.autograd.backward(edges, grads, inputs=group.params)
    finally:
        for handle in handles:
            handle.remove()
