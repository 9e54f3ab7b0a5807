"""What the tests of test_bad_inputs.py share (tests/*/test_bad_inputs.py: the tiers, and other test modules)."""

import os


class _Payload:
    """Unpickling this runs `touch MARKER`: what an attacker plants in a checkpoint file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
