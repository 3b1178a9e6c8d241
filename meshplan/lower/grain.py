"""Where an uneven split may cut each dim of each value: in whole units of its trailing atoms.

An op sees a dim as atoms, and only the leading one may be split (`strategies._layout_of`):
a view of a ``(8, 16, 32)`` batch as ``(128, 32)`` splits the 128 rows only in blocks of 16.
Even shards meet this by divisibility (the planner checks it); uneven shares do not — 128 rows
cut 0.4/0.3/0.2/0.1 on their own give 51 rows, not a whole number of sequences — so a value
freshly cut must be cut in the unit every op touching that dim (and every dim it is the same
atom as) reads it in. `cut_units` finds those units as a fixpoint over the graph: for every
op and atom, the atom's unit is the least common multiple of what each dim it leads needs,
and each dim's unit is then the atom's unit times that dim's trailing atoms. Units only grow
and stay divisors of the dim, so the loop ends.
"""

from __future__ import annotations

import math

from meshplan.ir.graph import Graph


def cut_units(graph: Graph) -> dict[tuple[str, int], int]:
    """``(value, dim) -> elements per unit`` for every dim some op reads or writes with
    trailing atoms (absent: 1)."""
    units: dict[tuple[str, int], int] = {}
    uses = []   # per op: atom -> [(value, dim, trailing elements)]
    for node in graph.nodes:
        sig = node.sig
        if sig is None or node.is_source:
            continue
        sizes = dict(sig.atom_sizes)
        lead: dict[str, list[tuple[str, int, int]]] = {}
        sides = [*zip(node.inputs, sig.inputs), (node.name, sig.output)]
        for value, dims in sides:
            for d, atoms in enumerate(dims):
                if atoms:
                    lead.setdefault(atoms[0], []).append(
                        (value, d, math.prod(sizes[a] for a in atoms[1:])))
        uses.append(lead)
    changed = True
    while changed:
        changed = False
        for lead in uses:
            for dims in lead.values():
                atom = 1
                for value, d, rest in dims:
                    atom = math.lcm(atom, math.lcm(units.get((value, d), 1), rest) // rest)
                for value, d, rest in dims:
                    if units.get((value, d), 1) != atom * rest:
                        units[(value, d)] = atom * rest
                        changed = True
    return units
