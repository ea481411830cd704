"""FX facts every compile stage reads: placeholders, example values, the symbols in a value's
shape, per-step symbols, Python scalars passed as tensors (``graph_facts.py``).

Takes an FX graph (Dynamo's, or a piece of the split one); gives facts about it and changes
nothing. Compile time only: run time reads the plan instead.
"""
