"""Prints, then sleeps: for time limits and interrupts."""

import time

print("sleeping", flush=True)
time.sleep(float(__import__("sys").argv[1]))
print("woke")
