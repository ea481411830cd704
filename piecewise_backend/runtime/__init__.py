"""Stage 5, wrap and run: what a compiled graph does per call, built from the frozen plan.

Takes a :class:`~piecewise_backend.plan.types.GraphPlan` and the options; gives a
:class:`~piecewise_backend.runtime.compiled_graph.CompiledGraph`, the callable Dynamo installs.
``compiled_graph`` dispatches a call; ``call_guard`` lets one graphed call at a time use a device,
in its callers' stream order; ``piece_runner`` captures and replays one compute piece and owns the
step protocol; ``full_graph`` captures and replays a whole call as one graph, when the caller says
it may (``graph_mode``); ``buffers`` holds what both kinds of graph copy into and alias;
``split_forward`` is the split graph's cheap forward; ``devices`` holds each GPU's graph pool and capture stream and keeps captures from
disturbing other threads; ``capture_policy`` maps a batch size to a captured size;
``capture_retries`` tries failed captures again; ``weight_sets`` keeps graphs per set of parameter
addresses; ``up_front`` captures sizes before a call needs them; ``distributed`` makes ranks decide
together; ``emulation`` stands in for CUDA graphs on CPU (tests); ``stats`` keeps the counters;
``symbolic`` evaluates the plan's symbolic shapes at a call's sizes. Of compile time this package
imports the plan's types alone (``tests/test_package_structure.py`` keeps it so).
"""
