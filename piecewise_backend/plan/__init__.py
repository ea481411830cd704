"""Stage 4, plan: everything a compiled graph does per call, decided once and frozen.

Takes what the compile stages found (the rewritten inputs, the split graph, the compiled pieces,
their fake outputs); gives a :class:`~piecewise_backend.plan.types.GraphPlan`, the only thing
compile time hands to run time. ``types.py`` holds the plan's types (all that run time imports of
compile time), ``making.py`` decides them: shape keys, padding (``padding.py``, proved safe by
``rows/``), how a call is captured whole (``full_graph.py``), staging (``staging.py``), signatures,
and the compile-time halves of the SDPA choice
(``sdpa_choice.py``), of rank agreement (``collectives.py``) and of CPU emulation (``emulation.py``).
"""
