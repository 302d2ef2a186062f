"""A worker target whose import takes 30 s: a start test_interrupt.py interrupts."""
import time

time.sleep(30)


class Never:
    pass
