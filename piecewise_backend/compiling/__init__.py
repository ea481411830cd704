"""Stage 3, compile: each distinct compute piece compiled once with Inductor.

Takes the split graph and the fake inputs; gives a
:class:`~piecewise_backend.compiling.piece_compiler.CompiledPiece` per compute piece (its callable,
the fake args it was compiled for, its eager fallback) and every piece's fake output
(:class:`~piecewise_backend.compiling.piece_compiler.PiecesRun`). ``piece_compiler.py`` is the
entry; a piece holding many layers is compiled layer by layer (``layer_chain.py``).
"""
