"""Stage 6, across processes: a compiled graph saved, and loaded in a new process with no trace and no compile.

Takes a :class:`~piecewise_backend.runtime.compiled_graph.CompiledGraph` built under torch's AOT
route (``torch.compile(...).aot_compile``); gives bytes that hold its plan (a run-time value:
``plan.types``), its program (FX code) and each distinct piece's compiled code (Inductor's bundled
artifacts), and back from them a graph that runs as the saved one did.

* ``artifact.py``: the compiled graph as torch's AOT route saves a backend's result
  (``SerializableCallable``), with the checks that refuse an artifact made elsewhere;
* ``piece_code.py``: a compute piece's code (Inductor's, a layer chain of it, or the traced code);
* ``artifact_file.py``: the file itself: the functions torch's AOT route serialised, and the
  package's Triton kernels (``ops/kernel_bundle.py``), kept current as the process compiles more;
* ``warm_start.py``: what users call, :func:`save`, :func:`preload` and :func:`load`, falling back
  to compiling with the reason said when an artifact does not fit.
"""
