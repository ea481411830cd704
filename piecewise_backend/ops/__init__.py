"""The graph-safe decode attention op and its kernel: what rewritten graphs call at run time.

Takes nothing from the pipeline; gives ``piecewise::prefix_attention`` (``prefix_attention.py``,
registered with ``torch.library`` on import) and its split-key Triton kernel (``kernel.py``).
Both the rewrite (which inserts the op) and run time (which calls it) import it; it imports
neither.
"""
