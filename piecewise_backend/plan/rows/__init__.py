"""The row-independence proof behind padding: which ops keep a batch's rows apart.

Takes a compute piece's FX graph and the batch symbol; gives, per piece, whether a padded batch
leaves the caller's rows as they would be unpadded, and the tensors whose rows cap the padded size.
``row_independence.py`` runs the proof over the graph; ``row_ops.py`` knows how each op treats
rows, ``row_indexing.py`` indexing by row.
"""
