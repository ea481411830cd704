"""Stage 5, wrap and run: what a compiled graph does per call, built from the frozen plan.

Takes a :class:`~piecewise_backend.plan.types.GraphPlan` and the options; gives a
:class:`~piecewise_backend.runtime.compiled_graph.CompiledGraph`, the callable Dynamo installs.
``compiled_graph`` dispatches a call; ``call_guard`` lets one graphed call at a time use a device,
in its callers' stream order, and one capture at a time record there; ``piece_runner`` replays one
compute piece (``step_state``: what the graph tells its runners about the call); ``full_graph``
replays a whole call as one graph, when the caller says it may (``graph_mode``); ``capture/`` is
every capture decision and every way a graph gets made: per call, which graph serves it, and the
captures made inline or by the capture thread behind the calls (its package is its one entry);
``buffers`` holds what both kinds of graph copy into and alias; ``split_forward`` is the split
graph's cheap forward; ``devices`` holds each GPU's graph pool and capture stream and keeps
captures from disturbing other threads; ``distributed`` makes ranks decide together; ``emulation``
stands in for CUDA graphs on CPU (tests); ``stats`` keeps the counters, ``compile_clock`` the
seconds callers spent compiling; ``direct_calls`` lets a caller skip Dynamo for signatures it has
seen; ``symbolic`` evaluates the plan's symbolic shapes at a call's sizes. Of compile time this
package imports the plan's types alone (``tests/test_package_structure.py`` keeps it so).
"""
