"""Run time: what a compiled graph does per call, built from the frozen plan (``plan.py``).

``compiled_graph`` dispatches a call; ``piece_runner`` captures and replays one compute piece and
owns the step protocol; ``devices`` holds each GPU's graph pool and capture stream; ``capture_policy``
maps a batch size to a captured size; ``weight_sets`` keeps graphs per set of parameter addresses;
``up_front`` captures sizes before a call needs them; ``distributed`` makes ranks decide together;
``emulation`` stands in for CUDA graphs on CPU (tests). This package imports nothing of compile time
but the plan's types.
"""
