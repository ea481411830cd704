"""Stage 2, split: the graph cut at attention into compute pieces (graphed) and eager ones.

Takes the rewritten graph and its inputs (``plan.types.GraphInputs``); gives a
:class:`~piecewise_backend.split.splitting.SplitGraph`: the split ``GraphModule``, each piece's kind
and why a node runs eagerly, the inputs compute pieces write in place. ``splitting.py`` is the
entry; ``attention_placement.py`` decides where attention goes, ``in_place_writes.py`` which
input writes may be captured, ``piece_boundaries.py`` what crosses a boundary.
"""
