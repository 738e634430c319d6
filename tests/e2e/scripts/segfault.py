"""Rank 1 dies of SIGSEGV (a NULL read through ctypes); rank 0 sleeps. Standard library only."""

import ctypes
import os
import time


def crash():
    if os.environ["RANK"] == "1":
        ctypes.string_at(0)  # at:crash
    time.sleep(60)


crash()
