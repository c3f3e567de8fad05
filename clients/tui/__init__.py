"""The Textual terminal client (`opencomposer tui`).

Textual paints at most `TEXTUAL_FPS` frames a second (60 by default); a key press
that arrives just after a frame waits for the next slot. At 120 the wait is at most
~8 ms; streaming does not paint more often for it (the app draws the transcript on a
10 Hz tick). Set before Textual is imported; an explicit TEXTUAL_FPS wins.
"""

import os

os.environ.setdefault("TEXTUAL_FPS", "120")
