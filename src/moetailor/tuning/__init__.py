"""`moetailor tune`: the cheapest plan that keeps a quality floor on the user's traffic, at a budget or speed.

``candidates``: one point of the search space (criterion, per-layer pool sizes, folding, top-k) and
the plan it becomes; ``sensitivity``: per-layer pool sizes under a fixed total from measured layer
sensitivity; ``front``: Pareto fronts, the choice against floor and target, the sign test;
``search``: the staged search (KL proxies first, task accuracy on the few best), cached in its
output folder so an interrupted run resumes; ``report``: the table, front.json, front.md, front.png.
"""
