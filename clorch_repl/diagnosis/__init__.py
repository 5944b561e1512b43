"""Why a cell hangs: each rank's flight recorder and stack, read while it is blocked, lined up
across ranks into one sentence (the verdict) with the evidence below it.

* :mod:`.record` turns torch's flight recorder on before a process group exists and reads it;
* :mod:`.probe` is what a rank answers when asked "where are you" (from its kernel's control
  thread, so it answers while the main thread is blocked in a collective), and how the notebook
  asks every rank at once over the ranks' signed control channels;
* :mod:`.analyse` lines the answers up by process group and sequence number and finds the first
  collective the ranks disagree on;
* :mod:`.render` writes the verdict and the per-rank evidence as text.
"""

#: Seconds without output and without a finished collective before a cell says why it is stuck.
DEFAULT_HANG_NOTICE_S = 30.0
