"""The capture machinery of run time, one room: which graph serves a call, and how graphs get made.

What the rest of run time uses comes from here, never from the modules inside:

* :class:`CaptureDecisions` (``decisions.py``): per call, replay, ride, capture (behind the call or
  inline), retry, replace, or un-graphed with a counted reason; and the state those are decided
  from: the captured keys per set of parameter addresses (``weight_sets.py``), the capture sizes,
  padding and budget (``policy.py``, ``deferral.py``, ``traffic.py``), failed keys (``retries.py``);
* :func:`capture_piece` (``piece.py``): a piece captured inline, in the call that needs it;
* the capture thread (``behind.py``, ``handover.py``, ``behind_record.py``): keys captured behind the
  calls, with no kernel run, handed back between two calls; :func:`wait_for_captures` waits for it;
* :class:`UpFrontCapture` (``up_front.py``): sizes captured before a call needs them;
* what a capture leaves, :class:`Captured` and :class:`WholeCapture` (``captured.py``), which the
  replay paths read.
"""

from .captured import Captured, WholeCapture
from .decisions import CaptureDecisions
from .handover import THREAD
from .handover import wait as wait_for_captures
from .piece import capture_piece
from .policy import Route
from .up_front import UpFrontCapture

hold_captures, release_captures = THREAD.hold, THREAD.release  # around each call (behind.py: why)

__all__ = [
    "CaptureDecisions",
    "Captured",
    "Route",
    "UpFrontCapture",
    "WholeCapture",
    "capture_piece",
    "hold_captures",
    "release_captures",
    "wait_for_captures",
]
