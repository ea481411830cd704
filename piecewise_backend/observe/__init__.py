"""What people read: the split graphs and their pieces (``inspection.py``), and the whole process's
counters (``reports.py``).

Takes the live compiled graphs (the registry) and their plans and stats; gives reports, tables and
debug dumps. Changes nothing it reads.
"""
